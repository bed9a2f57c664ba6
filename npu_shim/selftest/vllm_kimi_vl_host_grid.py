"""Selftest of ``vllm.kimi_vl_host_grid``: one whole MoonViT forward, no read back.

Builds vLLM's own MoonViT (Kimi-VL's vision tower) from a tiny random config
(:mod:`npu_shim.testing.towers`) with vllm-ascend's ``AscendMMEncoderAttention``
(patched by ``vllm.mm_encoder_attn``), batches three images the way vLLM
hands them to the model (Kimi-VL's field config, ``group_and_batch_mm_kwargs``
to the device: the grid stays on the host), runs one forward in
``torch.inference_mode()``, and reports the largest deviation from the same
tower in float64 with the reference attention, the device->host reads of
batching and forward (0), the time, and the family that applied.
"""
import time

PATCH_NAME = "vllm.kimi_vl_host_grid"
# relative to max |float64 tower|, no floor; the towers' bfloat16 worst measured by the lane
# tests (vllm-0.18): 1.0e-2 (Qwen3-VL) .. 4.3e-2 (GLM-4.1V)
TOLERANCE = {"bfloat16": 1e-1}


def run(device=None):
    import torch

    from npu_shim import status
    from npu_shim.selftest import applied_target
    from npu_shim.testing import count_host_syncs, towers
    from npu_shim.testing.syncs import DEVICE

    device = device or "cpu"
    applied_target(PATCH_NAME)
    stack = towers.setup(emulate=False)
    family = next(r for r in status() if r["name"] == PATCH_NAME)["family"]
    tower = towers.build_moonvit(stack, stack.attention["A2"], dtype=torch.bfloat16)
    if device != "cpu":
        tower.encoder.rope_2d.device = device
    grid = towers.moonvit_grid(0)
    x = towers.moonvit_pixel_values(tower, grid)
    tower.to(device)
    started = time.perf_counter()
    with torch.inference_mode(), towers.registered(stack.attention["A2"]), \
            count_host_syncs(device_modules=[tower]) as syncs:
        pixels, grid_hws = towers.kimi_vl_batch(stack, x, grid, device=DEVICE if device == "cpu" else device)
        out = torch.cat(tower(pixels, grid_hws))
    if device != "cpu":
        torch.npu.synchronize()
    seconds = time.perf_counter() - started
    tower.to("cpu")
    ref = towers.moonvit_reference_forward(stack, x, grid)
    err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    from npu_shim.testing.errors import within

    within("selftest tower vs float64", err, TOLERANCE["bfloat16"], torch.bfloat16)
    return {
        "max_rel_err": err,
        "tolerance": TOLERANCE["bfloat16"],
        "host_syncs": syncs.count,
        "seconds": seconds,
        "detail": "vLLM MoonViT (%d blocks), grid %s, bfloat16 on %s, family %s; error relative to "
                  "max |reference|" % (len(tower.encoder.blocks), grid, device, family),
    }
