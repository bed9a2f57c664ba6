"""sglang.cp_fia — context-parallel FIA attention on Ascend for batch size >= 1.

Why: with ``--enable-prefill-context-parallel`` and ``ASCEND_USE_FIA=1`` (non-MLA
  models such as Qwen3-30B-A3B), ``AscendAttnBackend.do_cp_attn_fia`` split the
  rank's queries with ``torch.chunk(q, 2)`` and passed the scalar CP lengths
  ``actual_seq_q_prev`` / ``kv_len_prev``: right for one sequence only. sglang
  PR 23269 made ``ContextParallelMetadata`` per-sequence (lists, scalars
  removed) for batch sizes > 1 but left this method alone, so every build
  between that PR and PR 26705 raises AttributeError on the first CP prefill.
How: replace the method. A rank's local tokens are laid out
  ``[s0.prev, s1.prev, ..., s0.next, s1.next, ...]`` (zigzag: block r and block
  2*cp_size-1-r of every sequence), so Q is split after the prev blocks
  (``sum(actual_seq_q_prev_list)``, upstream's ``total_q_prev_tokens``),
  and each half is one paged fused-infer attention call
  (:func:`npu_shim.kernels.paged_prefill_attention`: TND, sparse_mode=3
  bottom-right causal, cumulative per-sequence query lengths and per-sequence
  KV lengths as Python lists — no device->host copy). GQA and a value head dim
  different from the key head dim are supported: the value cache is viewed with
  ``v_head_dim`` and the output has ``tp_q_head_num * v_head_dim`` columns.
Upstream fix: sglang PR 26705 (released in 0.5.13); 0.5.23 rewrote the method
  around a CP strategy object (``cp_strategy.run_attention``).
Remove when: no supported sglang build predates PR 26705 while carrying PR
  23269, i.e. every pinned sglang is a release (0.5.11-0.5.12 are correct for
  their single-sequence metadata, 0.5.13+ are fixed).

Where it applies (decided by the structural check, not by the version number,
because dev builds between the two PRs exist and carry arbitrary versions):

=================  ==============================  ===========================
sglang             do_cp_attn_fia                  ContextParallelMetadata
=================  ==============================  ===========================
0.5.10 and older   absent                          scalar fields
0.5.11 - 0.5.12    single-sequence shape           scalars only  -> skip
dev builds between single-sequence shape           per-seq lists -> APPLY
PR 23269 and 26705
0.5.13 - 0.5.22    fixed (total_q_prev_tokens,     per-seq lists -> skip
                   *_list fields)
0.5.23             closure run by the CP strategy  (moved to layers.cp)
                                                                 -> skip
=================  ==============================  ===========================

How the check reads the installed code (robust against reformatting and
comments; no source text is matched):

* the method: the names its compiled code refers to — ``co_names`` of the code
  object and, recursively, of the code objects among its ``co_consts`` (nested
  functions/closures). An attribute access ``cp_meta.kv_len_prev`` puts the
  exact name ``kv_len_prev`` there; ``kv_len_prev_list`` is a different name,
  so membership tests are exact, never substring matches.
* the metadata: the dataclass fields (:func:`dataclasses.fields`) of
  ``ContextParallelMetadata`` in the module the CP path of that build uses
  (``sglang.srt.layers.utils.cp_utils``; ``sglang.srt.layers.cp.zigzag``
  where the class moved).
"""
from npu_shim.patch import Defect, Family, NotNeeded, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.code import code_names

TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
METHOD = "do_cp_attn_fia"

# Skip reasons (stable strings: tests and users read them from status()).
FIXED_UPSTREAM = "fixed upstream"
STRATEGY_REWRITE = "rewritten around a CP strategy"
SINGLE_SEQUENCE_ONLY = "metadata has no per-sequence lists (upstream supports one sequence only)"

# Names in the method's code that identify each upstream shape.
STRATEGY_NAMES = frozenset({"get_cp_strategy", "run_attention"})
FIXED_NAMES = frozenset({"total_q_prev_tokens", "actual_seq_q_prev_list", "actual_seq_q_next_list",
                         "kv_len_prev_list", "kv_len_next_list"})
SINGLE_SEQUENCE_NAMES = frozenset({"chunk", "actual_seq_q_prev", "actual_seq_q_next",
                                   "kv_len_prev", "kv_len_next"})
# Attributes of the backend, the layer and the FIA op the replacement relies on;
# the method it replaces must use the same ones.
SHARED_NAMES = frozenset({"npu_fused_infer_attention_score", "page_size", "forward_metadata",
                          "block_tables", "fia_mask", "attn_cp_metadata", "tp_q_head_num",
                          "tp_k_head_num", "tp_v_head_num", "qk_head_dim", "v_head_dim", "scaling"})

# Metadata fields the replacement reads, and the scalar ones PR 23269 removed.
PER_SEQUENCE_FIELDS = frozenset({"actual_seq_q_prev_list", "actual_seq_q_next_list",
                                 "kv_len_prev_list", "kv_len_next_list"})
SCALAR_FIELDS = frozenset({"actual_seq_q_prev", "actual_seq_q_next", "kv_len_prev", "kv_len_next"})
METADATA_MODULES = ("sglang.srt.layers.utils.cp_utils", "sglang.srt.layers.cp.zigzag")


