"""Selftest of ``sglang.npu_mrope_positions``: M-RoPE with multimodal (3, T) positions through the patched forward_npu.

Builds sglang's own ``MRotaryEmbedding`` as Qwen2-VL builds it (``get_rope`` with ``mrope_section``
8/12/12, head 64; :mod:`npu_shim.testing.sglang_mrope`), runs its ``forward_npu`` on the positions of
a prompt with a 2 x 3 image between text tokens, and reports the largest deviation of query and key
from the float64 M-RoPE of the definition (:func:`npu_shim.testing.reference.mrope_f64`) and the
device->host reads over the call (expected 0). On upstream's code the emulated ``npu_mrope`` refuses
the call (``mrope_section [0, 0, 0]`` with 2-D positions); the hardware returns wrong rotary instead.
"""
PATCH_NAME = "sglang.npu_mrope_positions"
TOLERANCE = 1e-5


def run(device=None):
    import time

    import torch

    from npu_shim.selftest import applied_target, on_upstream
    from npu_shim.testing import count_host_syncs, sglang_mrope
    from npu_shim.testing.reference import mrope_f64

    module = applied_target(PATCH_NAME)
    device = device or "cpu"
    started = time.perf_counter()
    with sglang_mrope.npu_rotary() as make:
        rope = make(torch.float32).to(device)
        forward = vars(module.MRotaryEmbedding)["forward_npu"]
        if not on_upstream(PATCH_NAME) and getattr(forward, "__npu_shim_patch__", None) != PATCH_NAME:
            raise RuntimeError("%s reports applied but MRotaryEmbedding.forward_npu is not the shim's" % PATCH_NAME)
        positions, query, key = (t.to(device) for t in sglang_mrope.case())
        with count_host_syncs(cpu_is_device=device == "cpu") as counter:
            q_out, k_out = rope.forward_npu(positions, query, key)
    section = sglang_mrope.SECTION
    err = max(float((out.cpu().double() - mrope_f64(positions.cpu(), x.cpu(), sglang_mrope.HEAD,
                                                     sglang_mrope.ROTARY_DIM, sglang_mrope.BASE, section)).abs().max())
              for out, x in ((q_out, query), (k_out, key)))
    return {
        "max_abs_err": err,
        "tolerance": TOLERANCE,
        "host_syncs": counter.count,
        "seconds": time.perf_counter() - started,
        "detail": "MRotaryEmbedding.forward_npu, %d tokens (2 x 3 image), mrope_section %s, head %d, %d/%d heads, "
                  "float32 on %s" % (positions.shape[1], "/".join(map(str, section)), sglang_mrope.HEAD,
                                     sglang_mrope.HEADS, sglang_mrope.KV_HEADS, device),
    }
