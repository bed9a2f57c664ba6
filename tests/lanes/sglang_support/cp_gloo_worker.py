"""One context-parallel rank of a sglang CP prefill, as its own process.

``python cp_gloo_worker.py RANK WORLD PORT WHEEL SPEC_JSON OUT_JSON``

Started twice by tests/lanes/test_sglang_cp_fia_gloo.py (ranks 0 and 1 of a
``torch.distributed`` gloo group on 127.0.0.1:PORT). Each process:

1. loads the broken-window sglang build (broken_window.py: installed 0.5.13
   module, ``do_cp_attn_fia`` from the 0.5.12 wheel) and lets npu-shim patch it
   through its import hook, as in a user's worker process;
2. holds the cached prefixes in its paged KV cache, and of the new tokens only
   its own zigzag share (``cp_split_and_rebuild_data`` with sglang's real
   metadata for this rank);
3. all-gathers the new tokens' K/V over gloo and writes them into its cache
   at ``out_cache_loc`` -- the steps of sglang's
   ``_cp_allgather_and_save_kv_npu`` / ``cp_all_gather_rerange_kv_cache``
   (K and V concatenated on the feature dim, padded to ``max_rank_len``,
   gathered, trimmed to ``per_rank_actual_token``, split by
   ``reverse_split_len`` and reordered by ``cp_reverse_index``), done with
   ``torch.distributed`` directly because sglang's own helpers need its
   attention-CP ``GroupCoordinator`` (a full sglang parallel state);
4. runs the patched ``AscendAttnBackend.do_cp_attn_fia`` on its local queries;
5. all-gathers the outputs the same way (``cp_all_gather_rerange_output``'s
   steps) into the full batch in the original token order;
6. compares: its local output and the gathered output against the float64
   reference, and the gathered output against the same method run for both
   ranks inside this one process (single-process reference run).

Writes its findings as JSON to OUT_JSON.
"""
import datetime
import json
import sys
import time


def gather_rerange(dist, local, metadata, world):
    """All-gather rank-local rows and restore the original token order (sglang's steps)."""
    import torch
    import torch.nn.functional as F

    max_len = metadata.max_rank_len[0]
    padded = F.pad(local, (0, 0, 0, max_len - local.shape[0]))
    pieces = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(pieces, padded.contiguous())
    joined = torch.cat([piece[:n] for piece, n in zip(pieces, metadata.per_rank_actual_token)])
    blocks = torch.split(joined, metadata.reverse_split_len, dim=0)
    return torch.cat([blocks[i] for i in metadata.cp_reverse_index], dim=0)


def main(rank, world, port, wheel, spec_json, out_path):
    started = time.perf_counter()
    import broken_window
    import torch
    import torch.distributed as dist

    broken_window.install_broken_window(wheel)
    import npu_shim

    npu_shim.install()
    import importlib

    module = importlib.import_module(broken_window.TARGET)
    from npu_shim.testing import cp_case

    from npu_shim.patches.sglang import cp_fia as sglang_cp_fia
    from sglang.srt.layers.utils.cp_utils import cp_split_and_rebuild_data

    row = next(r for r in npu_shim.status() if r["name"] == sglang_cp_fia.PATCH.name)
    method = module.AscendAttnBackend.do_cp_attn_fia
    result = {"rank": rank, "state": row["state"], "reason": row["reason"],
              "patched_is_shim": getattr(method, "__npu_shim_patch__", None) == sglang_cp_fia.PATCH.name}

    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:%d" % port, rank=rank,
                            world_size=world, timeout=datetime.timedelta(seconds=120))
    try:
        cp_case.set_cpu_server_args()
        spec = cp_case.Spec.from_json(spec_json)
        assert spec.cp_size == world
        batch = cp_case.make_batch(spec, write_new_tokens=False)   # cache: prefixes only
        backend, layer, forward_batch, local_q = cp_case.rank_inputs(module, batch, rank)
        metadata = forward_batch.attn_cp_metadata

        # 3. this rank's share of the new tokens' K/V, gathered from every rank.
        new_k, new_v = batch.packed_new_kv()
        k_local = cp_split_and_rebuild_data(forward_batch, new_k.reshape(new_k.shape[0], -1))
        v_local = cp_split_and_rebuild_data(forward_batch, new_v.reshape(new_v.shape[0], -1))
        kv_full = gather_rerange(dist, torch.cat([k_local, v_local], dim=-1), metadata, world)
        k_width = k_local.shape[-1]
        batch.k_cache[forward_batch.out_cache_loc] = kv_full[:, :k_width].reshape(-1, *new_k.shape[1:])
        batch.v_cache[forward_batch.out_cache_loc] = kv_full[:, k_width:].reshape(-1, *new_v.shape[1:])
        result["gathered_kv_exact"] = bool(torch.equal(kv_full[:, :k_width], new_k.reshape(new_k.shape[0], -1))
                                           and torch.equal(kv_full[:, k_width:], new_v.reshape(new_v.shape[0], -1)))

        # 4. this rank's attention.
        local_out = method(backend, local_q, batch.k_cache, batch.v_cache, layer, forward_batch)
        reference = batch.reference()
        result["local_tokens"] = local_out.shape[0]
        result["local_max_abs_err"] = cp_case.max_abs_err(
            local_out, cp_case.rank_expected(batch, reference, rank))

        # 5. the full batch, gathered.
        full_out = gather_rerange(dist, local_out, metadata, world)
        expected = torch.cat([r.reshape(r.shape[0], -1) for r in reference])
        result["gathered_tokens"] = full_out.shape[0]
        result["gathered_max_abs_err"] = cp_case.max_abs_err(full_out, expected)

        # 6. the same method, both ranks in this process, from a fully written cache.
        single = cp_case.make_batch(spec)
        per_rank = [cp_case.run_rank(method, module, single, r) for r in range(world)]
        order = [(r, i) for r in range(world) for i in range(per_rank[r].shape[0])]
        layouts = [cp_case.zigzag_layout(spec.extend_lens, world, r) for r in range(world)]
        offsets = [sum(spec.extend_lens[:s]) for s in range(spec.bs)]
        single_full = torch.empty_like(full_out)
        for r, i in order:
            s, j = layouts[r][i]
            single_full[offsets[s] + j] = per_rank[r][i]
        result["equals_single_process"] = bool(torch.equal(full_out, single_full))
        result["tolerance"] = cp_case.tolerance(spec.dtype)
        dist.barrier()
    finally:
        dist.destroy_process_group()
    result["seconds"] = time.perf_counter() - started
    with open(out_path, "w") as handle:
        json.dump(result, handle)


if __name__ == "__main__":
    rank, world, port = (int(x) for x in sys.argv[1:4])
    main(rank, world, port, *sys.argv[4:7])
