"""Selftest of ``vllm.glm4_1v_host_lengths``: one whole GLM-4.1V vision-tower forward, no read back.

Builds vLLM's own GLM-4.1V vision tower from a tiny random config
(:mod:`npu_shim.testing.towers`) with vllm-ascend's ``AscendMMEncoderAttention``
(patched by ``vllm.mm_encoder_attn``), runs one forward over an image and a
two-frame video in ``torch.inference_mode()``, and reports the largest
deviation from the same tower in float64 (vLLM's own code, the reference
attention), the device->host reads of the forward (0: the embeddings take their
lengths from the host, the attention the host ``cu_seqlens``), the time, and
the family that applied.
"""
PATCH_NAME = "vllm.glm4_1v_host_lengths"
TOWER = "GLM-4.1V"


def run(device=None):
    from npu_shim.selftest import applied_target
    from npu_shim.selftest import vllm_mm_encoder_host_lengths as towers_selftest

    applied_target(PATCH_NAME)
    return towers_selftest.run_tower(TOWER, PATCH_NAME, device)
