"""One CP-v2 rank of sglang 0.5.16-0.5.19's Ascend prefill, as its own process.

``python cp_pad_worker.py RANK WORLD PORT CASES_JSON OUT_JSON``

Started twice (ranks 0 and 1 of a ``torch.distributed`` gloo group on
127.0.0.1:PORT) by tests/lanes/test_sglang_cp_pad_gather.py, with
``NPU_SHIM_EMULATE=1``, ``ASCEND_USE_FIA=1`` and ``SGLANG_ENABLE_CP_V2=1``.
For every case, first with npu-shim's ``sglang.cp_pad_gather`` applied, then
after ``npu_shim.uninstall()`` (upstream), each rank runs one attention layer of
a CP prefill the way sglang does:

Real sglang (the lane's wheel):
* server arguments published with sglang's own test hook
  (``get_context().override_server_args``: ``--enable-prefill-cp``,
  ``--cp-strategy zigzag``, ``--attn-cp-size 2``) and the parallel topology
  with ``get_parallel().override`` (attn-CP size, rank, group);
* the attention-CP group is sglang's ``GroupCoordinator`` over a gloo process
  group; sglang's NPU code path calls its ``_all_gather_into_tensor``
  (``all_gather_into_tensor``'s NPU branch, bound on the instance here because
  its non-NPU branch goes through a CUDA-only custom op);
* ``prepare_cp_forward`` (``ZigzagCPStrategy.build_metadata`` +
  ``pad_logical_token_to_physical``) on a real ``ForwardBatch``; the rank's
  rows from ``ZigzagCPStrategy.shard_hidden_states`` (pad rows included);
* ``NPUMHATokenToKVPool`` (FIA layout, ``npu_scatter_nd_update_`` writes),
  ``RadixAttention``, ``AscendAttnBackend.init_forward_metadata`` and
  ``AscendAttnBackend.forward_extend`` -> ``_cp_allgather_and_save_kv_npu`` ->
  ``cp_all_gather_rerange_kv_cache`` -> ``do_cp_attn_fia`` -> FIA.

Not real: ``memory_pool_npu.torch_npu`` is bound to the emulation (the module
imports torch_npu only where sglang detects an NPU); the backend instance is made with ``object.__new__`` (its
``__init__`` needs a ModelRunner and an NPU device) and given the attributes
``forward_extend`` reads; torch_npu is npu-shim's emulation.

Per case it reports: upstream's exception (or its output), the patched
output's max error against the float64 causal reference on the real rows, the
pad rows' values, whether the KV pool holds every new token's K/V exactly,
host syncs of the layer call, the FIA calls' query rows vs their
``actual_seq_lengths``, and whether the patched output equals upstream's bit
for bit where upstream runs.
"""
import datetime
import json
import os
import sys
import time
import traceback


def setup_group(rank, world):
    from sglang.srt.distributed.parallel_state import GroupCoordinator

    group = GroupCoordinator(
        group_ranks=[list(range(world))], local_rank=rank, torch_distributed_backend="gloo",
        use_pynccl=False, use_pymscclpp=False, use_custom_allreduce=False,
        use_torch_symm_mem_all_reduce=False, use_hpu_communicator=False,
        use_xpu_communicator=False, use_npu_communicator=False, group_name="attn_cp")
    group.all_gather_into_tensor = group._all_gather_into_tensor   # its NPU branch
    return group


def make_pool(spec, batch):
    import torch_npu

    from sglang.srt.hardware_backend.npu import memory_pool_npu
    from sglang.srt.hardware_backend.npu.memory_pool_npu import NPUMHATokenToKVPool

    # The module imports torch_npu only where sglang detects an NPU (``if is_npu():``); bind
    # the emulated one there, as that import would on the NPU box.
    memory_pool_npu.torch_npu = torch_npu
    slots = batch.k_cache.shape[0]
    pool = NPUMHATokenToKVPool(
        size=slots - spec.page_size, page_size=spec.page_size, dtype=spec.dtype,
        head_num=spec.num_kv_heads, head_dim=spec.qk_head_dim, layer_num=1, device="cpu",
        enable_memory_saver=False, v_head_dim=spec.v_head_dim)
    assert pool.use_fia, "ASCEND_USE_FIA=1 must be set before the pool is made"
    # cached prefixes (and garbage in slots nobody owns), as cp_case.make_batch laid them out
    pool.k_buffer[0].view(slots, spec.num_kv_heads, spec.qk_head_dim).copy_(batch.k_cache)
    pool.v_buffer[0].view(slots, spec.num_kv_heads, spec.v_head_dim).copy_(batch.v_cache)
    return pool


def make_backend(module, spec, batch, pool, forward_batch, world):
    backend = object.__new__(module.AscendAttnBackend)
    backend.page_size = spec.page_size
    backend.device = "cpu"
    backend.req_to_token_pool = batch.req_to_token_pool
    backend.token_to_kv_pool = pool
    backend.speculative_step_id = 0
    backend.speculative_num_draft_tokens = None
    backend.is_hybrid_swa = False
    backend.use_mla = False
    backend.use_sliding_window_kv_pool = False
    backend.is_dllm_model = False
    backend.use_fia = True
    backend.attn_cp_size = world
    backend.fia_mask = module.AscendAttnMaskBuilder.generate_mask_flag(2048)
    module.AscendAttnBackend.init_forward_metadata(backend, forward_batch)
    return backend


