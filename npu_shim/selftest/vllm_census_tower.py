"""One whole forward of a census tower (:mod:`npu_shim.testing.census`) for the selftests of
the patches that serve those towers: the largest deviation from the same tower in float64
with the reference attention, the device->host reads of the forward, the time, the family."""
import time

# relative to max |float64 tower|, no floor; the towers' bfloat16 worst measured by the lane
# tests (vllm-0.18): 1.0e-2 (Qwen3-VL) .. 4.3e-2 (GLM-4.1V)
TOLERANCE = {"bfloat16": 1e-1}
# The cases of a tower whose grid vLLM's field config sends to the device in some releases
# (PaddleOCR-VL: 0.28.0 and before) and keeps on the host in others (``keep_on_cpu``).
GRID_ON_HOST = "grid on the host"
GRID_ON_DEVICE = "grid on the device"


def _layers(tower):
    """The tower's layers: ``blocks`` or ``layers`` of the tower, or of its encoder (RADIO's
    ``RadioModel`` keeps them at ``model.encoder.layers``, PaddleOCR-VL's ``SiglipVisionModel`` at
    ``vision_model.encoder.layers``)."""
    inner = [getattr(tower, name, None) for name in ("model", "vision_model")]
    for owner in [tower, getattr(tower, "encoder", None)] + [getattr(m, "encoder", None) for m in inner]:
        found = getattr(owner, "blocks", None) or getattr(owner, "layers", None)
        if found is not None:
            return found
    raise AttributeError("%s: no blocks or layers found" % type(tower).__name__)


def run_tower(name, patch_name, device=None, blocking_copies=False):
    """One forward of census tower ``name`` with vllm-ascend's ``AscendMMEncoderAttention``
    (A2) in ``torch.inference_mode()``; the family reported is ``patch_name``'s."""
    import torch

    from npu_shim import status
    from npu_shim.testing import census, count_host_syncs, towers

    device = device or "cpu"
    stack = census.setup()
    family = next(r for r in status() if r["name"] == patch_name)["family"]
    attention = stack.attention["A2"]
    tower = census.build(stack, name, attention, dtype=torch.bfloat16)
    grid = census.grids(0, name)
    x = census.pixel_values(name, tower, grid)
    tower.to(device)
    x_on_device = x.to(device)
    spec = census.CENSUS[name]
    arg = spec.grid_arg(grid)
    # Emulated (CPU), the grid is marked as a device tensor where vLLM's field config puts it on
    # the device; on a device the selftest leaves it on the host.
    placed = census.device_args(name, arg) if device == "cpu" else []
    started = time.perf_counter()
    with torch.inference_mode(), towers.registered(attention), \
            count_host_syncs(device_tensors=[x_on_device] + placed, device_modules=[tower]) as syncs:
        out = census.CENSUS[name].call(tower, x_on_device, arg)
    if device != "cpu":
        torch.npu.synchronize()
    seconds = time.perf_counter() - started
    tower.to("cpu")
    ref = census.reference_forward(stack, name, x, grid)
    blocks = _layers(tower)
    err = (out.double().cpu() - ref).abs().max().item() / ref.abs().max().item()
    from npu_shim.testing.errors import within

    within("selftest tower vs float64", err, TOLERANCE["bfloat16"], torch.bfloat16)
    result = {}
    if getattr(spec, "device_args", None) is not None:
        # a tower whose grid placement differs by release names where it was
        result["case"] = GRID_ON_DEVICE if placed else GRID_ON_HOST
    return dict(result, **{
        "max_rel_err": err,
        "tolerance": TOLERANCE["bfloat16"],
        "host_syncs": syncs.count + (syncs.h2d_count if blocking_copies else 0),
        "seconds": seconds,
        "detail": "vLLM %s vision tower (%d blocks), grid %s, bfloat16 on %s, family %s; error relative "
                  "to max |reference|; host syncs counted: %s" % (
                      name, len(blocks), grid, device, family,
                      "device->host reads and blocking host->device copies" if blocking_copies
                      else "device->host reads"),
    })


def run(device=None, tower=None, patch=None):
    """The selftest of a patch serving census tower ``tower`` (``Selftest(..., arguments=
    {"tower": ...})``): vLLM's own tower from a tiny random config with vllm-ascend's
    ``AscendMMEncoderAttention`` (patched by ``vllm.mm_encoder_attn``), one forward over the tower's
    first census grid (an image and a two-frame video; two images for a tower of images only)
    in ``torch.inference_mode()``: the largest deviation from the same tower in float64 with the
    reference attention, the device->host reads of the forward (0 where the patch leaves none),
    the time, and the family that applied."""
    from npu_shim.selftest import applied_target

    applied_target(patch)
    return run_tower(tower, patch, device)


def run_synchronisations(device=None, tower=None, patch=None):
    """As :func:`run`, for a patch that also removes blocking host->device copies: the forward's
    host synchronisations, device->host reads and blocking host->device copies together."""
    from npu_shim.selftest import applied_target

    applied_target(patch)
    return run_tower(tower, patch, device, blocking_copies=True)
