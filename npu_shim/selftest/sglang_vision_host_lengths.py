"""Selftest of ``sglang.vision_host_lengths``: one tower forward's vision attention through the patched path.

Builds sglang's own ``VisionAscendAttention`` and one metadata object with the
patched ``prepare_vision_attention_metadata`` from a host ``cu_seqlens`` (what
the towers hand it on NPU), runs six layers over three images of 64, 100 and 36
tokens (and, on 0.5.20+, the same images padded to a common length), and
reports the largest deviation of the image rows from the float64 reference and
the device->host reads of the whole forward, metadata included (expected: 0).
Off an NPU, sglang's platform checks are answered as on an NPU and torch_npu is
the emulation (:mod:`npu_shim.testing.sglang_vision`).
"""
PATCH_NAME = "sglang.vision_host_lengths"
LENGTHS = (64, 100, 36)
LAYERS = 6


def run(device=None):
    import time

    import torch

    from npu_shim.patches._shared.structure import upstream_of
    from npu_shim.selftest import applied_target
    from npu_shim.testing import sglang_vision

    applied_target(PATCH_NAME)
    device = device or "cpu"
    dtype = torch.bfloat16
    err, syncs, layouts = 0.0, 0, []
    started = time.perf_counter()
    with sglang_vision.npu_platform() as vision:
        upstream = upstream_of(vision.VisionAscendAttention.forward)
        padded_family = "valid_indices" in upstream.__code__.co_varnames
        for padded in (False, True) if padded_family else (False,):
            case = sglang_vision.make_case(LENGTHS, padded=padded, dtype=dtype)
            if device != "cpu":
                case.q, case.k, case.v = (t.to(device) for t in (case.q, case.k, case.v))
            out, counter, _ = sglang_vision.run_layers(vision, case, LAYERS)
            err = max(err, sglang_vision.error(case, out.cpu()))
            syncs = max(syncs, counter.count)
            layouts.append("padded" if padded else "packed")
    return {
        "max_abs_err": err,
        "tolerance": sglang_vision.TOLERANCES[dtype],
        "host_syncs": syncs,
        "seconds": time.perf_counter() - started,
        "detail": "VisionAscendAttention x %d layers on one metadata object, images of %s tokens (%s), "
                  "4 heads over 2 KV heads x 64, %s on %s" % (
                      LAYERS, "/".join(map(str, LENGTHS)), ", ".join(layouts),
                      str(dtype).replace("torch.", ""), device),
    }
