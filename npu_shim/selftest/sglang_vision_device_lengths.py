"""Selftest of ``sglang.vision_device_lengths``: one tower forward's vision attention on device lengths.

Builds sglang's own ``VisionAscendAttention`` (0.5.11 - 0.5.15) and runs six
layers over three images of 64, 100 and 36 tokens with ``cu_seqlens`` on the
device, the way Qwen3-VL's tower hands it over (one tensor shared by every
layer); reports the largest deviation of the output from the float64 reference
and the device->host reads of the whole forward (expected: 1, the first layer's).
Off an NPU, sglang's platform checks are answered as on an NPU and torch_npu is
the emulation (:mod:`npu_shim.testing.sglang_vision`).
"""
PATCH_NAME = "sglang.vision_device_lengths"
LENGTHS = (64, 100, 36)
LAYERS = 6


def run(device=None):
    import time

    import torch

    from npu_shim.selftest import applied_target
    from npu_shim.testing import sglang_vision

    applied_target(PATCH_NAME)
    device = device or "cpu"
    dtype = torch.bfloat16
    started = time.perf_counter()
    with sglang_vision.npu_platform() as vision:
        case = sglang_vision.make_case(LENGTHS, dtype=dtype)
        if device != "cpu":
            case.q, case.k, case.v, case.cu_seqlens = (t.to(device) for t in (case.q, case.k, case.v,
                                                                              case.cu_seqlens))
        out, counter, _ = sglang_vision.run_layers(vision, case, LAYERS, device_lengths=True)
        err = sglang_vision.error(case, out.cpu())
    return {
        "max_abs_err": err,
        "tolerance": sglang_vision.TOLERANCES[dtype],
        "host_syncs": counter.count,
        "seconds": time.perf_counter() - started,
        "detail": "VisionAscendAttention x %d layers on one device cu_seqlens, images of %s tokens, "
                  "4 heads over 2 KV heads x 64, %s on %s" % (
                      LAYERS, "/".join(map(str, LENGTHS)), str(dtype).replace("torch.", ""), device),
    }