def metadata_fields():
    """(module name, dataclass field names) of the installed ContextParallelMetadata."""
    import dataclasses
    import importlib

    for module_name in METADATA_MODULES:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        cls = getattr(module, "ContextParallelMetadata", None)
        if cls is not None and dataclasses.is_dataclass(cls):
            return module_name, frozenset(f.name for f in dataclasses.fields(cls))
    raise TargetMismatch("no ContextParallelMetadata dataclass in %s" % " or ".join(METADATA_MODULES))


def method_shape(names: frozenset) -> str:
    """'strategy', 'fixed' or 'single-sequence' for the names of do_cp_attn_fia's code."""
    if names & STRATEGY_NAMES:
        return "strategy"
    if FIXED_NAMES <= names:
        return "fixed"
    if SINGLE_SEQUENCE_NAMES <= names and not names & FIXED_NAMES:
        missing = SHARED_NAMES - names
        if missing:
            raise TargetMismatch("%s has the single-sequence shape but does not use %s"
                                 % (METHOD, ", ".join(sorted(missing))))
        return "single-sequence"
    raise TargetMismatch("%s has an unknown shape (neither chunk + scalar CP lengths, nor "
                         "total_q_prev_tokens + per-sequence lists, nor a CP strategy)" % METHOD)


def check(module, context) -> None:
    method = module.AscendAttnBackend.__dict__.get(METHOD)
    if method is None:
        raise TargetMismatch("AscendAttnBackend does not define %s itself" % METHOD)
    shape = method_shape(code_names(method, METHOD))
    if shape == "strategy":
        raise NotNeeded(STRATEGY_REWRITE)
    if shape == "fixed":
        raise NotNeeded(FIXED_UPSTREAM)
    where, fields = metadata_fields()
    if PER_SEQUENCE_FIELDS <= fields:
        return  # the broken window: the old method reads fields that no longer exist
    if SCALAR_FIELDS <= fields and not fields & PER_SEQUENCE_FIELDS:
        raise NotNeeded(SINGLE_SEQUENCE_ONLY)
    raise TargetMismatch("%s.ContextParallelMetadata has neither the scalar CP lengths nor all of %s"
                         % (where, ", ".join(sorted(PER_SEQUENCE_FIELDS))))


def make_do_cp_attn_fia(original, context):
    """The replacement of ``original``; torch and the kernel are bound here, once."""
    import torch

    from npu_shim.kernels import paged_prefill_attention

    def do_cp_attn_fia(self, q, k_cache, v_cache, layer, forward_batch):
        """CP prefill attention for any batch size.

        ``q``: this rank's tokens ``[T, tp_q_head_num * qk_head_dim]`` laid out as
        ``[all sequences' prev blocks, all sequences' next blocks]``; the KV
        caches already hold the full gathered sequences. Returns
        ``[T, tp_q_head_num * v_head_dim]`` in the same token order.
        """
        context.count("calls")
        cp_meta = forward_batch.attn_cp_metadata
        num_heads, num_kv_heads = layer.tp_q_head_num, layer.tp_k_head_num
        q = q.reshape(-1, num_heads, layer.qk_head_dim)
        k_paged = k_cache.view(-1, self.page_size, num_kv_heads * layer.qk_head_dim)
        v_paged = v_cache.view(-1, self.page_size, layer.tp_v_head_num * layer.v_head_dim)
        q_prev_lens = cp_meta.actual_seq_q_prev_list
        split = sum(q_prev_lens)          # == total_q_prev_tokens; host ints, no sync
        halves = (
            (q[:split], q_prev_lens, cp_meta.kv_len_prev_list),
            (q[split:], cp_meta.actual_seq_q_next_list, cp_meta.kv_len_next_list),
        )
        outputs = [
            paged_prefill_attention(
                q_half.contiguous(),
                k_paged,
                v_paged,
                block_table=self.forward_metadata.block_tables,
                block_size=self.page_size,
                num_heads=num_heads,
                num_kv_heads=num_kv_heads,
                scale=layer.scaling,
                q_seq_lens=q_lens,      # host lists; the kernel refuses device tensors
                kv_seq_lens=kv_lens,
                atten_mask=self.fia_mask,
            )
            for q_half, q_lens, kv_lens in halves
        ]
        return torch.cat(outputs, dim=0).view(-1, num_heads * layer.v_head_dim)

    return context.present(do_cp_attn_fia, original,
                           "Q split after the prev blocks, per-sequence host lengths (any batch size)")


def build(module, context):
    original = module.AscendAttnBackend.__dict__[METHOD]
    return {"AscendAttnBackend.%s" % METHOD: make_do_cp_attn_fia(original, context)}


PATCH = Patch(
    name="sglang.cp_fia",
    target=TARGET,
    replaces=("AscendAttnBackend.%s" % METHOD,),
    requires={"sglang": ">=0.5.11"},
    outside_window={"sglang": "no do_cp_attn_fia below the window"},
    needs_npu=True,
    families=(Family(__name__, id="paged-fia-tnd", between_releases=True,
                     keeps="torch.ops.npu.npu_fused_infer_attention_score, input_layout TND, paged"),),
    summary="split Q at total_q_prev_tokens; per-sequence CP lengths (bs >= 1, GQA, diff-KV)",
    # None: every length the patched method hands the op is a host list.
    selftest=Selftest("npu_shim.selftest.sglang_cp_fia", host_syncs=0),
    defect=Defect("sglang's context-parallel FIA attention reads the scalar CP lengths PR 23269 removed",
                  shows="raises", says="AttributeError"),
)
