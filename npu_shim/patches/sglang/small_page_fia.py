"""sglang.small_page_fia — prefill with KV pages smaller than 128 through sglang's FIA path.

Why: with the ascend attention backend, ``--page-size 16`` gives fluent
  garbage with no error (sglang issue #38196, Ascend 910C). sglang PR #39905
  (open) traced it, with an operator differential test on CANN 9.0 and
  end-to-end runs on A3, to the legacy prefill op
  ``torch_npu._npu_flash_attention_qlens``: wrong output at page sizes 16, 32
  and 64 (NaN at 64), right at 128; sglang's FIA prefill path
  (``npu_fused_infer_attention_score``) is right at the small page sizes.
  Every release from 0.5.11 to 0.5.23 sends a plain prefill to the qlens op
  unless ``ASCEND_USE_FIA=1``. Patched from 0.5.12: 0.5.11's FIA prefill branch
  attends to the new tokens only (one BSND call per sequence over ``k``/``v``,
  no paged KV cache), so it is wrong whenever a prefix is cached (run in lane
  sglang-0.5.11: max abs error 3.4 against the float64 reference with a
  16-token prefix, 1e-6 without); there is no right path to route to.
How: wrap ``AscendAttnBackend.forward_extend``. A call that upstream would
  send to the qlens op (same gates as the installed release: not MLA, not
  sparse / speculative / CP / sinks, head dim <= 128, causal, no encoder,
  no logit cap, not native SDPA, not ALiBi, ...) while the backend's page
  size is below 128, ``use_fia`` is off and ``ASCEND_USE_FIA`` is not set
  explicitly, runs upstream's own ``forward_extend`` on a read-only view of
  the backend whose ``use_fia`` is True: the call takes sglang's FIA prefill
  branch of that release, with its op call and arguments, unchanged. Every
  other call goes to upstream's ``forward_extend`` with the backend itself.
  The KV cache is the same memory either way (FIA views it as
  ``(-1, page_size, heads * head_dim)``); the FIA mask and host lengths it
  reads are built by ``init_forward_metadata`` whether or not FIA is on.
  Page size 128 keeps the qlens op (right there, and upstream's fast path).
  So do pages above 128, as upstream sends them: no report of them; the op's
  own page asks for ``blockSize`` 128 and op-plugin's newest test of it expects
  a refusal naming ``blockSize=128`` (docs/limitations.md). So do page sizes that are not a multiple of 16: FIA takes the
  page size as its ``block_size``, which must be a multiple of 16 without
  quantisation (the op: "In NO_QUANT situation, block_size should aligned to
  16, but got 1", sglang issue #25169; sglang PR #29815, open, refuses such
  page sizes for the ascend backend at start-up on that evidence), so FIA
  would fail where qlens runs; status notes the page size and the reason at
  the first such call. ``ASCEND_USE_FIA`` set to anything is respected as is.
  ``NPU_SHIM_SGLANG_SMALL_PAGE_FIA=0`` turns the patch off.
Upstream fix: sglang PR #39905 (open, not in any release up to 0.5.23).
Remove when: the pinned sglang carries PR #39905 (or qlens is fixed in CANN
  for page sizes below 128).

What the tests can and cannot show: the torch_npu emulation computes what the
documentation says, so it cannot show the op bug; it is taken from the
hardware evidence above (the one exception to "reproduce first"; the emulated qlens
op refuses block sizes other than 128, as the op's newer documentation does, so
``NPU_SHIM_EMULATE_DEFECTS`` has no defect for it either). The tests
check the dispatch: page sizes 16/32/64 reach ``npu_fused_infer_attention_score``
and match the float64 reference; 128 and 256, and 8 and 24 (not multiples of 16),
make upstream's qlens call. The selftest (``npu-shim selftest``) runs the prefill at
each of the reported page sizes 16, 32 and 64.

Release families (each fenced by version and accepted by the structure of
``forward_extend``: the conditions of its ``if`` statements, compared as syntax
trees, must include the gates the family mirrors):

===========  =============  ==================================================
family       releases       what differs
===========  =============  ==================================================
sinks-only   0.5.12         speculative = target verify / draft extend (v1,
                            v2); sinks have their own branch (0.5.11 has the
                            same gates, but its FIA prefill branch ignores the
                            KV cache: not patched)
hybrid-swa   0.5.13         as above; hybrid-SWA layers go to the sinks branch
swa-fia      0.5.14         speculative = target verify / draft extend v2; SWA
                            layers reach qlens while use_fia is off (so they
                            route, to the SWA FIA branch)
swa-fia-fa   0.5.15-0.5.23  as swa-fia; ASCEND_USE_FA comes first
===========  =============  ==================================================

(checked on every wheel from 0.5.11 to 0.5.23 by reading the syntax tree;
run in the lanes on 0.5.12-0.5.17 and 0.5.19-0.5.23, 0.5.18 standing with 0.5.17.)
The newest family's fence is open above: its gates are a subset of the method's ``if``
tests, so it also requires the whole set of ``if`` tests to be one read
(``conditions_read``, by ``conditions_digest``); a newer release with such a method gets it,
and its status says the release was not read yet.
"""
import ast
import inspect
import os
import textwrap

