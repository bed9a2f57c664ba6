"""Selftest of ``sglang.cp_fia``: one context-parallel prefill through the patched method.

Runs sglang's ``AscendAttnBackend.do_cp_attn_fia`` (already replaced by the
shim) for both ranks of cp_size 2 on a batch of three sequences of uneven
length, one with a cached prefix, GQA (8 query heads over 2 KV heads), in a
paged KV cache with a shuffled block table, and reports the largest deviation
of either rank's output from the float64 causal reference, the host syncs of a
rank's call (none: every length is a host list) and the time of both calls.

Real sglang parts: ``ContextParallelMetadata``, ``RadixAttention``,
``ForwardBatch``, ``ForwardMetadata`` and the backend's compressed FIA mask
(``AscendAttnMaskBuilder.generate_mask_flag``). The backend instance is made
with ``object.__new__`` and given the three attributes the method reads
(``page_size``, ``forward_metadata.block_tables``, ``fia_mask``):
``AscendAttnBackend.__init__`` needs a whole ``ModelRunner``. The metadata is
filled from the zigzag definition rather than by
``prepare_context_parallel_metadata``, which needs sglang's global server
arguments, which this process does not have. The batch, the backend, the
reference and the zigzag split come from :mod:`npu_shim.testing.cp_case`,
the builder the lane tests use too.
"""

PATCH_NAME = "sglang.cp_fia"
CP_SIZE = 2
EXTEND_LENS = (33, 70, 21)
PREFIX_LENS = (0, 9, 4)
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
PAGE_SIZE = 128


def _patched_module():
    from npu_shim.selftest import applied_target

    module = applied_target(PATCH_NAME)
    method = module.AscendAttnBackend.__dict__["do_cp_attn_fia"]
    if getattr(method, "__npu_shim_patch__", None) != PATCH_NAME:
        raise RuntimeError("%s reports applied but AscendAttnBackend.do_cp_attn_fia is not the "
                           "shim's" % PATCH_NAME)
    return module


def _metadata(cls, rank):
    """Rank ``rank``'s per-sequence CP metadata, from the zigzag definition."""
    from npu_shim.testing import cp_case

    prev_block, next_block = rank, 2 * CP_SIZE - 1 - rank
    q_prev, q_next, kv_prev, kv_next = [], [], [], []
    for length, prefix in zip(EXTEND_LENS, PREFIX_LENS):
        sizes = cp_case.zigzag_block_sizes(length, CP_SIZE)
        q_prev.append(sizes[prev_block])
        q_next.append(sizes[next_block])
        kv_prev.append(prefix + sum(sizes[:prev_block + 1]))
        kv_next.append(prefix + sum(sizes[:next_block + 1]))
    return cls(total_q_prev_tokens=sum(q_prev), total_q_next_tokens=sum(q_next),
               actual_seq_q_prev_list=q_prev, actual_seq_q_next_list=q_next,
               kv_len_prev_list=kv_prev, kv_len_next_list=kv_next, bs=len(EXTEND_LENS))


def _metadata_class():
    import importlib

    from npu_shim.patches.sglang.cp_fia import METADATA_MODULES

    for name in METADATA_MODULES:
        try:
            cls = getattr(importlib.import_module(name), "ContextParallelMetadata", None)
        except ImportError:
            continue
        if cls is not None:
            return cls
    raise RuntimeError("no ContextParallelMetadata in %s" % ", ".join(METADATA_MODULES))


def run(device=None):
    import torch

    from npu_shim.testing import cp_case

    device = device or "cpu"
    module = _patched_module()
    dtype = torch.float16  # taken by the real op on every device class that has it (emulation.dtypes)
    spec = cp_case.Spec(extend_lens=EXTEND_LENS, prefix_lens=PREFIX_LENS, page_size=PAGE_SIZE,
                        num_heads=HEADS, num_kv_heads=KV_HEADS, qk_head_dim=HEAD_DIM, v_head_dim=HEAD_DIM,
                        cp_size=CP_SIZE, dtype=dtype)
    case = cp_case.ascend_layer_case(module, spec, device)
    metadata_cls = _metadata_class()

    err, syncs, seconds = 0.0, 0, 0.0
    for rank in range(CP_SIZE):
        layout = cp_case.zigzag_layout(EXTEND_LENS, CP_SIZE, rank)
        local_q = torch.stack([case.batch.q[s][i] for s, i in layout]).reshape(len(layout), -1).to(device)
        forward_batch = cp_case.make_forward_batch(case.batch, _metadata(metadata_cls, rank))
        out, call_syncs, call_seconds = cp_case.run_cp_fia(module, case, local_q, forward_batch)
        seconds += call_seconds
        syncs = max(syncs, call_syncs)
        err = max(err, cp_case.max_abs_err(out.cpu(), cp_case.rank_expected(case.batch, case.reference, rank)))

    return {
        "max_abs_err": err,
        "tolerance": cp_case.tolerance(dtype),
        "host_syncs": syncs,
        "seconds": seconds,
        "detail": "AscendAttnBackend.do_cp_attn_fia, cp_size %d (both ranks), %d sequences of %s new "
                  "tokens (cached prefixes %s), %d heads over %d KV heads x %d, page %d, shuffled "
                  "block table, %s on %s" % (
                      CP_SIZE, len(EXTEND_LENS), "/".join(map(str, EXTEND_LENS)),
                      "/".join(map(str, PREFIX_LENS)), HEADS, KV_HEADS, HEAD_DIM, PAGE_SIZE,
                      str(dtype).replace("torch.", ""), device),
    }
