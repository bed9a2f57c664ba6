"""Selftest of ``vllm.cast_overflow_on_device``: vLLM's own ``cast_overflow_tensors``, patched, in float16.

Two calls on the device, in float16 (the dtype 310P towers run): hidden states where
nothing overflowed (one value within ``offset`` of float16's largest finite value, which
must come back unchanged) and the same with one ``+inf`` and one ``-inf`` (every value
clamped to +-(65504 - 1000)). Each is compared with a float64 reference written from the
definition (clamp to the dtype's largest finite value less ``offset`` when any value is
infinite or NaN, else unchanged; the bound rounded to float16): a copy or a clamp of float16
values, so the tolerance is 0.
The calls must read nothing back.
"""
import time

PATCH_NAME = "vllm.cast_overflow_on_device"
ROWS, HIDDEN, OFFSET = 16, 32, 1000
TOLERANCE = 0.0


def reference(tensors, offset=OFFSET):
    """float64, from the definition; a clamped value is the bound rounded to the tensor's dtype
    (the output is in that dtype: 65504 - 1000 is 64512 in float16)."""
    import torch

    values = tensors.double()
    if not torch.isfinite(values).all():
        limit = float(torch.finfo(tensors.dtype).max) - offset
        values = values.clamp(-limit, limit).to(tensors.dtype).double()
    return values


def cases(device):
    import torch

    gen = torch.Generator().manual_seed(25)
    finite = (torch.randn(ROWS, HIDDEN, generator=gen) * 100).to(torch.float16)
    finite[3, 5] = 65000.0                       # within offset of the largest finite value
    overflowed = finite.clone()
    overflowed[0, 0], overflowed[7, 9] = float("inf"), float("-inf")
    return finite.to(device), overflowed.to(device)


def run(device=None):
    import npu_shim
    from npu_shim.patches.vllm.cast_overflow_on_device import FUNCTION
    from npu_shim.selftest import applied_target, on_upstream
    from npu_shim.testing import count_host_syncs

    device = device or "cpu"
    module = applied_target(PATCH_NAME)
    function = getattr(module, FUNCTION)
    family = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)["family"]
    inputs = cases(device)
    before = dict(npu_shim.stats()[PATCH_NAME])
    started = time.perf_counter()
    with count_host_syncs(device_tensors=list(inputs) if device == "cpu" else [], follow_placement=True) as syncs:
        outputs = [function(tensors, OFFSET) for tensors in inputs]
        if device != "cpu":
            import torch

            torch.npu.synchronize()
    seconds = time.perf_counter() - started
    after = npu_shim.stats()[PATCH_NAME]
    if not on_upstream(PATCH_NAME) and after["calls"] != before.get("calls", 0) + len(inputs):
        raise RuntimeError("the replacement did not take its own path (stats %s -> %s)" % (before, after))
    err = max((out.double().cpu() - reference(tensors.cpu())).abs().max().item()
              for tensors, out in zip(inputs, outputs))
    return {
        "max_abs_err": err,
        "tolerance": TOLERANCE,
        "host_syncs": syncs.count,
        "seconds": seconds,
        "detail": "vLLM %s on %dx%d float16 on %s, without and with +-inf; family %s"
                  % (FUNCTION, ROWS, HIDDEN, device, family),
    }
