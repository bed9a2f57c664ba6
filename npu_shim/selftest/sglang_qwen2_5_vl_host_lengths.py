"""Selftest of ``sglang.qwen2_5_vl_host_lengths``: one whole Qwen2.5-VL vision-tower forward, no read back.

sglang's own Qwen2.5-VL tower (:mod:`npu_shim.selftest.sglang_tower`), one forward over three
images in bfloat16 with Qwen2.5-VL's window and image bounds on the host: the deviation from the same tower in float64 and the
device->host reads of the whole forward (expected: 0; the attention's are served by
``sglang.vision_host_lengths`` / ``sglang.vision_device_lengths``).
"""
PATCH_NAME = "sglang.qwen2_5_vl_host_lengths"
TOWER = "Qwen2.5-VL"


def run(device=None):
    from npu_shim.selftest.sglang_tower import run_tower

    return run_tower(TOWER, PATCH_NAME, device)