def raising_function(exc):
    """The innermost function the exception came from (a torch tensor method counts), not
    counting the frames the active sync counter and torch's dispatch machinery put under it."""
    def machinery(filename):
        if filename.endswith(os.path.join("testing", "syncs.py")):
            return True
        in_torch = "%storch%s" % (os.sep, os.sep) in filename
        return in_torch and not filename.endswith(("_tensor.py", "functional.py"))

    frames = traceback.extract_tb(exc.__traceback__)
    return next((f.name for f in reversed(frames) if not machinery(f.filename)), frames[-1].name)


def run_case(module, spec, rank, world):
    import torch

    from npu_shim.testing import cp_case
    from npu_shim.testing import count_host_syncs
    from npu_shim.testing.calls import record_npu_calls
    from sglang.srt.layers.cp.base import get_cp_strategy
    from sglang.srt.layers.cp.utils import prepare_cp_forward

    batch = cp_case.make_batch(spec, write_new_tokens=False)
    forward_batch = cp_case.make_forward_batch(batch, None)
    prepare_cp_forward(forward_batch)
    metadata = forward_batch.attn_cp_metadata
    strategy = get_cp_strategy()
    new_k, new_v = batch.packed_new_kv()
    local_q = strategy.shard_hidden_states(batch.packed_q(), forward_batch)
    local_k = strategy.shard_hidden_states(new_k.reshape(new_k.shape[0], -1), forward_batch)
    local_v = strategy.shard_hidden_states(new_v.reshape(new_v.shape[0], -1), forward_batch)
    pool = make_pool(spec, batch)
    backend = make_backend(module, spec, batch, pool, forward_batch, world)
    layer = cp_case.make_layer(spec)
    logical = metadata.per_rank_logical_token
    result = {"label": spec.label(), "extend_lens": list(spec.extend_lens),
              "physical_rows": list(metadata.per_rank_actual_token), "logical_rows": list(logical),
              "padded": logical != metadata.per_rank_actual_token, "local_rows": local_q.shape[0]}
    try:
        with record_npu_calls() as calls, count_host_syncs(cpu_is_device=True) as syncs:
            out = backend.forward_extend(
                local_q, local_k.view(-1, spec.num_kv_heads, spec.qk_head_dim),
                local_v.view(-1, spec.num_kv_heads, spec.v_head_dim), layer, forward_batch)
    except Exception as exc:   # upstream's crash is what is being measured
        result["error"] = "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0][:300])
        result["error_in"] = raising_function(exc)
        return result, None
    result["error"] = None
    result["host_syncs"] = syncs.count
    fia = [c for c in calls if c.name == "npu_fused_infer_attention_score"]
    result["fia_calls"] = [[int(c.arg("query", 0).shape[0]), int(c.arg("actual_seq_lengths")[-1])]
                           for c in fia]
    k_slots = pool.k_buffer[0].view(-1, spec.num_kv_heads, spec.qk_head_dim)
    v_slots = pool.v_buffer[0].view(-1, spec.num_kv_heads, spec.v_head_dim)
    slots = batch.new_token_slots()
    result["kv_exact"] = bool(torch.equal(k_slots[slots], new_k) and torch.equal(v_slots[slots], new_v))
    real = logical[rank]
    expected = cp_case.rank_expected(batch, batch.reference(), rank)
    result["out_rows"] = out.shape[0]
    result["max_abs_err"] = cp_case.max_abs_err(out[:real], expected)
    result["pad_rows_max_abs"] = float(out[real:].abs().max()) if out.shape[0] > real else 0.0
    result["tolerance"] = cp_case.tolerance(spec.dtype)
    return result, out


def main(rank, world, port, cases_json, out_path):
    started = time.perf_counter()
    import torch
    import torch.distributed as dist

    import npu_shim

    npu_shim.install()
    import importlib

    module = importlib.import_module("sglang.srt.hardware_backend.npu.attention.ascend_backend")
    from npu_shim.testing import cp_case
    from npu_shim.patches.sglang import cp_pad_gather as patch
    from sglang.srt.layers.utils import cp_utils
    from sglang.srt.runtime_context import get_context, get_parallel

    row = next(r for r in npu_shim.status() if r["name"] == patch.PATCH.name)
    report = {"rank": rank, "state": row["state"], "reason": row["reason"], "cases": []}
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        group = setup_group(rank, world)
        overrides = get_context().override_server_args(
            device="cpu", enable_prefill_cp=True, cp_strategy="zigzag", attn_cp_size=world,
            enable_prefill_context_parallel=True, prefill_cp_mode="in-seq-split")
        overrides.install()
        specs = [cp_case.Spec.from_json(json.dumps(c)) for c in json.loads(cases_json)]
        with get_parallel().override(attn_cp_size=world, attn_cp_rank=rank, attn_cp_group=group):
            patched = [run_case(module, spec, rank, world) for spec in specs]
            npu_shim.uninstall()
            report["restored"] = (module.cp_all_gather_rerange_kv_cache is cp_utils.cp_all_gather_rerange_kv_cache
                                  and getattr(module.AscendAttnBackend.do_cp_attn_fia,
                                              "__npu_shim_patch__", None) is None)
            upstream = [run_case(module, spec, rank, world) for spec in specs]
        for (p_result, p_out), (u_result, u_out) in zip(patched, upstream):
            entry = {"patched": p_result, "upstream": u_result}
            if p_out is not None and u_out is not None:
                entry["bit_identical"] = bool(torch.equal(p_out, u_out))
            report["cases"].append(entry)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    report["seconds"] = time.perf_counter() - started
    with open(out_path, "w") as handle:
        json.dump(report, handle)


if __name__ == "__main__":
    rank, world, port = (int(x) for x in sys.argv[1:4])
    main(rank, world, port, *sys.argv[4:6])
