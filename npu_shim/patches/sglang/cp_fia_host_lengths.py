"""sglang.cp_fia_host_lengths — CP prefill FIA on Ascend without device->host syncs (sglang 0.5.23+).

Why: in sglang 0.5.23 ``AscendAttnBackend.do_cp_attn_fia`` hands a closure
  (``_fia_cp_attn(q_chunk, cu_seqlens_q_cp, cache_seqlens_cp, max_seqlen_q_cp)``)
  to the CP strategy, and ``ZigzagCPStrategy.run_attention`` calls it twice per
  layer (prev and next zigzag halves) with the metadata's int32 *device*
  tensors ``cu_seqlens_q_{prev,next}_tensor`` and ``kv_len_{prev,next}_tensor``.
  The closure turns both into Python lists with ``.tolist()`` because
  ``npu_fused_infer_attention_score`` takes host lists: 4 device->host syncs per
  layer per CP prefill (measured on the real 0.5.23 wheel with
  ``npu_shim.testing.count_host_syncs``, both ranks), although
  ``ZigzagContextParallelMetadata`` already carries the same numbers as host
  lists (``actual_seq_q_{prev,next}_list``, ``kv_len_{prev,next}_list``; the
  tensors are built from them in ``build_metadata``).
How: replace the method with one that does what upstream's does — the same
  strategy call, the same closure signature, the same single
  ``npu_fused_infer_attention_score`` call with upstream's arguments — except
  that the closure looks the lengths up on the host: when the strategy passes
  exactly the metadata's prev (or next) tensors (identity, not value), the
  cumulative query lengths are the running sum of ``actual_seq_q_*_list`` and
  the KV lengths are ``kv_len_*_list``. Any other tensor pair (a strategy that
  passes something else) is converted as upstream does, with ``.tolist()``,
  and counted as ``host_copies``. The strategy keeps its own slicing of the
  prev/next halves and its pad-row handling.
Upstream fix: none in the releases read (docs/reference.md).
Remove when: sglang passes host lengths to the FIA closure (or the closure
  reads the metadata's lists itself).

Where it applies (decided by the structure of the installed code; the window opens at
0.5.23, the first release with that structure, and is open above; 0.5.13 - 0.5.22 pass the
metadata's host lists to FIA directly and make no sync there):

* ``AscendAttnBackend.do_cp_attn_fia`` calls ``get_cp_strategy`` /
  ``run_attention`` and defines a nested function of 4 parameters that calls
  ``npu_fused_infer_attention_score`` and ``tolist``;
* ``ZigzagCPStrategy.run_attention`` passes ``cu_seqlens_q_prev_tensor``,
  ``kv_len_prev_tensor``, ``cu_seqlens_q_next_tensor``, ``kv_len_next_tensor``;
* ``ZigzagContextParallelMetadata`` has those fields and the host lists above;
* the method's body is one the replacement was written from (``BODIES``, by
  ``body_digest``): the replacement writes the FIA call out with upstream's arguments,
  so a newer release gets the family only with a body read (its status then says the
  release was not read yet).
"""
import types
from itertools import accumulate

from npu_shim.patch import Defect, Family, NotNeeded, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.code import names_in_code
from npu_shim.patches._shared.structure import expect_body, found

TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
METHOD = "do_cp_attn_fia"
STRATEGY_MODULE = "sglang.srt.layers.cp.zigzag"

NO_STRATEGY = "no CP strategy closure: FIA gets the metadata's host lists directly"

STRATEGY_NAMES = frozenset({"get_cp_strategy", "run_attention"})
CLOSURE_NAMES = frozenset({"npu_fused_infer_attention_score", "tolist"})
CLOSURE_ARGUMENTS = 4   # q_chunk, cu_seqlens_q_cp, cache_seqlens_cp, max_seqlen_q_cp
# The method's own attributes the replacement relies on, as upstream's does.
SHARED_NAMES = frozenset({"page_size", "forward_metadata", "block_tables", "fia_mask",
                          "tp_q_head_num", "tp_k_head_num", "tp_v_head_num", "qk_head_dim",
                          "v_head_dim", "scaling", "device", "FLASH_ATTENTION"})
