"""vllm.ascend_attention_v_head_dim — vllm-ascend's decoder attention serves a layer whose V head dim differs from K's.

Why: vLLM's ``Attention`` takes ``head_size_v`` (MiMo-V2-Flash: K 192, V 128), sizes the layer's
  output and KV-cache spec with it, and vllm-ascend's model runner already allocates such a
  layer's K and V caches apart, V ``head_size_v`` wide (``_reshape_kv_cache_tensors``). But
  ``AscendAttentionBackendImpl`` knows only ``head_size``: a layer without sinks takes
  ``npu_fused_infer_attention_score`` (FIA v1) and views its output ``(tokens, heads,
  head_size)`` (a ``RuntimeError`` for V 128), and its decode takes ATB's
  ``_npu_paged_attention``, whose documented inputs have one head size for both caches. FIA v1's
  page documents K 192 / V 128 only without page attention; ``npu_fused_infer_attention_score_v2``
  (FIA v2, op-plugin page revision 5e735e5, TND constraints) documents "Q_D、K_D等于192, V_D等于
  128" with GQA and page attention, and ``learnable_sink`` with V_D <= 128. vllm-ascend already
  makes that FIA v2 call, in TND with the paged cache, for every layer with learnable sinks.
How: two of the impl's methods are upstream's, edited (:func:`npu_shim.patches._shared.source_edit.edit_function`):
  in ``forward_fused_infer_attention`` the test that sends a layer with sinks to FIA v2 (eager and
  graph capture alike) also sends a layer whose output is not ``head_size`` wide
  (``value_head_dim_differs``); in ``forward_impl`` such a layer never takes the paged-attention
  decode. The V head dim is read per call from the ``output`` vLLM hands the impl, shaped
  ``(tokens, heads, head_size_v)``: no state on the impl or its class, so two models in one
  process keep their own. A layer with V == K takes upstream's code unchanged (the added test is
  False). The FIA v2 call is upstream's own (its arguments, ``learnable_sink=self.sinks`` None for
  a layer without sinks, ``sparse_mode`` 3 causal / 4 with a window), fed the separate K and V
  caches vllm-ascend already views as ``(blocks, block_size, kv_heads * head dim)``.
Window edge: upstream passes ``pre_tokens=self.sliding_window`` (sparse_mode 4, next_tokens 0),
  which the op page's band reading admits as W + 1 keys (the current one and the W before it; the
  page's words and worked examples are quoted in npu_shim/emulation/decoder_attention.py), where
  the model (HF: a query at i sees i - W < j <= i), vLLM's FlashAttention ``(W - 1, 0)`` and vLLM's
  KV-cache manager use W. The extra key lies where the KV manager has already freed the block:
  once freed, the block table points at the null block there, so the error depends on the
  position. In ``forward_fused_infer_attention`` each read of ``self.sliding_window`` (the
  sparse_mode choices and both ``pre_tokens``) goes through :func:`sliding_pre_tokens`: W - 1 for a
  layer this patch serves (V != K), W otherwise -- the same value, so a V == K layer's call is
  upstream's -- unless ``NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE=1``, which gives every sliding-window
  layer W - 1 (off by default: W is the hardware-run call; the MiMo selftest probes which reading
  the installed op has and says whether to turn it on). Not edited: ACL graph capture
  (``full_graph_fia`` / ``full_graph_fia_v2`` and the replay's parameter update keep
  ``pre_tokens=W``; docs/limitations.md).
Window: read in the builds of 0.20.2rc1, 0.21.0rc1, 0.22.1rc1, 0.23.0, 0.24.0rc1, 0.25.1rc1,
  0.26.0rc1, 0.27.1rc1, 0.28.0rc1, 0.29.0rc1 and 0.30.0rc2 (the sinks test twice in
  ``forward_fused_infer_attention``: graph capture and eager; the paged-attention test once in
  ``forward_impl``). Below 0.20, vLLM's model pads V itself and no layer reaches the impl with V != K.
  The fence is open-ended: a later release gets the family where the edits' anchors match (its
  status says the release was not read yet), and is refused by structure where they do not. The
  window on vLLM is derived from the MiMo patches' (``MIMO_VLLM``).
Upstream fix: none (no vllm-ascend release reads ``head_size_v`` in its attention impl).
Remove when: vllm-ascend's attention impl serves ``head_size_v != head_size``.
"""
from npu_shim import _config
from npu_shim.patch import Defect, Family, Patch, Selftest, join_fences
from npu_shim.patches._shared.source_edit import ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import module_class, own_function
from npu_shim.patches.vllm import mimo_v2_flash_v_head_dim, mimo_v2_v_head_dim


def _mimo_vllm():
    """vLLM's releases where a MiMo layer with V != K reaches vllm-ascend (the MiMo patches'
    windows, joined): derived, so this window follows theirs (one range, as ``requires`` takes)."""
    windows = [spec for module in (mimo_v2_flash_v_head_dim, mimo_v2_v_head_dim)
               for spec in module.PATCH.window["vllm"]]
    joined = join_fences(windows)
    if len(joined) != 1:
        raise ValueError("the MiMo patches' vLLM windows %s do not join into one range" % windows)
    return joined[0]


MIMO_VLLM = _mimo_vllm()

TARGET = "vllm_ascend.attention.attention_v1"
IMPL = "AscendAttentionBackendImpl"
FIA = "forward_fused_infer_attention"
IMPL_FORWARD = "forward_impl"
REPLACES = (IMPL + "." + FIA, IMPL + "." + IMPL_FORWARD)

