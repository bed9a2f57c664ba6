"""vllm.moonvit_attn — MoonViT vision attention without an S x S mask.

Why: vLLM's MoonViT falls back to SDPA with a packed S x S boolean mask:
  303,548 tokens at 100 concurrent images need 85.8 GiB and OOM (seed 000);
  the per-image alternatives sync the host four times per image per layer.
How: not implemented yet (issue 5).
Upstream fix: none; vLLM 0.15 moved MoonViT to MMEncoderAttention.
Remove when: the pinned vLLM is 0.15 or later.
"""
from npu_shim.patch import Patch

PATCH = Patch(
    name="vllm.moonvit_attn",
    target="vllm.model_executor.models.moonvit",
    replaces=("VL_VISION_ATTENTION_FUNCTIONS['ascend_fa']", "MoonVitEncoderLayer.__init__"),
    requires={"vllm": ">=0.10.1,<0.15"},
    needs_npu=True,
    summary="register ascend_fa (one fused varlen call per layer) for MoonViT",
)