# (query cumulative-length tensor, KV-length tensor, host query lengths, host KV lengths)
HALVES = (
    ("cu_seqlens_q_prev_tensor", "kv_len_prev_tensor", "actual_seq_q_prev_list", "kv_len_prev_list"),
    ("cu_seqlens_q_next_tensor", "kv_len_next_tensor", "actual_seq_q_next_list", "kv_len_next_list"),
)
PASSED_TENSORS = frozenset(name for half in HALVES for name in half[:2])
METADATA_FIELDS = frozenset(name for half in HALVES for name in half)
# body_digest of the upstream method the replacement was written from (it writes the FIA call
# out with upstream's arguments, so it accepts only a body read; the releases: docs/reference.md)
BODIES = {"949c91c36aed"}



def nested_codes(code):
    return [c for c in code.co_consts if isinstance(c, types.CodeType)]


def function_code(function, what):
    import inspect

    code = getattr(inspect.unwrap(function), "__code__", None)
    if code is None:
        raise TargetMismatch("%s is not a Python function" % what)
    return code


def check_strategy_module() -> None:
    import dataclasses
    import importlib

    try:
        zigzag = importlib.import_module(STRATEGY_MODULE)
    except ImportError as exc:
        raise TargetMismatch("cannot import %s (%s)" % (STRATEGY_MODULE, exc)) from None
    strategy = getattr(zigzag, "ZigzagCPStrategy", None)
    metadata = getattr(zigzag, "ZigzagContextParallelMetadata", None)
    if strategy is None or metadata is None or not dataclasses.is_dataclass(metadata):
        raise TargetMismatch("%s lacks ZigzagCPStrategy or the ZigzagContextParallelMetadata dataclass"
                             % STRATEGY_MODULE)
    passed = names_in_code(function_code(strategy.run_attention, "ZigzagCPStrategy.run_attention"))
    missing = PASSED_TENSORS - passed
    if missing:
        raise TargetMismatch("ZigzagCPStrategy.run_attention does not pass %s" % ", ".join(sorted(missing)))
    missing = METADATA_FIELDS - {f.name for f in dataclasses.fields(metadata)}
    if missing:
        raise TargetMismatch("ZigzagContextParallelMetadata has no %s" % ", ".join(sorted(missing)))


def check(module, context) -> None:
    method = module.AscendAttnBackend.__dict__.get(METHOD)
    if method is None:
        raise TargetMismatch("AscendAttnBackend does not define %s itself" % METHOD)
    code = function_code(method, METHOD)
    names = names_in_code(code)
    if not names & STRATEGY_NAMES:
        raise NotNeeded(NO_STRATEGY)
    if not STRATEGY_NAMES <= names:
        raise TargetMismatch("%s uses %s but not both" % (METHOD, " / ".join(sorted(names & STRATEGY_NAMES))))
    closures = [c for c in nested_codes(code)
                if c.co_argcount == CLOSURE_ARGUMENTS and CLOSURE_NAMES <= names_in_code(c)]
    if len(closures) != 1:
        raise TargetMismatch("%s has %d nested functions of %d arguments calling %s (expected 1)"
                             % (METHOD, len(closures), CLOSURE_ARGUMENTS, " and ".join(sorted(CLOSURE_NAMES))))
    missing = SHARED_NAMES - names
    if missing:
        raise TargetMismatch("%s does not use %s" % (METHOD, ", ".join(sorted(missing))))
    check_strategy_module()
    return {"AscendAttnBackend.%s" % METHOD: expect_body(method, BODIES, "the %s replacement" % context.patch)}


