"""The family of ``vllm.mimo_v2_v_head_dim`` / ``vllm.mimo_v2_flash_v_head_dim``: ``MiMoV2Attention``'s
``__init__`` and ``forward`` edited so that the layer takes the platform's attention backend instead
of a DiffKV backend of the model's choosing.

``__init__``: the DiffKV branch is not taken, and the one ``Attention(...)`` call goes through
:func:`platform_attention_factory`, which decides per layer, at build. By default (native) it builds
the layer as called (``head_size_v`` the model's 128) and refuses it where the impl would not serve
V != K (``vllm.ascend_attention_v_head_dim`` not applied). With ``NPU_SHIM_VLLM_MIMO_PAD_V=1`` it
builds it with ``head_size_v = head_size`` (V padded: the shape of vLLM's own 0.14 - 0.19 model).
``forward``: V padded before ``self.attn`` and the output cut after it, for a layer built padded
only (read from the layer's own ``attn.head_size_v``); nothing changes for a native layer.

One shape of upstream code serves both patches (the model moved from ``mimo_v2_flash`` to
``mimo_v2``, the class did not change where the edits anchor): ``__init__`` chooses a DiffKV
backend under ``if self.v_head_dim != self.head_dim:`` and builds one ``Attention(...)`` with
``head_size_v=``; ``forward`` calls ``attn_output = self.attn(q, k, v)``.
"""
import inspect

from npu_shim import _config
from npu_shim.patch import NotNeeded, TargetMismatch
from npu_shim.patches._shared.source_edit import InsertAfter, InsertBefore, ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import module_class, own_function

CLASS = "MiMoV2Attention"
CALL = "attn_output = self.attn(q, k, v)"

# __init__: the DiffKV branch is not taken (the platform picks its own attention backend, as for
# any layer), and the one Attention(...) call goes through platform_attention (native or padded).
INIT_EDITS = (
    ReplaceExpression("self.v_head_dim != self.head_dim", "False"),
    ReplaceExpression("Attention", "platform_attention"),
)
# forward: for a layer built padded, V padded with zeros to the key head dim before the attention,
# the output cut back to the value head dim after it (the statements of vLLM's own model before
# its DiffKV backends, as helpers: pad_v / unpad_output).
FORWARD_EDITS = (
    InsertBefore(CALL, "v = pad_v(self, v)"),
    InsertAfter(CALL, "attn_output = unpad_output(self, attn_output)"),
)


def built_padded(layer):
    """Whether ``layer``'s attention was built with V padded: its ``head_size_v`` is not the
    layer's value head dim."""
    return getattr(layer.attn, "head_size_v", layer.head_dim) != layer.v_head_dim


def pad_v(layer, v):
    """``v`` (tokens, kv_heads * v_head_dim) padded with zeros to (tokens, kv_heads * head_dim) for
    a layer built padded; unchanged otherwise."""
    import torch

    if not built_padded(layer):
        return v
    v = v.view(-1, layer.num_kv_heads, layer.v_head_dim)
    v = torch.nn.functional.pad(v, [0, layer.head_dim - layer.v_head_dim], value=0)
    return v.view(-1, layer.num_kv_heads * layer.head_dim)


def unpad_output(layer, attn_output):
    """For a layer built padded, the attention output (tokens, heads * head_dim) cut to (tokens,
    heads * v_head_dim): the padded columns of V give zero columns of the output, dropped here;
    unchanged otherwise."""
    if not built_padded(layer):
        return attn_output
    return attn_output.view(-1, layer.num_heads, layer.head_dim)[..., :layer.v_head_dim].reshape(
        -1, layer.num_heads * layer.v_head_dim)


# torch_npu's npu_fused_infer_attention_score_v2 (op-plugin's page, revision 5e735e5), which
# vllm-ascend calls for a layer with sinks: learnable_sink only with V_D <= 128.
SINK_MAX_V_DIM = 128
SINKS_REFUSED = (
    "MiMoV2Attention layer %r (learnable sinks, K head dim %d, V head dim %d): not built with V padded "
    "to %d. vllm-ascend would serve it with torch_npu's npu_fused_infer_attention_score_v2 with V_D %d, "
    "GQA, a paged cache and learnable_sink, which that op's page (op-plugin revision 5e735e5) does not "
    "take: \"GQA和PA场景不支持V_D等于192\" (V_D 192 not with GQA or page attention) and learnable_sink "
    "\"仅支持value的d小于等于128\" (sinks only with V_D <= 128); vLLM's own model makes the same padded "
    "call in the releases where it pads V itself. NPU_SHIM_VLLM_MIMO_PAD_SINKS=1 builds it padded anyway "
    "(for a CANN that takes that call; unproven here), or serve another model.")
NOT_SERVED = (
    "MiMoV2Attention layer %r (K head dim %d, V head dim %d): not built on %s.%s, which would not serve a "
    "V head dim unlike K's: %s. Let npu-shim's vllm.ascend_attention_v_head_dim apply, or set "
    "NPU_SHIM_VLLM_MIMO_PAD_V=1 (V padded to the key head dim).")