from npu_shim.patch import Defect, Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.code import code_names
from npu_shim.patches._shared.structure import found

TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
METHOD = "forward_extend"
SGLANG_FIA_SWITCH = "ASCEND_USE_FIA"
QLENS_OP = "_npu_flash_attention_qlens"
FIA_OP = "npu_fused_infer_attention_score"
FIA_KEPT = ("sglang's own FIA prefill branch of the release (npu_fused_infer_attention_score), "
            "as with ASCEND_USE_FIA=1, as sglang PR #39905 does (qlens wrong at page sizes 16/32/64, "
            "sglang #38196); page size >= 128, or not a multiple of 16, keeps "
            "_npu_flash_attention_qlens")
SMALLEST_SAFE_PAGE = 128   # PR #39905: qlens right at 128, wrong at 16/32/64
FIA_PAGE_ALIGN = 16        # FIA's block_size without quantisation (sglang #25169, PR #29815)
# The wrapper reads these by position and name, as every release read declares them.
PARAMETERS = ("self", "q", "k", "v", "layer", "forward_batch", "save_kv_cache", "q_rope", "k_rope",
              "topk_indices", "sinks")

# Gates upstream has before the qlens call, as ``ast.unparse`` of the ``if`` tests.
QLENS_GUARD = ("layer.qk_head_dim <= 128 and causal and (forward_batch.encoder_lens is None) "
               "and (layer.logit_cap == 0) and (not getattr(self, 'use_native_sdpa', False))")
COMMON_GATES = frozenset({
    "is_mla_preprocess_enabled() and self.use_mla",
    "self.is_dllm_model",
    "topk_indices is not None",
    "not self.use_mla",
    "is_cp_mode",
    "self.use_fia",
    "layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY",
    QLENS_GUARD,
    "not self.use_alibi",
})
SPECULATIVE_V1_V2 = ("forward_batch.forward_mode.is_target_verify() or "
                     "forward_batch.forward_mode.is_draft_extend() or "
                     "forward_batch.forward_mode.is_draft_extend_v2()")
SPECULATIVE_V2 = "forward_batch.forward_mode.is_target_verify() or forward_batch.forward_mode.is_draft_extend_v2()"


