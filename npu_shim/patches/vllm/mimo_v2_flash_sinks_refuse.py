"""vllm.mimo_v2_flash_sinks_refuse — MiMo-V2-Flash's sink layers, V padded by the model itself, refused at build.

Why: vLLM 0.15 - 0.19's own MiMo-V2-Flash model pads V from its value head dim (128) to the key
  head dim (192) itself (``MiMoV2Attention.forward``) and hands each sliding-window layer its
  learnable sinks (``Attention(..., sinks=self.attention_sink_bias)``). vllm-ascend 0.15.0rc1 -
  0.19.1rc1 serve every layer with sinks, prefill and decode, with torch_npu's
  ``npu_fused_infer_attention_score_v2``: V_D 192, GQA, a paged cache on decode and
  ``learnable_sink``, which that op's page (op-plugin revision 5e735e5) does not take ("GQA和PA场景
  不支持V_D等于192"; learnable_sink "仅支持value的d小于等于128"). No hardware evidence says it works
  (vllm-ascend #9738, 2026-05, still asks for MiMo support). Upstream, the model builds and the
  first forward of its first sliding-window layer makes that call, in the middle of the first
  request: the emulation, following the page, refuses it there (0.19.1rc1: the V_D rule;
  0.15.0rc1 - 0.18.0 even earlier, on the band mask they pass with ``sparse_mode=4``, the
  ``swa_mask`` vllm-ascend #8387 removed in 0.19.1rc1). Reproduced with each wheel's classes
  (tests/lanes/test_mimo_v2_flash.py).
How: ``MiMoV2Attention.__init__`` is upstream's, edited
  (:func:`npu_shim.patches._shared.source_edit.edit_function`): its one ``Attention(...)`` call
  goes through :func:`checked_attention`, which refuses a call with sinks whose layer pads V past
  128 (``NotImplementedError`` naming the attention layer, the op and the page's rules: the
  message and the rule of ``vllm.mimo_v2_v_head_dim``, its family module's ``refuse_padded_sinks``),
  and otherwise makes upstream's call unchanged. So the refusal comes at model build, never
  mid-request; the full-attention layers (no sinks) and any layer whose V is not padded build as
  upstream builds them. ``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1`` builds the sink layers anyway (for a
  CANN that takes that call; unproven here). The check reads the structure: ``forward`` pads V
  itself (``functional.pad``) and ``__init__`` passes ``sinks=``.
  The full layers' calls (FIA v1 TND, K = V = 192, GQA, paged on decode) are kept: that page's
  TND rules (revision e59b0ec: D 192 only, "Q_N、K_N、V_N相等", no page attention) exclude GQA and
  paging for every TND head dim, the D 128 calls vllm-ascend makes for every model included, so
  they do not single out this call (docs/upstream-evidence.md, section 13).
Window: read in the wheels 0.15.0, 0.16.0, 0.17.0, 0.18.0 and 0.19.1 (one shape of
  ``MiMoV2Attention`` in ``mimo_v2_flash``). Below, vllm-ascend 0.14.0rc1 drops the sinks
  (``vllm.sinks_refuse``); from 0.20 the model hands the layer a DiffKV backend instead of padding
  V (``vllm.mimo_v2_flash_v_head_dim`` / ``vllm.mimo_v2_v_head_dim``, which refuse the same layer).
Upstream fix: none (no vllm-ascend release serves sinks with V_D > 128).
Remove when: the pinned vLLM is 0.20 or later, or torch_npu documents learnable_sink with V_D 192
  (GQA, paged).
"""
import inspect

from npu_shim.patch import Defect, Family, NotNeeded, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.source_edit import ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import module_class, own_function
from npu_shim.patches.vllm.mimo_v2_v_head_dim.families import passed_sinks, refuse_padded_sinks

CLASS = "MiMoV2Attention"
INIT = CLASS + ".__init__"
# __init__: the one Attention(...) call made through checked_attention(self), which refuses a
# padded layer with sinks and otherwise calls Attention as upstream does.
INIT_EDITS = (ReplaceExpression("Attention", "checked_attention(self)"),)


def checked_attention_factory(attention_class):
    """``checked_attention(layer)``: a stand-in for ``attention_class`` (vLLM's ``Attention``) in
    ``layer``'s ``__init__``. It refuses the call (``refuse_padded_sinks``) when it passes learnable
    sinks while ``layer`` pads V from its ``v_head_dim`` to the call's ``head_size`` past 128, and
    otherwise returns ``attention_class(...)`` of upstream's arguments, unchanged. Per call, no
    state kept."""
    signature = inspect.signature(attention_class)
    if "head_size" not in signature.parameters:
        raise TargetMismatch("%s takes no head_size" % attention_class.__qualname__)
    extra = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def checked_attention(layer):
        def attention(*args, **kwargs):
            bound = signature.bind(*args, **kwargs)
            refuse_padded_sinks(bound.arguments.get("prefix", ""), bound.arguments["head_size"],
                                layer.v_head_dim, passed_sinks(bound, extra))
            return attention_class(*args, **kwargs)

        return attention

    return checked_attention


class _Refuse:
    def check(self, module, context):
        layer = module_class(module, CLASS)
        init, forward = own_function(layer, "__init__"), own_function(layer, "forward")
        if "functional.pad" not in inspect.getsource(forward):
            raise NotNeeded("%s.forward does not pad V itself (the layer's V head dim reaches the attention)" % CLASS)
        if "sinks=" not in inspect.getsource(init):
            raise NotNeeded("%s.__init__ passes no sinks" % CLASS)
        attention = getattr(module, "Attention", None)
        if not isinstance(attention, type):
            raise TargetMismatch("%s has no Attention class" % module.__name__)
        return {INIT: edit_function(init, INIT_EDITS,
                                    names={"checked_attention": checked_attention_factory(attention)})}

    def build(self, module, context):
        init = own_function(module_class(module, CLASS), "__init__")
        edited = context.found[INIT]       # check's edit (the engine hands it to build)
        return {INIT: context.present(edited, init, "a layer with learnable sinks whose V the model pads past "
                                                    "128 refused at build; every other layer upstream's")}


REFUSE = _Refuse()

PATCH = Patch(
    name="vllm.mimo_v2_flash_sinks_refuse",
    target="vllm.model_executor.models.mimo_v2_flash",
    replaces=(INIT,),
    requires={"vllm": ""},
    outside_window={"vllm": "below, the vllm-ascend paired with it drops the sinks (vllm.sinks_refuse); above, "
                            "the model no longer pads V itself (vllm.mimo_v2_flash_v_head_dim / vllm.mimo_v2_v_head_dim "
                            "refuse the same layer)"},
    needs_npu=True,
    families=(
        Family(__name__ + ":REFUSE", fence=">=0.15.0,<0.20.0",
               keeps="upstream's layer build and vllm-ascend's op calls for every layer without sinks"),
    ),
    selftest=Selftest("npu_shim.selftest.vllm_mimo_v2_v_head_dim", host_syncs=0, arguments={"model": "mimo_v2_flash"}),
    defect=Defect("vLLM builds MiMo-V2-Flash's sink layers with V padded, which the backend serves wrong",
                  shows="raises", says="was built with V padded to 192"),
    summary="MiMo-V2-Flash's sliding-window layers (learnable sinks, V padded to 192 by the model) refused at "
            "build on Ascend instead of failing at the first forward (the op's page does not take that FIA v2 "
            "call); its full layers untouched; NPU_SHIM_VLLM_MIMO_PAD_SINKS=1 builds them anyway",
)
