"""vllm.mm_encoder_attn_310p — the 310P encoder attention: one host copy per forward, honour ``scale``.

Why: on Atlas inference cards (310P) vllm-ascend registers its own
  ``AscendMMEncoderAttention310`` (``vllm_ascend._310p.ops.mm_encoder_attention``)
  as vLLM's ``"MMEncoderAttention"``: the attention of every ViT tower
  (Qwen2.5/3-VL, MoonViT, ...). In every release that has it (0.14.0rc1;
  0.18.0rc1 .. 0.26.0rc1; 0.15-0.17 have none) its ``forward_oot`` copies
  ``torch.diff(cu_seqlens)`` device->host in every layer (27 copies per
  27-layer forward; ``sequence_lengths`` from vLLM is ignored) and passes
  ``head_size ** -0.5`` to the kernel, ignoring a ``scale`` the model gave
  (max error 1.18 at ``scale=0.05``, measured on 0.18.0, 0.22.1rc1, 0.26.0rc1).
How: one family per 310P release family (modules in
  :mod:`npu_shim.patches.vllm_ascend.mm_encoder`, declared below), fenced by
  version and accepted by the structure of the installed class; ``npu-shim
  status`` names the one that applied. Each replaces ``forward_oot`` only and
  keeps upstream's op call and layout of its release (K/V repeated to the
  query heads, upstream's padding rule, per-segment host lengths in upstream's
  dtype, ``out=``), changing only where the lengths come from -- read from the
  device at most once per encoder forward, none for a host ``cu_seqlens`` or
  none given (see :mod:`npu_shim.patches.vllm_ascend.mm_encoder.common` for what "one
  forward" is) -- the scale (the model's), and, under GQA, the head count
  passed with the repeated K/V. A layer's state is built from its own
  attributes on first use (layers made with ``__new__`` work).

Upstream fix: none in any release its families list (the newest is in its reference row).
Remove when: vllm-ascend's 310P class reads host lengths once per encoder
  forward and passes the model's scale.
"""
from npu_shim.patch import Defect, Family, Patch, Selftest

PATCH_NAME = "vllm.mm_encoder_attn_310p"
CLASS_NAME = "AscendMMEncoderAttention310"
FAMILIES = "npu_shim.patches.vllm_ascend.mm_encoder."

PATCH = Patch(
    name=PATCH_NAME,
    target="vllm_ascend._310p.ops.mm_encoder_attention",
    subject=CLASS_NAME,
    replaces=(CLASS_NAME + ".forward_oot",),
    requires={"vllm-ascend": ""},
    outside_window={"vllm-ascend": "no 310P MMEncoderAttention class below the window nor in the releases "
                                   "it leaves out"},
    needs_npu=True,
    families=(
        Family(FAMILIES + "v014_310p", id="ascend-subclass-unpad", fence=">=0.14.0rc1,<0.15.0rc1",
               keeps="torch_npu._npu_flash_attention_unpad, no padding"),
        Family(FAMILIES + "v018_310p", id="vllm-subclass-unpad", fence=">=0.18.0rc1,<0.23.0rc1",
               keeps="torch_npu._npu_flash_attention_unpad"),
        Family(FAMILIES + "v023_310p", id="unpad-v2-capability",
               fence=">=0.23.0rc1",
               keeps="torch_npu._npu_flash_attention_unpad_v2(kernel_type=2) where torch_npu has it, "
                     "else torch_npu._npu_flash_attention_unpad"),
    ),
    summary="310P encoder attention: host seq lens once per encoder forward, honour scale",
    # One: the single copy of a device cu_seqlens per encoder forward, whatever the depth.
    selftest=Selftest("npu_shim.selftest.vllm_mm_encoder_attn_310p", host_syncs=1),
    defect=Defect("the 310P encoder attention reads cu_seqlens back per layer and ignores scale",
                  shows="reads"),
)