class GateFamily:
    """One release family: the gates it expects, and which calls reach qlens there.

    ``check``/``build`` are the family's (see the ``Family`` declarations below)."""

    gates = frozenset()
    absent = frozenset()     # gates whose presence means another family
    # conditions_digest of the if tests read, for the family whose fence is open above: its gates
    # are a subset of the method's if tests, so a gate a newer release adds would go unseen;
    # only a set of if tests read proves the replacement still routes as upstream does
    conditions_read = None

    def matches(self, conditions):
        return self.gates <= conditions and not self.absent & conditions

    def check(self, module, context):
        conditions = gate_conditions(module)
        if not self.matches(conditions):
            raise TargetMismatch("the gates of %s before the qlens call are not this family's" % METHOD)
        if self.conditions_read is not None and conditions_digest(conditions) not in self.conditions_read:
            raise TargetMismatch("the if tests of %s are not a set read for this family (digest %s, known %s)"
                                 % (METHOD, conditions_digest(conditions), ", ".join(sorted(self.conditions_read))))
        return {"AscendAttnBackend.%s" % METHOD: module.AscendAttnBackend.__dict__[METHOD]}

    def build(self, module, context):
        path = "AscendAttnBackend.%s" % METHOD
        original = found(context, path, lambda: module.AscendAttnBackend.__dict__[METHOD])
        return {path: make_forward_extend(original, self, context)}

    def speculative(self, mode):
        return mode.is_target_verify() or mode.is_draft_extend() or mode.is_draft_extend_v2()

    def takes_sinks_branch(self, backend, layer, sinks):
        return sinks is not None

    def takes_other_kernel(self, backend):
        return False

    def reaches_qlens(self, backend, layer, forward_batch, topk_indices, sinks):
        """True where upstream's forward_extend (use_fia off) ends in the qlens op."""
        from sglang.srt.layers.radix_attention import AttentionType

        mode = forward_batch.forward_mode
        return not (
            backend.use_mla
            or backend.is_dllm_model
            or topk_indices is not None
            or self.speculative(mode)
            or (mode.is_context_parallel_extend() and forward_batch.attn_cp_metadata is not None
                and backend.attn_cp_size > 1)
            or self.takes_sinks_branch(backend, layer, sinks)
            or self.takes_other_kernel(backend)
            or layer.qk_head_dim > 128
            or layer.is_cross_attention
            or layer.attn_type == AttentionType.ENCODER_ONLY
            or forward_batch.encoder_lens is not None
            or layer.logit_cap != 0
            or getattr(backend, "use_native_sdpa", False)
            or backend.use_alibi
        )


class SinksOnly(GateFamily):
    gates = COMMON_GATES | {SPECULATIVE_V1_V2, "sinks is not None"}
    absent = frozenset({"sinks is not None or (self.is_hybrid_swa and layer.sliding_window_size != -1)"})


class HybridSwa(GateFamily):
    gates = COMMON_GATES | {SPECULATIVE_V1_V2,
                            "sinks is not None or (self.is_hybrid_swa and layer.sliding_window_size != -1)"}

    def takes_sinks_branch(self, backend, layer, sinks):
        return sinks is not None or (backend.is_hybrid_swa and layer.sliding_window_size != -1)


class SwaFia(GateFamily):
    gates = COMMON_GATES | {SPECULATIVE_V2,
                            "sinks is not None or (self._is_swa_layer(layer) and self.use_fia)"}
    absent = frozenset({"self.use_fa"})

    def speculative(self, mode):
        return mode.is_target_verify() or mode.is_draft_extend_v2()


class SwaFiaFa(SwaFia):
    gates = SwaFia.gates | {"self.use_fa"}
    absent = frozenset()
    conditions_read = frozenset({"8547f59e9445", "2bbdba1e405d", "050eb05c58b8"})

    def takes_other_kernel(self, backend):
        return backend.use_fa


SINKS_ONLY, HYBRID_SWA, SWA_FIA, SWA_FIA_FA = FAMILIES = (SinksOnly(), HybridSwa(), SwaFia(), SwaFiaFa())


def if_conditions(function) -> frozenset:
    """``ast.unparse`` of every ``if`` test in ``function`` (formatting and comments do not matter)."""
    try:
        source = textwrap.dedent(inspect.getsource(inspect.unwrap(function)))
    except (OSError, TypeError) as exc:
        raise TargetMismatch("cannot read the source of %s (%s)" % (METHOD, exc)) from None
    tree = ast.parse(source)
    return frozenset(ast.unparse(node.test) for node in ast.walk(tree) if isinstance(node, ast.If))


def conditions_digest(conditions) -> str:
    """A hash of a set of ``if`` tests (:func:`if_conditions`), sorted."""
    import hashlib

    return hashlib.sha256("\n".join(sorted(conditions)).encode()).hexdigest()[:12]


