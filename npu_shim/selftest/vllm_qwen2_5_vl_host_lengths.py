"""Selftest of ``vllm.qwen2_5_vl_host_lengths``: one whole Qwen2.5-VL tower forward, no read back.

Builds vLLM's own Qwen2.5-VL vision tower from a tiny random config
(:mod:`npu_shim.testing.towers`) with vllm-ascend's ``AscendMMEncoderAttention``
(patched by ``vllm.mm_encoder_attn``), runs one forward over an image and a
two-frame video in ``torch.inference_mode()``, and reports the largest
deviation from the same tower in float64 with the reference attention, the
device->host reads of the forward (0: the tower's own copies of ``cu_seqlens``
and ``cu_window_seqlens`` keep their host arrays), the time, and the family
that applied.
"""
PATCH_NAME = "vllm.qwen2_5_vl_host_lengths"
TOWER = "Qwen2.5-VL"


def run(device=None):
    from npu_shim.selftest import applied_target
    from npu_shim.selftest import vllm_mm_encoder_host_lengths as towers_selftest

    applied_target(PATCH_NAME)
    return towers_selftest.run_tower(TOWER, PATCH_NAME, device)
