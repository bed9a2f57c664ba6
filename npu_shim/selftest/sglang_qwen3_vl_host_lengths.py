"""Selftest of ``sglang.qwen3_vl_host_lengths``: one whole Qwen3-VL vision-tower forward, no read back.

sglang's own Qwen3-VL tower (:mod:`npu_shim.selftest.sglang_tower`), one forward over three
images in bfloat16 with the blocks on the host cu_seqlens it built: the deviation from the same tower in float64 and the
device->host reads of the whole forward (expected: 0; the attention's are served by
``sglang.vision_device_lengths``, on host lengths: upstream's path).
"""
PATCH_NAME = "sglang.qwen3_vl_host_lengths"
TOWER = "Qwen3-VL"


def run(device=None):
    from npu_shim.selftest.sglang_tower import run_tower

    return run_tower(TOWER, PATCH_NAME, device)
