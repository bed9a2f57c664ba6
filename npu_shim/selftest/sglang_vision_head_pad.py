"""Selftest of ``sglang.vision_head_pad``: a head-72 vision attention through the patched path.

Builds sglang's own ``VisionAscendAttention`` (through the forward the other vision patch
leaves, where it applies) and runs two layers over three images of 24, 40 and 8 tokens with
head dim 72 (Qwen3-VL's tower), host ``cu_seqlens`` as the towers hand them on NPU. Reports
the largest deviation from the float64 reference of the unpadded attention and the
device->host reads (expected: 0); the detail names the head dim FIA was handed. Off an NPU,
sglang's platform checks are answered as on an NPU and torch_npu is the emulation, whose FIA
refuses TND head dim 72 as CANN does (:mod:`npu_shim.testing.sglang_vision`).
"""
PATCH_NAME = "sglang.vision_head_pad"
LENGTHS = (24, 40, 8)
LAYERS = 2
HEAD_DIM = 72


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
        case = sglang_vision.make_case(LENGTHS, head_dim=HEAD_DIM, dtype=dtype)
        if device != "cpu":
            case.q, case.k, case.v = (t.to(device) for t in (case.q, case.k, case.v))
        out, counter, calls = sglang_vision.run_layers(vision, case, LAYERS)
        err = sglang_vision.error(case, out.cpu())
    handed = sorted({(c.kwargs["query"] if "query" in c.kwargs else c.args[0]).shape[-1] for c in calls})
    return {
        "max_abs_err": err,
        "tolerance": sglang_vision.TOLERANCES[dtype],
        "host_syncs": counter.count,
        "seconds": time.perf_counter() - started,
        "detail": "VisionAscendAttention x %d layers, images of %s tokens, 4 heads over 2 KV heads x %d, "
                  "FIA handed head dim %s, %s on %s" % (
                      LAYERS, "/".join(map(str, LENGTHS)), HEAD_DIM, "/".join(map(str, handed)),
                      str(dtype).replace("torch.", ""), device),
    }
