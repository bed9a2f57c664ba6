"""Selftest of ``vllm.mm_encoder_attn_310p``: a patched 310P vision-tower attention stack.

Builds a few real ``AscendMMEncoderAttention310`` layers (vllm-ascend's own
310P class, already patched by the shim with the family that applies to the
installed release) shaped like Qwen2.5-VL's ViT (16 heads of 80: a multiple of
16, as the 310P kernel requires; padded to 128 where the release pads), runs
one encoder forward over three images of different sizes packed into one
sequence with a model-given scale, and reports the largest deviation from the
float64 reference, the host syncs of that forward (one: the single copy of
``cu_seqlens``, whatever the depth), the time it took, and the family and NPU
op that ran. The class exists whatever the SoC; on an NPU box the op runs
there (upstream 0.13-0.17 call the same op on A2/A3 too).
"""
from npu_shim.selftest.vllm_mm_encoder_attn import run_encoder_stack

PATCH_NAME = "vllm.mm_encoder_attn_310p"
CLASS_NAME = "AscendMMEncoderAttention310"


def run(device=None):
    return run_encoder_stack(PATCH_NAME, CLASS_NAME, device)
