"""sglang.npu_decode_v_head_dim — decode of an MHA layer whose V head dim differs from K's takes upstream's FIA v2 TND call.

Why: ``AscendAttnBackend``'s decode of an MHA layer (not MLA) makes, by mode and switches:
  eager, ``ASCEND_USE_FIA=1``: ``npu_fused_infer_attention_score`` BSND over the paged caches
  (``npu_fused_infer_attention_score_v2`` BSND with ``learnable_sink`` for a layer with sinks or a
  hybrid-SWA window); eager without FIA: ATB ``_npu_paged_attention`` (a layer with sinks:
  ``attention_sinks_triton``); graph mode, plain pool: ``npu_fused_infer_attention_score.out`` BSH;
  graph mode with sinks or the hybrid-SWA pool and FIA: ``npu_fused_infer_attention_score_v2`` in
  **TND** (``actual_seq_qlen`` the cumulative ones, ``actual_seq_kvlen`` each sequence's length,
  paged, sparse_mode 3 / 4 with the compressed mask, ``learnable_sink``). With a K cache 192 wide
  and a V cache 128 wide (MiMo-V2-Flash; the pool gets its V width from
  ``sglang.npu_mha_v_head_dim``) only the last is documented: op-plugin's
  torch_npu-npu_fused_infer_attention_score_v2.md (revision 5e735e5), 约束说明, "TND、TND_NTD、
  NTD_TND场景下query、key、value输入的综合限制", query D != 512, no rope: "TND场景,要求Q_D、K_D、
  V_D等于128,或者Q_D、K_D等于192,V_D等于128/192 ... GQA和PA场景不支持V_D等于192", "page
  attention场景下仅支持blocksize为16对齐且小于等于1024"; learnable_sink "仅支持TND、NTD_TND;
  仅支持value的d小于等于128". Outside TND the same page asks "参数key、value中对应tensor的shape
  需要完全一致", and FIA v1's page documents Q_D/K_D 192 with V_D 128 only without paging; ATB
  PagedAttention takes one head size for both caches (a separate V head size only as the MLA
  ``mlaVHeadSize``). So upstream's first decode step of such a layer makes an undocumented call
  (the emulation refuses each: NotImplementedError, mid-request), except in graph mode on the
  hybrid-SWA pool with ``ASCEND_USE_FIA=1``.
How: the layer's V head dim is read per call (``layer.v_head_dim`` against ``layer.qk_head_dim``).
  A layer with V == K, an MLA backend, a cross-attention layer or a sparse (``topk_indices``)
  call runs upstream's ``forward_decode`` / ``forward_decode_graph``, unedited. A layer with
  V != K runs them edited (:class:`~npu_shim.patches._shared.source_edit.ReplaceExpression`):
  ``forward_decode`` takes its graph-mode branch (``self.graph_mode and not
  self.enable_torch_compile`` -> True), and ``forward_decode_graph`` its FIA v2 TND branch
  (``sinks is not None or self.is_hybrid_swa`` -> True, ``self.use_fia`` -> True there): upstream's
  own KV write (``set_kv_buffer``) and upstream's own TND call, argument for argument, in eager
  and in graph mode, whatever ``ASCEND_USE_FIA`` says (the switch chooses sglang's op, not the pool
  layout: the call views the pool's buffers as upstream's TND branch does). Nothing is stored:
  two layers, or two models, in one process keep their own.
Upstream fix: none released (0.5.14 - 0.5.23 read).
Remove when: sglang's Ascend decode of a layer with V != K makes a documented call (the family's
  check then finds other conditions and says TargetMismatch; re-read the release).

The call's documentation is the page's 5e735e5 revision. An earlier revision (0d45aab) listed
192/128 in TND as bfloat16 only, without page attention, sparse_mode 0 or 3: a CANN older than
that page may refuse the paged call (as it would upstream's own graph-mode call on the hybrid
pool). A decode batch whose query rows outnumber its sequences (eager padding, which upstream's
FIA v1 branch trims) does not fit the TND lengths; the op then refuses it.
"""
from npu_shim.patch import Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.source_edit import ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import module_class, own_function

TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
BACKEND = "AscendAttnBackend"
DECODE, GRAPH = "forward_decode", "forward_decode_graph"
KEEPS = "npu_fused_infer_attention_score_v2(..., input_layout=\"TND\") of forward_decode_graph, as upstream calls it"

EDITS = {
    DECODE: (ReplaceExpression("self.graph_mode and (not self.enable_torch_compile)", "True"),),
    GRAPH: (ReplaceExpression("sinks is not None or self.is_hybrid_swa", "True"),
            ReplaceExpression("self.use_fia", "True")),
}


def upstream_layer(backend, layer, topk_indices):
    """True where the call stays upstream's: V == K, MLA, cross attention, sparse decode."""
    return (layer.v_head_dim == layer.qk_head_dim or backend.use_mla or topk_indices is not None
            or getattr(layer, "is_cross_attention", False))


class DecodeTnd:
    """``forward_decode`` branches to ``forward_decode_graph`` on ``self.graph_mode and (not
    self.enable_torch_compile)``; ``forward_decode_graph`` makes its FIA v2 TND call under ``sinks
    is not None or self.is_hybrid_swa`` and then ``self.use_fia`` (read once there)."""

    def check(self, module, context):
        """{path: upstream's function edited}; TargetMismatch names a missing anchor."""
        cls = module_class(module, BACKEND)
        if "topk_indices" not in own_function(cls, DECODE).__code__.co_varnames:
            raise TargetMismatch("%s.%s takes no topk_indices" % (BACKEND, DECODE))
        return {"%s.%s" % (BACKEND, name): edit_function(own_function(cls, name), edits)
                for name, edits in EDITS.items()}

    def build(self, module, context):
        cls = module_class(module, BACKEND)
        edited = context.found if isinstance(context.found, dict) else self.check(module, context)
        replacements = {}
        for name in EDITS:
            path, original = "%s.%s" % (BACKEND, name), own_function(cls, name)
            replacements[path] = context.present(
                self.make(original, edited[path], context), original,
                "a layer whose V head dim differs from K's decodes through upstream's FIA v2 TND call")
        return replacements

    @staticmethod
    def make(original, edited, context):
        """Per call: upstream's ``original`` for a layer that stays upstream's, else ``edited``."""
        if original.__name__ == DECODE:
            def method(self, q, k, v, layer, forward_batch, *args, **kwargs):
                if upstream_layer(self, layer, kwargs.get("topk_indices")):
                    context.count("upstream_calls")
                    return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
                context.count("calls")
                return edited(self, q, k, v, layer, forward_batch, *args, **kwargs)
        else:
            def method(self, q, k, v, layer, forward_batch, *args, **kwargs):
                if upstream_layer(self, layer, None):
                    return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
                context.count("tnd_calls")
                return edited(self, q, k, v, layer, forward_batch, *args, **kwargs)
        return method


DECODE_TND = DecodeTnd()

PATCH = Patch(
    name="sglang.npu_decode_v_head_dim",
    target=TARGET,
    replaces=("%s.%s" % (BACKEND, DECODE), "%s.%s" % (BACKEND, GRAPH)),
    requires={"sglang": ">=0.5.14"},
    outside_window={"sglang": "below the window the NPU MHA pool has one head dim for K and V: no layer "
                              "with V != K reaches the decode (sglang.npu_mha_v_head_dim_inline)"},
    needs_npu=True,
    families=(Family(__name__ + ":DECODE_TND", fence=">=0.5.14", keeps=KEEPS),),
    summary="decode of an MHA layer whose V head dim differs from K's (MiMo-V2-Flash K 192 / V 128) takes "
            "upstream's FIA v2 TND call, in eager and graph mode; V == K layers stay on upstream's decode",
    selftest=Selftest("npu_shim.selftest.sglang_v_head_dim:run", host_syncs=0,
                      arguments={"round_trip": "decode"}),
)
