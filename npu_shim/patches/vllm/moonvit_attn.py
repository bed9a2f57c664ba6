"""vllm.moonvit_attn — MoonViT vision attention as one fused varlen call per layer.

Why: vLLM's MoonViT (Kimi-VL vision tower) dispatches attention by name through
  ``VL_VISION_ATTENTION_FUNCTIONS``, which only knows ``flash_attention_2``
  (CUDA flash-attn) and ``sdpa``. On Ascend it falls back to ``sdpa``, which
  packs every image of the batch into one sequence and builds a dense
  ``(1, S, S)`` boolean mask: 303,548 tokens at 100 concurrent images need
  303,548² B = 85.8 GiB and OOM (Kimi-VL on vllm 0.10.1.1). Filling that mask slices with the
  ``cu_seqlens`` tensor entries, four host syncs per image per layer
  (10,800 per forward at 100 images). Earlier fixes tried went through an
  inverted-polarity mask (torch_npu masks True = *masked*: wrong answers), an
  all-False mask (images attend to each other) and a per-image loop (the same
  host syncs).
How: register ``"ascend_fa"`` in ``VL_VISION_ATTENTION_FUNCTIONS`` with
  upstream's calling convention — ``q, k, v`` of shape ``(T, N, D)``,
  ``q_cu_seqlens``, ``k_cu_seqlens`` -> ``(T, N*D)``, no output projection
  (the layer applies ``wo``) — served by :class:`npu_shim.kernels.VarlenAttention`:
  one fused block-diagonal call per layer, no mask tensor, host lengths read
  once per ``cu_seqlens`` tensor (the 27 layers of one forward share it, so
  at most one host sync per encoder forward).
  ``MoonVitEncoderLayer.__init__`` is wrapped to *select* the name without
  touching weights or ``config.json``: ``NPU_SHIM_MOONVIT_ATTN`` =
  ``auto`` (default: a layer that would use ``sdpa`` — or that asked for
  ``ascend_fa`` — uses ``ascend_fa``; anything else, e.g. ``flash_attention_2``
  where flash-attn is installed, stays), ``ascend_fa`` (every layer) or
  ``sdpa`` (upstream's path). Each layer that uses ``ascend_fa`` owns its
  ``VarlenAttention`` (``layer.npu_shim_attention``; decided once at
  construction). ``MoonVitEncoderLayer.attention_qkvpacked`` is wrapped only
  to make that object visible to the dispatched function for the duration of
  the call (a ContextVar: no process-global state two models could share);
  the upstream method itself runs unchanged. The patch needs ``torch_npu``
  (real, or the emulation under ``NPU_SHIM_EMULATE=1``); a ``config.json``
  asking for ``ascend_fa`` also needs ``transformers.attn_check``.
Window: vllm 0.8.5 (Kimi-VL's arrival) through 0.13.0 dispatch through
  ``VL_VISION_ATTENTION_FUNCTIONS`` with the same attention path (read from
  the wheels of 0.8.5, 0.9.0, 0.9.2, 0.10.0, 0.10.1.1, 0.10.2, 0.11.0, 0.11.2,
  0.12.0, 0.13.0; tested on 0.10.1.1 and 0.13.0). 0.14.0 and later build
  MoonViT on ``MMEncoderAttention`` and have no such dict: skipped there.
Upstream fix: none for the dict window; vLLM 0.14 moved MoonViT to
  ``MMEncoderAttention`` (served on Ascend by vllm-ascend, see vllm.mm_encoder_attn).
Remove when: the pinned vLLM is 0.14 or later.
"""
import contextvars

from npu_shim import _config
from npu_shim.patch import Defect, Family, Patch, Selftest, TargetMismatch

ATTENTION_NAME = "ascend_fa"
LAYER_KERNEL_ATTR = "npu_shim_attention"

# The VarlenAttention of the layer whose attention_qkvpacked is running (per
# thread / task, set only for the duration of that call).
_current_kernel = contextvars.ContextVar("npu_shim_moonvit_layer_kernel", default=None)


def selected_choice() -> str:
    """``NPU_SHIM_MOONVIT_ATTN`` as validated with the other variables (this process's settings)."""
    return _config.settings().moonvit_attn


def choose_implementation(requested, upstream_choice, choice) -> str:
    """The name a layer dispatches.

    ``requested`` is what the layer was built with (the config's value),
    ``upstream_choice`` what upstream's ``__init__`` made of it (it switches
    to ``flash_attention_2`` when flash-attn is importable).
    """
    if choice == "ascend_fa":
        return ATTENTION_NAME
    if choice == "sdpa":
        return "sdpa"
    if requested == ATTENTION_NAME or upstream_choice in (None, "sdpa"):
        return ATTENTION_NAME
    return upstream_choice


