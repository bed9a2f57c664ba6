"""sglang.cp_pad_gather — CP-v2 (zigzag) prefill on Ascend when the metadata adds pad rows.

Why: from sglang 0.5.16, ``prepare_cp_forward`` pads every CP rank's tokens
  (``pad_logical_token_to_physical``: to a multiple of ``2 * cp_size`` in the
  zigzag / in-seq-split mode): ``per_rank_actual_token`` and ``max_rank_len``
  become the padded (physical) count and the real counts move to
  ``per_rank_logical_token``. The NPU path, ``_cp_allgather_and_save_kv_npu``,
  still gathers K/V with the older ``cp_all_gather_rerange_kv_cache``, which
  keeps every rank's pad rows and then splits by the real block lengths:
  ``torch.split`` raises (``split_with_sizes expects split_sizes to sum
  exactly to ...``) before the KV cache is written. With one prompt at
  cp_size 2 every length not divisible by 8 crashes.
  ``do_cp_attn_fia`` also hands FIA the pad rows at the end of its second
  half (more query rows than ``actual_seq_lengths[-1]``).
How: two small wrappers around upstream's own functions, so the NPU op calls
  (the HCCL all-gather, ``npu_fused_infer_attention_score``) are exactly
  upstream's:
  * the module's ``cp_all_gather_rerange_kv_cache`` (the name
    ``_cp_allgather_and_save_kv_npu`` looks up) gets a view of the metadata
    whose ``per_rank_actual_token`` is the logical count: upstream's helper
    then gathers the padded rows as before and keeps each rank's real rows
    only -- what the strategy's own ``ZigzagCPStrategy._all_gather_reorganized``
    does;
  * ``AscendAttnBackend.do_cp_attn_fia`` runs upstream's method on the real
    rows (``total_q_prev_tokens + total_q_next_tokens``) and gives the pad
    rows zeros, as the strategy's ``run_attention`` does.
  Without pad rows (``per_rank_logical_token`` equal to the physical count,
  or absent) both hand the call to upstream unchanged: bit-identical.
  Host lists only; no device->host copy.
Upstream fix: none in the 0.5.16-0.5.19 line; 0.5.20 turned the older gather
  into a stub that raises (see ``sglang.cp_npu_refuse``), 0.5.23 runs NPU CP
  through the strategy's own gather.
Remove when: no pinned sglang is in 0.5.16-0.5.19.

Shape (the structural check; the issue lists these as identical by syntax
tree across 0.5.16-0.5.19):

* ``_cp_allgather_and_save_kv_npu`` refers to ``cp_all_gather_rerange_kv_cache``,
  a module global of the backend module;
* that helper's gather, ``cp_all_gather_reorganized_into_tensor_kv_cache``,
  trims by ``per_rank_actual_token`` and knows nothing of
  ``per_rank_logical_token`` (a helper that does is fixed upstream);
* the zigzag metadata has ``per_rank_logical_token``;
* ``do_cp_attn_fia`` splits at ``total_q_prev_tokens`` and calls
  ``npu_fused_infer_attention_score``.
"""
from npu_shim.patch import Defect, Family, NotNeeded, Patch, Selftest, TargetMismatch

TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
GATHER = "cp_all_gather_rerange_kv_cache"
INNER_GATHER = "cp_all_gather_reorganized_into_tensor_kv_cache"
SAVE_KV = "_cp_allgather_and_save_kv_npu"
METHOD = "do_cp_attn_fia"
CP_UTILS = "sglang.srt.layers.utils.cp_utils"
ZIGZAG = "sglang.srt.layers.cp.zigzag"

FIXED_UPSTREAM = "fixed upstream (the KV gather honours per_rank_logical_token)"
METADATA_FIELDS = frozenset({"per_rank_actual_token", "per_rank_logical_token", "max_rank_len",
                             "total_q_prev_tokens", "total_q_next_tokens"})
INNER_GATHER_NAMES = frozenset({"max_rank_len", "per_rank_actual_token", "all_gather_into_tensor"})
METHOD_NAMES = frozenset({"total_q_prev_tokens", "npu_fused_infer_attention_score"})


