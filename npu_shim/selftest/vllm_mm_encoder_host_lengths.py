"""Selftest of ``vllm.mm_encoder_host_lengths``: one whole vision-tower forward, no read back.

Builds vLLM's own Qwen3-VL vision tower from a tiny random config
(:mod:`npu_shim.testing.towers`) with vllm-ascend's ``AscendMMEncoderAttention``
(patched by ``vllm.mm_encoder_attn``), runs one forward over an image and a
two-frame video in ``torch.inference_mode()``, and reports the largest
deviation from the same tower in float64 with the reference attention, the
device->host reads of the forward (0: the attention takes the host array vLLM
copied ``cu_seqlens`` from), the time, and the family that applied.
"""
import time

PATCH_NAME = "vllm.mm_encoder_host_lengths"
TOWER = "Qwen3-VL"
# relative to max |float64 tower|, no floor; the towers' bfloat16 worst measured by the lane
# tests (vllm-0.18): 1.0e-2 (Qwen3-VL) .. 4.3e-2 (GLM-4.1V)
TOLERANCE = {"bfloat16": 1e-1}


def run(device=None):
    from npu_shim.selftest import applied_target

    applied_target(PATCH_NAME)
    return run_tower(TOWER, PATCH_NAME, device)


def run_tower(name, patch_name, device=None, blocking_copies=False):
    """One forward of tower ``name`` (``towers.TOWERS``), as :func:`run` describes; the family
    reported is ``patch_name``'s. ``blocking_copies``: the host synchronisations counted are the
    device->host reads and the blocking host->device copies together."""
    import torch

    from npu_shim import status
    from npu_shim.testing import count_host_syncs, towers

    device = device or "cpu"
    stack = towers.setup(emulate=False)
    family = next(r for r in status() if r["name"] == patch_name)["family"]
    tower = towers.build_tower(stack, name, stack.attention["A2"], dtype=torch.bfloat16)
    grid = towers.grids(0)
    x = towers.pixel_values(tower, grid)
    tower.to(device)
    x_on_device = x.to(device)
    started = time.perf_counter()
    with torch.inference_mode(), towers.registered(stack.attention["A2"]), \
            count_host_syncs(device_tensors=[x_on_device], device_modules=[tower]) as syncs:
        out = tower(x_on_device, grid_thw=grid)
    if device != "cpu":
        torch.npu.synchronize()
    seconds = time.perf_counter() - started
    tower.to("cpu")
    ref = towers.reference_forward(stack, name, x, grid)
    err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    from npu_shim.testing.errors import within

    within("selftest tower vs float64", err, TOLERANCE["bfloat16"], torch.bfloat16)
    counted = "device->host reads and blocking host->device copies" if blocking_copies else "device->host reads"
    return {
        "max_rel_err": err,
        "tolerance": TOLERANCE["bfloat16"],
        "host_syncs": syncs.count + (syncs.h2d_count if blocking_copies else 0),
        "seconds": seconds,
        "detail": "vLLM %s vision tower (%d blocks), grid %s, bfloat16 on %s, family %s; error relative "
                  "to max |reference|; host syncs counted: %s" % (name, len(tower.blocks), grid, device, family,
                                                                  counted),
    }


def run_synchronisations(device=None, tower=None, patch=None):
    """The selftest of a patch that removes a blocking host->device copy from tower ``tower``
    (``Selftest(..., arguments={"tower": ...})``): one forward as :func:`run`'s, its host
    synchronisations being the device->host reads and the blocking host->device copies together
    (0 where every patch serving the tower applies)."""
    from npu_shim.selftest import applied_target

    applied_target(patch)
    return run_tower(tower, patch, device, blocking_copies=True)
