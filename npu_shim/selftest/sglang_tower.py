"""What the sglang tower selftests share: one whole forward of sglang's own vision tower.

Builds the tower of the installed sglang release from a tiny random config
(:mod:`npu_shim.testing.sglang_towers`: the real class, ``mm_attention_backend="ascend_attn"``),
runs one forward over three images in bfloat16 and reports the deviation from the same tower
in float64 (relative to max |reference|), the device->host reads of the whole forward and the
family that applied. Off an NPU, sglang's platform checks are answered as on an NPU and
torch_npu is the emulation.
"""


def run_tower(name, patch_name, device=None, blocking_copies=False):
    import time

    import torch

    from npu_shim import status
    from npu_shim.selftest import applied_target
    from npu_shim.testing import sglang_towers

    sglang_towers.setup()
    applied_target(patch_name)
    device = device or "cpu"
    family = next(r for r in status() if r["name"] == patch_name)["family"]
    dtype = torch.bfloat16
    tower = sglang_towers.build(name, dtype)
    grid = sglang_towers.TOWERS[name].grids[0]
    x = sglang_towers.pixel_values(tower, grid)
    ref = sglang_towers.reference_forward(name, x, grid)
    if device != "cpu":
        tower.to(device)
        x = x.to(device)
    started = time.perf_counter()
    out, syncs, _ = sglang_towers.forward(name, tower, x, grid)
    if device != "cpu":
        torch.npu.synchronize()
    seconds = time.perf_counter() - started
    counted = "device->host reads and blocking host->device copies" if blocking_copies else "device->host reads"
    return {
        "max_rel_err": sglang_towers.relative_error(sglang_towers.tower_output(out).cpu(), ref),
        "tolerance": sglang_towers.TOLERANCES["bfloat16"],
        "host_syncs": syncs.count + (syncs.h2d_count if blocking_copies else 0),
        "seconds": seconds,
        "detail": "sglang %s vision tower (%d blocks), grid %s, bfloat16 on %s, family %s; error relative "
                  "to max |reference|; host syncs counted: %s" % (name, len(tower.blocks), grid, device, family,
                                                                  counted),
    }


def run(device=None, tower=None, patch=None):
    """The selftest of a patch serving sglang tower ``tower`` (``Selftest(..., arguments=
    {"tower": ...})``): one forward over three images in bfloat16, its deviation from the same
    tower in float64 and the device->host reads of the whole forward (expected: 0; the
    attention's are served by ``sglang.vision_host_lengths`` / ``sglang.vision_device_lengths``)."""
    return run_tower(tower, patch, device)


def run_synchronisations(device=None, tower=None, patch=None):
    """As :func:`run`, for a patch that removes a blocking host->device copy: the whole forward's
    host synchronisations, device->host reads and blocking host->device copies together (expected:
    0, with every sglang tower patch applied)."""
    return run_tower(tower, patch, device, blocking_copies=True)
