"""Selftest of ``sglang.cp_pad_gather``: the patched FIA step of a padded CP-v2 prefill.

Builds both ranks' CP-v2 metadata (cp_size 2) with sglang's own
``ZigzagCPStrategy.build_metadata`` and ``pad_logical_token_to_physical`` for two
sequences whose lengths get pad rows (37 and 20 new tokens, cached prefixes 0
and 9, GQA 8 over 2 KV heads, page 128, shuffled block table), hands each rank's
padded queries to the patched ``AscendAttnBackend.do_cp_attn_fia`` (which calls
the NPU ``npu_fused_infer_attention_score`` as upstream does, on the real rows
only) and reports the largest deviation of the real rows from the float64 causal
reference, and of the pad rows from zero. The KV all-gather half of the patch is
a collective across CP ranks; it runs in the lanes' two-process test, not here.
sglang's test hooks ``override_server_args`` and ``get_parallel().override``
stand in for a running server's configuration and CP topology. The batch, the
backend, the reference and the zigzag split come from
:mod:`npu_shim.testing.cp_case`, the builder the lane tests use too.
"""

PATCH_NAME = "sglang.cp_pad_gather"
CP_SIZE = 2
EXTEND_LENS = (37, 20)
PREFIX_LENS = (0, 9)
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
PAGE_SIZE = 128


def run(device=None):
    import torch
    from sglang.srt.layers.cp.padding import pad_logical_token_to_physical
    from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy
    from sglang.srt.runtime_context import get_context

    from npu_shim.selftest import applied_target
    from npu_shim.testing import cp_case

    device = device or "cpu"
    module = applied_target(PATCH_NAME)
    dtype = torch.float16  # taken by the real op on every device class that has it (emulation.dtypes)
    spec = cp_case.Spec(extend_lens=EXTEND_LENS, prefix_lens=PREFIX_LENS, page_size=PAGE_SIZE,
                        num_heads=HEADS, num_kv_heads=KV_HEADS, qk_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
                        cp_size=CP_SIZE, dtype=dtype)
    case = cp_case.ascend_layer_case(module, spec, device)
    q, seq_lens = case.batch.q, list(spec.seq_lens)

    err, pad_max, pad_rows, syncs, seconds = 0.0, 0.0, 0, 0, 0.0
    with get_context().override_server_args(enable_prefill_cp=True, cp_strategy="zigzag",
                                            attn_cp_size=CP_SIZE, enable_prefill_context_parallel=True,
                                            prefill_cp_mode="in-seq-split"):
        for rank in range(CP_SIZE):
            with cp_case.simulated_rank(attn_cp_size=CP_SIZE, attn_cp_rank=rank):
                metadata = ZigzagCPStrategy(cp_size=CP_SIZE).build_metadata(
                    num_tokens=sum(EXTEND_LENS), seqs_len=seq_lens, extend_seqs_len=list(EXTEND_LENS))
                pad_logical_token_to_physical(metadata)
            layout = cp_case.zigzag_layout(EXTEND_LENS, CP_SIZE, rank)
            physical = metadata.per_rank_actual_token[rank]
            local_q = torch.zeros(physical, HEADS * HEAD_DIM, dtype=dtype)
            local_q[:len(layout)] = torch.stack([q[s][i] for s, i in layout]).reshape(len(layout), -1)
            local_q = local_q.to(device)
            forward_batch = cp_case.make_forward_batch(case.batch, metadata)
            out, call_syncs, call_seconds = cp_case.run_cp_fia(module, case, local_q, forward_batch)
            seconds += call_seconds
            syncs = max(syncs, call_syncs)
            expected = cp_case.rank_expected(case.batch, case.reference, rank)
            out = out.detach().to("cpu")         # in its dtype: the tolerance is the dtype's
            err = max(err, cp_case.max_abs_err(out[:len(layout)], expected))
            if out.shape[0] != physical:
                raise RuntimeError("rank %d: %d output rows for %d local rows" % (rank, out.shape[0], physical))
            pad_rows += physical - len(layout)
            if physical > len(layout):
                pad_max = max(pad_max, out[len(layout):].abs().max().item())
    if pad_rows == 0:
        raise RuntimeError("the selftest's lengths produced no pad rows; it would not test the patch")

    return {
        "max_abs_err": max(err, pad_max),
        "tolerance": cp_case.tolerance(dtype),
        "host_syncs": syncs,
        "seconds": seconds,
        "detail": "AscendAttnBackend.do_cp_attn_fia on CP-v2 padded rows, cp_size %d (both ranks, %d pad "
                  "rows in all), %s new tokens (cached prefixes %s), %d heads over %d KV heads x %d, "
                  "page %d, %s on %s; pad rows max |out| %g" % (
                      CP_SIZE, pad_rows, "/".join(map(str, EXTEND_LENS)), "/".join(map(str, PREFIX_LENS)),
                      HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE, str(dtype).replace("torch.", ""), device, pad_max),
    }