def attention_for(context):
    """``ascend_fa_attention``, counting for ``context``'s patch."""

    def ascend_fa_attention(q, k, v, q_cu_seqlens=None, k_cu_seqlens=None):
        """Block-diagonal (per image) attention, upstream's calling convention.

        ``q, k, v``: ``(T, N, D)`` packed over the images; ``q_cu_seqlens`` /
        ``k_cu_seqlens``: cumulative lengths with a leading 0 (MoonViT passes the
        same tensor for both; ``None`` means one sequence). Returns ``(T, N*Dv)``.
        """
        import torch

        from npu_shim.kernels import VarlenAttention, host_cu_seqlens
        from npu_shim.kernels.seqlens import is_cached

        context.count("calls")
        if q.dim() != 3 or k.dim() != 3 or v.dim() != 3:
            raise ValueError("ascend_fa expects packed q, k, v of shape (T, N, D); got %s, %s, %s"
                             % (tuple(q.shape), tuple(k.shape), tuple(v.shape)))
        cu_seqlens = q_cu_seqlens
        if cu_seqlens is None:
            cu_seqlens = torch.tensor([0, q.shape[0]], dtype=torch.int32, device=q.device)
        elif isinstance(cu_seqlens, torch.Tensor) and not is_cached(cu_seqlens):
            context.count("host_copies")   # the one read of this tensor's values
        if k_cu_seqlens is not None and k_cu_seqlens is not cu_seqlens:
            if host_cu_seqlens(k_cu_seqlens) != host_cu_seqlens(cu_seqlens):
                raise ValueError("ascend_fa serves self-attention: q_cu_seqlens and k_cu_seqlens must be equal")
        kernel = _current_kernel.get()
        num_heads, head_dim = q.shape[1], q.shape[2]
        if kernel is None or (kernel.num_heads, kernel.head_dim) != (num_heads, head_dim):
            # Called outside a patched layer: decide the kernel for this call only.
            kernel = VarlenAttention(num_heads, head_dim)
        out = kernel(q, k, v, cu_seqlens)
        return out.reshape(q.shape[0], -1)

    return ascend_fa_attention


def _attn_implementation_default(init) -> str:
    import inspect

    param = inspect.signature(init).parameters.get("attn_implementation")
    if param is None or param.default is inspect.Parameter.empty:
        raise TargetMismatch("MoonVitEncoderLayer.__init__ has no attn_implementation keyword with a default")
    return param.default


def check(module, context) -> None:
    from npu_shim.patches._shared.code import names_in_code

    table = module.VL_VISION_ATTENTION_FUNCTIONS
    if not isinstance(table, dict) or "sdpa" not in table:
        raise TargetMismatch("VL_VISION_ATTENTION_FUNCTIONS is not the name -> function dict with 'sdpa'")
    if ATTENTION_NAME in table:
        raise TargetMismatch("VL_VISION_ATTENTION_FUNCTIONS already has %r (registered by someone else)" % ATTENTION_NAME)
    layer = module.MoonVitEncoderLayer
    _attn_implementation_default(layer.__dict__["__init__"])
    method = layer.__dict__.get("attention_qkvpacked")
    if method is None:
        raise TargetMismatch("MoonVitEncoderLayer.attention_qkvpacked not found")
    code = getattr(method, "__code__", None)
    if code is None or "VL_VISION_ATTENTION_FUNCTIONS" not in names_in_code(code, nested=False):
        raise TargetMismatch("MoonVitEncoderLayer.attention_qkvpacked does not dispatch through "
                             "VL_VISION_ATTENTION_FUNCTIONS")


def build(module, context):
    layer_class = module.MoonVitEncoderLayer
    original_init = layer_class.__dict__["__init__"]
    original_attention = layer_class.__dict__["attention_qkvpacked"]
    default_requested = _attn_implementation_default(original_init)

    def __init__(self, *args, **kwargs):
        choice = selected_choice()
        original_init(self, *args, **kwargs)
        requested = kwargs.get("attn_implementation", default_requested)
        self.attn_implementation = choose_implementation(requested, self.attn_implementation, choice)
        kernel = None
        if self.attn_implementation == ATTENTION_NAME:
            from npu_shim.kernels import VarlenAttention

            kernel = VarlenAttention(self.num_heads, self.hidden_size_per_attention_head)
        # A plain attribute (VarlenAttention is no nn.Module): no parameters, no state_dict keys.
        setattr(self, LAYER_KERNEL_ATTR, kernel)

    def attention_qkvpacked(self, *args, **kwargs):
        token = _current_kernel.set(getattr(self, LAYER_KERNEL_ATTR, None))
        try:
            return original_attention(self, *args, **kwargs)
        finally:
            _current_kernel.reset(token)

    return {
        "VL_VISION_ATTENTION_FUNCTIONS['%s']" % ATTENTION_NAME: attention_for(context),
        "MoonVitEncoderLayer.__init__": context.present(
            __init__, original_init, "the layer's attention name chosen by NPU_SHIM_MOONVIT_ATTN", wrapped=True),
        "MoonVitEncoderLayer.attention_qkvpacked": context.present(
            attention_qkvpacked, original_attention, "upstream's, with the layer's kernel current", wrapped=True),
    }


PATCH = Patch(
    name="vllm.moonvit_attn",
    target="vllm.model_executor.models.moonvit",
    replaces=(
        "VL_VISION_ATTENTION_FUNCTIONS['%s']" % ATTENTION_NAME,
        "MoonVitEncoderLayer.__init__",
        "MoonVitEncoderLayer.attention_qkvpacked",
    ),
    requires={"vllm": ">=0.8.5,<0.14"},
    outside_window={"vllm": "above the window vLLM runs MoonViT attention through MMEncoderAttention"},
    needs_npu=True,
    families=(Family(__name__, id="dispatch-table",
               keeps="none upstream (sdpa with an S x S mask); adds torch_npu.npu_fusion_attention TND"),),
    summary="register ascend_fa (one fused varlen call per layer, no S x S mask) and select it on NPU",
    # One: the attention path's single read of cu_seqlens per forward, whatever the depth.
    selftest=Selftest("npu_shim.selftest.vllm_moonvit_attn", host_syncs=1),
    defect=Defect("MoonViT's vision attention has no fused NPU call (upstream's layers run sdpa)",
                  shows="raises", says="the tower's layers do not use ascend_fa"),
)
