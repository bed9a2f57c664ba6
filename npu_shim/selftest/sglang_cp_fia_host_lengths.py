"""Selftest of ``sglang.cp_fia_host_lengths``: one CP prefill layer through the patched method (sglang 0.5.23).

Binds sglang's ``ZigzagCPStrategy`` for each rank of cp_size 2 in turn
(``init_cp_strategy`` under ``get_parallel().override``, inside
``disable_cp_strategy`` so that whatever strategy the process had comes back),
builds the rank's metadata with the strategy's own ``build_metadata`` and
``pad_logical_token_to_physical``, shards the queries with
``shard_hidden_states`` (pad rows included), and runs the patched
``AscendAttnBackend.do_cp_attn_fia`` on three sequences of uneven length (one
padded, one with a cached prefix), GQA, a paged cache with shuffled pages.
Reports the largest deviation of the logical rows from the float64 causal
reference (pad rows must be zero, else the error is reported as infinite) and
the host syncs of a rank's call with the metadata's tensors treated as device
tensors (0: the lengths come from the metadata's host lists).

The backend is made with ``object.__new__`` and given what the method reads
(``page_size``, ``device``, ``forward_metadata.block_tables``, ``fia_mask``):
its ``__init__`` needs a whole ``ModelRunner``. The batch, the backend, the
reference and the zigzag split come from :mod:`npu_shim.testing.cp_case`, the
builder the lane tests use too.
"""

PATCH_NAME = "sglang.cp_fia_host_lengths"
CP_SIZE = 2
EXTEND_LENS = (37, 70, 21)
PREFIX_LENS = (0, 9, 4)
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
PAGE_SIZE = 128


def _patched_module():
    from npu_shim.selftest import applied_target, on_upstream

    module = applied_target(PATCH_NAME)
    method = module.AscendAttnBackend.__dict__["do_cp_attn_fia"]
    if not on_upstream(PATCH_NAME) and getattr(method, "__npu_shim_patch__", None) != PATCH_NAME:
        raise RuntimeError("%s reports applied but do_cp_attn_fia is not the shim's" % PATCH_NAME)
    return module


def run(device=None):
    import torch
    from sglang.srt.layers.cp import base
    from sglang.srt.layers.cp.padding import pad_logical_token_to_physical

    from npu_shim.testing import cp_case

    device = device or "cpu"
    module = _patched_module()
    dtype = torch.float16  # taken by the real op on every device class that has it (emulation.dtypes)
    spec = cp_case.Spec(extend_lens=EXTEND_LENS, prefix_lens=PREFIX_LENS, page_size=PAGE_SIZE,
                        num_heads=HEADS, num_kv_heads=KV_HEADS, qk_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
                        cp_size=CP_SIZE, dtype=dtype)
    case = cp_case.ascend_layer_case(module, spec, device)
    seq_lens = list(spec.seq_lens)
    packed_q = case.batch.packed_q().to(device)

    err, syncs, seconds = 0.0, 0, 0.0
    for rank in range(CP_SIZE):
        topology = dict(tp_size=CP_SIZE, tp_rank=rank, attn_tp_size=1, attn_tp_rank=0, attn_dp_size=1,
                        attn_dp_rank=0, attn_cp_size=CP_SIZE, attn_cp_rank=rank, moe_tp_size=CP_SIZE,
                        moe_ep_size=1, moe_dp_size=1)
        with base.disable_cp_strategy(), cp_case.simulated_rank(enable_prefill_cp=True,
                                                                 cp_strategy="zigzag", **topology):
            base.init_cp_strategy(enable_prefill_cp=True, cp_size=CP_SIZE, cp_strategy="zigzag")
            strategy = base.get_cp_strategy()
            meta = strategy.build_metadata(sum(EXTEND_LENS), seq_lens, list(EXTEND_LENS))
            pad_logical_token_to_physical(meta)
            forward_batch = cp_case.make_forward_batch(case.batch, meta)
            local_q = strategy.shard_hidden_states(packed_q, forward_batch)
            meta_tensors = [t for t in vars(meta).values() if isinstance(t, torch.Tensor)]
            out, call_syncs, call_seconds = cp_case.run_cp_fia(module, case, local_q, forward_batch,
                                                               meta_tensors)
            seconds += call_seconds
        syncs = max(syncs, call_syncs)
        rows = len(cp_case.zigzag_layout(EXTEND_LENS, CP_SIZE, rank))
        expected = cp_case.rank_expected(case.batch, case.reference, rank)
        err = max(err, cp_case.max_abs_err(out[:rows].cpu(), expected))
        if out.shape[0] < rows or bool(out[rows:].ne(0).any()):
            err = float("inf")
    return {
        "max_abs_err": err,
        "tolerance": cp_case.tolerance(dtype),
        "host_syncs": syncs,
        "seconds": seconds,
        "detail": "AscendAttnBackend.do_cp_attn_fia via ZigzagCPStrategy, cp_size %d (both ranks, pad "
                  "rows), %s new tokens (prefixes %s), %d heads over %d KV heads x %d, page %d, "
                  "shuffled pages, %s on %s" % (
                      CP_SIZE, "/".join(map(str, EXTEND_LENS)), "/".join(map(str, PREFIX_LENS)),
                      HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, str(dtype).replace("torch.", ""), device),
    }