def refuse_padded_sinks(prefix, head_size, head_size_v, sinks):
    """Raise NotImplementedError (:data:`SINKS_REFUSED`, naming the attention layer ``prefix``) for a
    layer with learnable ``sinks`` whose V of ``head_size_v`` is padded to a ``head_size`` past
    :data:`SINK_MAX_V_DIM`, unless ``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1``; return otherwise. Shared with
    ``vllm.mimo_v2_flash_sinks_refuse`` (the releases where the model pads V itself)."""
    padded = head_size_v is not None and head_size_v != head_size
    if padded and head_size > SINK_MAX_V_DIM and sinks is not None and not _config.settings().mimo_pad_sinks:
        raise NotImplementedError(SINKS_REFUSED % (prefix, head_size, head_size_v, head_size, head_size))


def passed_sinks(bound, extra):
    """The ``sinks`` the call passes: a parameter of its own, or in ``**extra`` (vLLM's
    ``**extra_impl_args``)."""
    if "sinks" in bound.arguments:
        return bound.arguments["sinks"]
    return (bound.arguments.get(extra) or {}).get("sinks") if extra else None


def platform_attention_factory(attention_class):
    """A stand-in for ``attention_class`` (vLLM's ``Attention``), deciding per layer, no state kept:

    * native (default): the layer built as called, its own ``head_size_v``; a layer with V != K
      whose impl would not serve it (:func:`npu_shim.patches.vllm_ascend.attention_v_head_dim.why_not_served`)
      is refused (NotImplementedError naming the layer, the impl and the way out);
    * ``NPU_SHIM_VLLM_MIMO_PAD_V=1``: built with ``head_size_v = head_size`` (V padded by
      :func:`pad_v`); a layer with sinks whose V would be padded past :data:`SINK_MAX_V_DIM` is
      refused unless ``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1``.
    """
    from npu_shim.patches.vllm_ascend.attention_v_head_dim import why_not_served

    signature = inspect.signature(attention_class)
    for name in ("head_size", "head_size_v"):
        if name not in signature.parameters:
            raise TargetMismatch("%s takes no %s" % (attention_class.__qualname__, name))
    extra = next((p.name for p in signature.parameters.values() if p.kind is p.VAR_KEYWORD), None)

    def platform_attention(*args, **kwargs):
        bound = signature.bind(*args, **kwargs)
        head_size, head_size_v = bound.arguments["head_size"], bound.arguments.get("head_size_v")
        prefix = bound.arguments.get("prefix", "")
        if head_size_v is None or head_size_v == head_size:
            return attention_class(*args, **kwargs)
        settings = _config.settings()
        if settings.mimo_pad_v:
            refuse_padded_sinks(prefix, head_size, head_size_v, passed_sinks(bound, extra))
            bound.arguments["head_size_v"] = head_size
            return attention_class(*bound.args, **bound.kwargs)
        attention = attention_class(*args, **kwargs)
        impl = getattr(attention, "impl", None)
        why = why_not_served(impl)
        if why:
            raise NotImplementedError(NOT_SERVED % (prefix, head_size, head_size_v, type(impl).__module__,
                                                    type(impl).__qualname__, why))
        return attention

    return platform_attention


class _VHeadDim:
    def check(self, module, context):
        layer = module_class(module, CLASS)
        forward = own_function(layer, "forward")
        if "functional.pad" in inspect.getsource(forward):
            raise NotNeeded("%s.forward pads V itself" % CLASS)
        attention = getattr(module, "Attention", None)
        if not isinstance(attention, type):
            raise TargetMismatch("%s has no Attention class" % module.__name__)
        return self.edited(module, own_function(layer, "__init__"), forward)

    def edited(self, module, init, forward):
        """{"MiMoV2Attention.__init__": edited, "MiMoV2Attention.forward": edited}; TargetMismatch
        naming a missing anchor."""
        return {
            CLASS + ".__init__": edit_function(
                init, INIT_EDITS, names={"platform_attention": platform_attention_factory(module.Attention)}),
            CLASS + ".forward": edit_function(
                forward, FORWARD_EDITS, names={"pad_v": pad_v, "unpad_output": unpad_output}),
        }

    def build(self, module, context):
        layer = module_class(module, CLASS)
        edited = context.found       # check's {path: edited} (the engine hands it to build)
        init, forward = own_function(layer, "__init__"), own_function(layer, "forward")
        return {
            CLASS + ".__init__": context.present(
                edited[CLASS + ".__init__"], init,
                "no DiffKV backend: the platform's attention backend with the layer's own head_size_v, refused "
                "at build where the impl does not serve it (NPU_SHIM_VLLM_MIMO_PAD_V=1: head_size_v = head_size)"),
            CLASS + ".forward": context.present(
                edited[CLASS + ".forward"], forward,
                "for a layer built padded only: V padded with zeros to the key head dim, the output cut back"),
        }


V_HEAD_DIM = _VHeadDim()