def gate_conditions(module) -> frozenset:
    """The ``if`` tests of ``forward_extend``, once its signature and ops are the expected ones."""
    method = module.AscendAttnBackend.__dict__.get(METHOD)
    if method is None:
        raise TargetMismatch("AscendAttnBackend does not define %s itself" % METHOD)
    parameters = tuple(inspect.signature(method).parameters)
    if parameters[:len(PARAMETERS)] != PARAMETERS:
        raise TargetMismatch("%s takes %s, not %s first" % (METHOD, ", ".join(parameters),
                                                            ", ".join(PARAMETERS)))
    names = code_names(method)
    for op in (QLENS_OP, FIA_OP):
        if op not in names:
            raise TargetMismatch("%s does not call %s" % (METHOD, op))
    return if_conditions(method)


class FiaPrefillView:
    """The backend as upstream's forward_extend sees it, with ``use_fia`` on.

    Reads go to the backend; forward_extend writes nothing to ``self`` in any
    release this patch applies to, and the view refuses writes so that a
    release that starts to would fail loudly instead of losing state.
    """

    __slots__ = ("_backend", "_patch")
    use_fia = True

    def __init__(self, backend, patch):
        object.__setattr__(self, "_backend", backend)
        object.__setattr__(self, "_patch", patch)

    def __getattr__(self, name):
        return getattr(self._backend, name)

    def __setattr__(self, name, value):
        raise AttributeError("%s: forward_extend set %s on the backend through the FIA view"
                             % (self._patch, name))


# status note for a page size FIA cannot take (stable words: tests read them)
UNALIGNED_PAGE = ("page size %%d is not a multiple of %d: FIA's block_size must be (sglang #25169, PR #29815), "
                  "so the prefill keeps upstream's _npu_flash_attention_qlens call" % FIA_PAGE_ALIGN)


def sglang_fia_explicit(environ=os.environ) -> bool:
    return environ.get(SGLANG_FIA_SWITCH, "").strip() != ""


def make_forward_extend(original, family, context):
    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None,
                       k_rope=None, topk_indices=None, sinks=None, *args, **kwargs):
        if (self.page_size < SMALLEST_SAFE_PAGE and not self.use_fia and not sglang_fia_explicit()
                and family.reaches_qlens(self, layer, forward_batch, topk_indices, sinks)):
            if self.page_size % FIA_PAGE_ALIGN:
                context.note("page-%d" % self.page_size, UNALIGNED_PAGE % self.page_size)
                context.count("upstream_calls")
                backend = self
            else:
                context.count("calls")
                backend = FiaPrefillView(self, context.patch)
        else:
            context.count("upstream_calls")
            backend = self
        return original(backend, q, k, v, layer, forward_batch, save_kv_cache, q_rope, k_rope,
                        topk_indices, sinks, *args, **kwargs)

    return context.present(forward_extend, original, "the FIA path where a small page reaches the qlens call",
                           wrapped=True)


PATCH = Patch(
    name="sglang.small_page_fia",
    target=TARGET,
    replaces=("AscendAttnBackend.%s" % METHOD,),
    requires={"sglang": ""},
    outside_window={"sglang": "below the window the FIA prefill branch ignores the paged KV cache (wrong with "
                              "a cached prefix: nothing right to route to)"},
    needs_npu=True,
    families=(
        Family(__name__ + ":SINKS_ONLY", fence=">=0.5.12,<0.5.13", keeps=FIA_KEPT),
        Family(__name__ + ":HYBRID_SWA", fence=">=0.5.13,<0.5.14", keeps=FIA_KEPT),
        Family(__name__ + ":SWA_FIA", fence=">=0.5.14,<0.5.15", keeps=FIA_KEPT),
        Family(__name__ + ":SWA_FIA_FA", fence=">=0.5.15", keeps=FIA_KEPT),
    ),
    summary="prefill with page size < 128 (a multiple of 16, as FIA's block_size must be) goes through sglang's "
            "FIA path, not the legacy qlens op (silently wrong at page sizes 16, 32, 64 on 910C / A3: sglang "
            "issue #38196, PR #39905)",
    # None: forward_extend's FIA route takes its lengths from the metadata's host lists.
    selftest=Selftest("npu_shim.selftest.sglang_small_page_fia", host_syncs=0),
    defect=Defect("sglang's prefill with KV pages smaller than 128 calls _npu_flash_attention_qlens, which needs 128",
                  shows="raises", says="_npu_flash_attention_qlens"),
)
