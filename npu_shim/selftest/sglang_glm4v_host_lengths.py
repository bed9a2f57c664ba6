"""Selftest of ``sglang.glm4v_host_lengths``: one whole GLM-4V vision-tower forward, no read back.

sglang's own GLM-4V tower (:mod:`npu_shim.selftest.sglang_tower`), one forward over three
images in bfloat16 with GLM-4V's embeddings on host lengths: the deviation from the same tower in float64 and the
device->host reads of the whole forward (expected: 0; the attention's are served by
``sglang.vision_host_lengths`` / ``sglang.vision_device_lengths``).
"""
PATCH_NAME = "sglang.glm4v_host_lengths"
TOWER = "GLM-4V"


def run(device=None):
    from npu_shim.selftest.sglang_tower import run_tower

    return run_tower(TOWER, PATCH_NAME, device)