FIA_EDITS = (
    ReplaceExpression("self.sinks is not None", "self.sinks is not None or value_head_dim_differs(self, output)",
                      count=2),
    # the two sparse_mode tests, the FIA v2 call's pre_tokens (test and value), the FIA v1 sliding call's pre_tokens
    ReplaceExpression("self.sliding_window", "sliding_pre_tokens(self, output)", count=5),
)
IMPL_FORWARD_EDITS = (
    ReplaceExpression("self.sliding_window is None",
                      "self.sliding_window is None and not value_head_dim_differs(self, output)"),
)


def value_head_dim(impl, output):
    """The value head dim of the layer ``impl`` serves, read from the ``output`` vLLM hands it:
    ``(tokens, heads, head_size_v)``, or ``(tokens, heads * head_size_v)``."""
    if output.dim() == 3:
        return output.shape[-1]
    return output.shape[-1] // impl.num_heads


def value_head_dim_differs(impl, output):
    return value_head_dim(impl, output) != impl.head_size


def sliding_pre_tokens(impl, output):
    """What ``forward_fused_infer_attention`` reads for ``self.sliding_window``: None without a
    window; W - 1 (the op page's band admits pre_tokens + 1 keys) for a layer with V != K, or for
    every layer with ``NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE=1``; else upstream's W. Host values
    only (the window, the output's shape, the settings)."""
    window = impl.sliding_window
    if window is None:
        return None
    if value_head_dim_differs(impl, output) or _config.settings().ascend_swa_window_edge:
        return window - 1
    return window


def why_not_served(impl):
    """None if ``impl`` (an attention impl instance) serves a layer with V != K: it is vllm-ascend's
    ``AscendAttentionBackendImpl`` (or a subclass that keeps its ``forward``, ``forward_impl`` and
    ``forward_fused_infer_attention``) with this patch applied; else why not. The model side asks
    before it builds such a layer on the platform's backend."""
    import sys

    module = sys.modules.get(TARGET)
    base = getattr(module, IMPL, None)
    if base is None or not isinstance(impl, base):
        return "the impl is not %s.%s" % (TARGET, IMPL)
    if any(getattr(getattr(base, name), "__npu_shim_patch__", None) != PATCH.name for name in (FIA, IMPL_FORWARD)):
        return "%s is not patched in this process (see npu-shim status)" % PATCH.name
    own = [name for name in ("forward", FIA, IMPL_FORWARD) if getattr(type(impl), name) is not getattr(base, name)]
    if own:
        return "%s overrides %s" % (type(impl).__qualname__, ", ".join(own))
    return None


class _ValueHeadDim:
    def check(self, module, context):
        impl = module_class(module, IMPL)
        return self.edited(own_function(impl, FIA), own_function(impl, IMPL_FORWARD))

    @staticmethod
    def edited(fia, forward_impl):
        """{method: edited}; TargetMismatch naming an anchor not found as often as declared."""
        names = {"value_head_dim_differs": value_head_dim_differs, "sliding_pre_tokens": sliding_pre_tokens}
        return {IMPL + "." + FIA: edit_function(fia, FIA_EDITS, names=names),
                IMPL + "." + IMPL_FORWARD: edit_function(forward_impl, IMPL_FORWARD_EDITS, names=names)}

    def build(self, module, context):
        impl = module_class(module, IMPL)
        originals = {IMPL + "." + FIA: own_function(impl, FIA),
                     IMPL + "." + IMPL_FORWARD: own_function(impl, IMPL_FORWARD)}
        edited = context.found       # check's {path: edited} (the engine hands it to build)
        what = {IMPL + "." + FIA: "a layer whose V head dim differs from K's takes upstream's FIA v2 call "
                                  "(as a layer with sinks does), its window passed as pre_tokens W - 1 "
                                  "(every sliding layer with NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE=1)",
                IMPL + "." + IMPL_FORWARD: "a layer whose V head dim differs from K's never takes the "
                                           "paged-attention decode"}
        return {path: context.present(edited[path], originals[path], what[path]) for path in REPLACES}


VALUE_HEAD_DIM = _ValueHeadDim()

PATCH = Patch(
    name="vllm.ascend_attention_v_head_dim",
    target=TARGET,
    replaces=REPLACES,
    requires={"vllm-ascend": "", "vllm": MIMO_VLLM},
    outside_window={"vllm-ascend": "below, vLLM's model pads V itself (no layer with V != K reaches the impl)",
                    "vllm": "the window is the MiMo patches' (vllm.mimo_v2_flash_v_head_dim, "
                            "vllm.mimo_v2_v_head_dim), where a layer with V != K reaches the impl: below, the "
                            "model pads V itself; above, where they stop"},
    needs_npu=True,
    families=(
        Family(__name__ + ":VALUE_HEAD_DIM", fence=">=0.20.0rc1",
               keeps="vllm-ascend's own npu_fused_infer_attention_score_v2 call (TND, paged, learnable_sink "
                     "as the layer has it) for a layer with V != K, pre_tokens W - 1 for its window; every "
                     "V == K layer's calls unchanged unless NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE=1"),
    ),
    selftest=Selftest("npu_shim.selftest.vllm_mimo_v2_v_head_dim", host_syncs=0, arguments={"model": None}),
    defect=Defect("vllm-ascend's decoder attention cannot serve a V head dim unlike K's",
                  shows="raises", says="NotImplementedError: MiMoV2Attention layer"),
    summary="vllm-ascend's attention serves a layer whose V head dim differs from K's (MiMo-V2-Flash: K 192, "
            "V 128) through its own FIA v2 call, separate K and V caches, no paged-attention decode",
)