def check(module, context) -> None:
    import dataclasses
    import importlib

    from npu_shim.patches._shared.code import code_names

    save_kv = getattr(module, SAVE_KV, None)
    if save_kv is None or GATHER not in code_names(save_kv):
        raise TargetMismatch("%s.%s does not gather with %s" % (TARGET, SAVE_KV, GATHER))
    gather = getattr(module, GATHER, None)
    if getattr(gather, "__module__", None) != CP_UTILS:
        raise TargetMismatch("%s.%s is not %s's" % (TARGET, GATHER, CP_UTILS))
    cp_utils = importlib.import_module(CP_UTILS)
    inner = getattr(cp_utils, INNER_GATHER, None)
    if inner is None or INNER_GATHER not in code_names(gather):
        raise TargetMismatch("%s.%s does not call %s" % (CP_UTILS, GATHER, INNER_GATHER))
    inner_names = code_names(inner)
    if "per_rank_logical_token" in inner_names:
        raise NotNeeded(FIXED_UPSTREAM)
    if not INNER_GATHER_NAMES <= inner_names:
        raise TargetMismatch("%s.%s does not use %s" % (CP_UTILS, INNER_GATHER,
                                                         ", ".join(sorted(INNER_GATHER_NAMES - inner_names))))
    metadata = getattr(importlib.import_module(ZIGZAG), "ZigzagContextParallelMetadata", None)
    if metadata is None or not dataclasses.is_dataclass(metadata):
        raise TargetMismatch("%s has no ZigzagContextParallelMetadata dataclass" % ZIGZAG)
    missing = METADATA_FIELDS - {f.name for f in dataclasses.fields(metadata)}
    if missing:
        raise TargetMismatch("ZigzagContextParallelMetadata lacks %s" % ", ".join(sorted(missing)))
    method = module.AscendAttnBackend.__dict__.get(METHOD)
    if method is None:
        raise TargetMismatch("AscendAttnBackend does not define %s itself" % METHOD)
    names = code_names(method)
    if not METHOD_NAMES <= names or "total_q_next_tokens" in names:
        raise TargetMismatch("%s does not have this family's shape (split at total_q_prev_tokens, "
                             "every row after it to FIA)" % METHOD)


class _BatchWithLogicalRows:
    """What upstream's gather reads of a ForwardBatch: ``attn_cp_metadata`` only."""

    __slots__ = ("attn_cp_metadata",)

    def __init__(self, metadata):
        self.attn_cp_metadata = metadata


def make_gather(upstream_gather, context):
    import copy


    def cp_all_gather_rerange_kv_cache(input_tensor, cp_size, forward_batch, stream):
        metadata = forward_batch.attn_cp_metadata
        logical = getattr(metadata, "per_rank_logical_token", None)
        if logical is None or list(logical) == list(metadata.per_rank_actual_token):
            context.count("upstream_calls")
            return upstream_gather(input_tensor, cp_size, forward_batch, stream)
        context.count("calls")
        # Every rank sends max_rank_len (physical) rows; keep each rank's real rows.
        real_rows = copy.copy(metadata)
        real_rows.per_rank_actual_token = list(logical)
        return upstream_gather(input_tensor, cp_size, _BatchWithLogicalRows(real_rows), stream)

    return context.present(cp_all_gather_rerange_kv_cache, upstream_gather,
                           "each rank's real rows kept where the CP split pads them")


def make_do_cp_attn_fia(upstream_method, context):
    import torch


    def do_cp_attn_fia(self, q, k_cache, v_cache, layer, forward_batch):
        metadata = forward_batch.attn_cp_metadata
        real_rows = metadata.total_q_prev_tokens + metadata.total_q_next_tokens
        pad_rows = q.shape[0] - real_rows
        if pad_rows <= 0:
            context.count("upstream_calls")
            return upstream_method(self, q, k_cache, v_cache, layer, forward_batch)
        context.count("calls")
        out = upstream_method(self, q[:real_rows], k_cache, v_cache, layer, forward_batch)
        return torch.cat([out, out.new_zeros(pad_rows, *out.shape[1:])], dim=0)

    return context.present(do_cp_attn_fia, upstream_method,
                           "upstream's on the real rows, the pad rows' output zero")


def build(module, context):
    return {
        GATHER: make_gather(getattr(module, GATHER), context),
        "AscendAttnBackend.%s" % METHOD: make_do_cp_attn_fia(module.AscendAttnBackend.__dict__[METHOD], context),
    }


PATCH = Patch(
    name="sglang.cp_pad_gather",
    target=TARGET,
    replaces=(GATHER, "AscendAttnBackend.%s" % METHOD),
    requires={"sglang": ">=0.5.16,<0.5.20"},
    outside_window={"sglang": "CP-v2 pad rows exist from the window's start; from its end the NPU KV gather "
                              "is a stub that raises (sglang.cp_npu_refuse)"},
    needs_npu=True,
    families=(Family(__name__, id="rerange-kv-gather",
               keeps="upstream's cp_all_gather_rerange_kv_cache and do_cp_attn_fia (npu_fused_infer_attention_score TND)"),),
    summary="NPU CP KV gather keeps each rank's real rows; pad rows never reach FIA",
    # None: the lengths of the real rows come from the metadata's host lists.
    selftest=Selftest("npu_shim.selftest.sglang_cp_pad_gather", host_syncs=0),
    defect=Defect("sglang's CP-v2 prefill on Ascend hands FIA lengths short of its padded queries",
                  shows="raises", says="actual_seq_lengths must end at the query's token count"),
)