def host_lengths(meta, cu_seqlens_q, kv_lens):
    """(cumulative query lengths without the leading 0, KV lengths) as host lists,
    or None when the tensors are not the metadata's own prev/next tensors."""
    for cu_name, kv_name, q_list_name, kv_list_name in HALVES:
        if cu_seqlens_q is getattr(meta, cu_name) and kv_lens is getattr(meta, kv_name):
            q_list, kv_list = getattr(meta, q_list_name), getattr(meta, kv_list_name)
            if q_list is None or kv_list is None:
                return None
            return list(accumulate(q_list)), list(kv_list)
    return None


def make_do_cp_attn_fia(module, context):
    """The replacement method; the names upstream's method uses are bound from its module."""
    torch_npu = module.torch_npu
    get_cp_strategy = module.get_cp_strategy
    flash_attention = module.CPAttentionBackendKind.FLASH_ATTENTION

    def do_cp_attn_fia(self, q, k_cache, v_cache, layer, forward_batch):
        """CP prefill attention through the CP strategy, lengths from the metadata's host
        lists."""
        meta = forward_batch.attn_cp_metadata
        context.count("calls")

        def fia_cp_attn(q_chunk, cu_seqlens_q_cp, cache_seqlens_cp, max_seqlen_q_cp):
            context.count("upstream_host_copies", 2)
            lengths = host_lengths(meta, cu_seqlens_q_cp, cache_seqlens_cp)
            if lengths is None:
                context.count("host_copies", 2)
                lengths = cu_seqlens_q_cp[1:].tolist(), cache_seqlens_cp.tolist()
            q_cumulative, kv_lens = lengths
            return torch_npu.npu_fused_infer_attention_score(
                query=q_chunk.contiguous(),
                key=k_cache.view(-1, self.page_size, layer.tp_k_head_num * layer.qk_head_dim),
                value=v_cache.view(-1, self.page_size, layer.tp_v_head_num * layer.v_head_dim),
                block_table=self.forward_metadata.block_tables,
                block_size=self.page_size,
                num_heads=layer.tp_q_head_num,
                num_key_value_heads=layer.tp_k_head_num,
                input_layout="TND",
                atten_mask=self.fia_mask,
                sparse_mode=3,
                next_tokens=0,
                scale=layer.scaling,
                actual_seq_lengths=q_cumulative,
                actual_seq_lengths_kv=kv_lens,
            )[0]

        strategy = get_cp_strategy()
        if strategy is None:
            raise RuntimeError("%s: CP prefill without a CP strategy (get_cp_strategy() is None)" % context.patch)
        q_cp = q.contiguous().view(-1, layer.tp_q_head_num, layer.qk_head_dim)
        out = strategy.run_attention(q_cp, forward_batch, self.device, fia_cp_attn,
                                     attention_backend=flash_attention)
        return out.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    original = found(context, "AscendAttnBackend.%s" % METHOD, lambda: module.AscendAttnBackend.__dict__[METHOD])
    return context.present(do_cp_attn_fia, original,
                           "lengths from the CP metadata's host lists (no read back per chunk)")


def build(module, context):
    for name in ("torch_npu", "get_cp_strategy", "CPAttentionBackendKind"):
        if not hasattr(module, name):
            raise TargetMismatch("%s has no module-level %s" % (TARGET, name))
    return {"AscendAttnBackend.%s" % METHOD: make_do_cp_attn_fia(module, context)}


PATCH = Patch(
    name="sglang.cp_fia_host_lengths",
    target=TARGET,
    replaces=("AscendAttnBackend.%s" % METHOD,),
    requires={"sglang": ">=0.5.23"},
    outside_window={"sglang": "below the window FIA gets the metadata's host lists directly (no sync)"},
    needs_npu=True,
    families=(Family(__name__, id="strategy-metadata",
               keeps="torch_npu.npu_fused_infer_attention_score, input_layout TND, upstream's arguments"),),
    summary="CP prefill FIA closure reads the zigzag metadata's host lists: 0 device->host syncs per layer",
    # None: the lengths come from the metadata's host lists, not its device tensors.
    selftest=Selftest("npu_shim.selftest.sglang_cp_fia_host_lengths", host_syncs=0),
    defect=Defect("sglang's CP prefill FIA reads its lengths back from the device", shows="reads"),
)
