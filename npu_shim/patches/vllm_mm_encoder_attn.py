"""vllm.mm_encoder_attn — one host sync per encoder forward, honour ``scale``.

Why: vllm-ascend 0.13/0.14 copy ``cu_seqlens`` to the host in every encoder
  layer and ignore the model's ``scale``; 0.15.0rc1 caches the copy in a
  module global keyed on digits of the layer prefix (seed 001, PR 6448).
How: not implemented yet (issue 6).
Upstream fix: vllm-ascend 0.18 receives precomputed sequence lengths from vLLM.
Remove when: the pinned vllm-ascend is 0.18 or later.
"""
from npu_shim.patch import Patch

PATCH = Patch(
    name="vllm.mm_encoder_attn",
    target="vllm_ascend.ops.mm_encoder_attention",
    replaces=("AscendMMEncoderAttention.__init__", "AscendMMEncoderAttention.forward_oot"),
    requires={"vllm-ascend": ">=0.13,<0.18"},
    needs_npu=True,
    summary="cache host seq lens per cu_seqlens tensor, honour scale",
)
