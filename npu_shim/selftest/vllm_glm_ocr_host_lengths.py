"""Selftest of ``vllm.glm_ocr_host_lengths``: GLM-OCR's vision tower gets the host lengths at its own copy.

Builds vLLM's own GLM-OCR vision tower from a tiny random config
(:mod:`npu_shim.testing.census`) with vllm-ascend's ``AscendMMEncoderAttention``
(patched by ``vllm.mm_encoder_attn``), runs one forward over an image and a
two-frame video in ``torch.inference_mode()``, and reports the largest
deviation from the same tower in float64 with the reference attention, the
device->host reads of the forward (0: the attention takes the host lengths kept
on the tower's own copy of ``cu_seqlens``), the time, and the family that applied.
"""
PATCH_NAME = "vllm.glm_ocr_host_lengths"
TOWER = "GLM-OCR"


def run(device=None):
    from npu_shim.selftest import applied_target
    from npu_shim.selftest.vllm_census_tower import run_tower

    applied_target(PATCH_NAME)
    return run_tower(TOWER, PATCH_NAME, device)
