"""Selftest of ``vllm.mm_encoder_attn``: a patched vision-tower attention stack.

Builds a few real ``AscendMMEncoderAttention`` layers (vllm-ascend's own class,
already patched by the shim with the family that applies to the installed
release) shaped like Qwen2.5-VL's ViT (16 heads of 80, so the head dim is
padded to 128), runs one encoder forward over three images of different sizes
packed into one sequence, and reports the largest deviation from the float64
reference, the host syncs of that forward (one: the single copy of
``cu_seqlens``, whatever the depth), the time it took, and the family and NPU
op that ran. The 310P patch's selftest runs the same stack on its class
(:func:`run_encoder_stack`).
"""
import time

PATCH_NAME = "vllm.mm_encoder_attn"
CLASS_NAME = "AscendMMEncoderAttention"
LAYERS = 4
HEADS, HEAD_DIM = 16, 80
IMAGE_TOKENS = (64, 16, 100)
SCALE = 0.1  # a model-given scale: upstream 0.13-0.17 would ignore it
TOLERANCE = {"float32": 1e-4, "float16": 5e-3}


def _patched_class(patch_name, class_name):
    from npu_shim import status
    from npu_shim.selftest import applied_target, on_upstream

    cls = getattr(applied_target(patch_name), class_name)
    if not on_upstream(patch_name) and not hasattr(cls.forward_oot, "__wrapped_upstream__"):
        raise RuntimeError("%s reports applied but %s.forward_oot is not the shim's"
                           % (patch_name, cls.__qualname__))
    family = next(r for r in status() if r["name"] == patch_name)["family"]
    return cls, family


def run(device=None):
    return run_encoder_stack(PATCH_NAME, CLASS_NAME, device)


def run_encoder_stack(patch_name, class_name, device=None):
    """One packed encoder forward through ``LAYERS`` patched ``class_name`` layers."""
    import torch
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    from npu_shim.testing import attention_f64, count_host_syncs, dense_segments, record_npu_calls

    device = device or "cpu"
    cls, family = _patched_class(patch_name, class_name)
    dtype = torch.float16  # taken by the real op on every device class that has it (emulation.dtypes)
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device=device))):
        layers = [cls(num_heads=HEADS, head_size=HEAD_DIM, scale=SCALE,
                      prefix="visual.blocks.%d.attn" % i) for i in range(LAYERS)]

    total = sum(IMAGE_TOKENS)
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, total, HEADS, HEAD_DIM, generator=gen).to(device, dtype)
               for _ in range(3))
    cum = dense_segments(IMAGE_TOKENS)
    cu_seqlens = torch.tensor(cum, dtype=torch.int32).to(device)

    started = time.perf_counter()
    # On a CPU-only machine cu_seqlens stands in for a device tensor.
    with count_host_syncs(device_tensors=[cu_seqlens]) as syncs, record_npu_calls() as calls:
        outs = [layer.forward_oot(q, k, v, cu_seqlens) for layer in layers]
    if device != "cpu":
        torch.npu.synchronize()
    seconds = time.perf_counter() - started

    flat = [x.reshape(total, HEADS, HEAD_DIM) for x in (q, k, v)]
    ref = attention_f64(*flat, cum, scale=SCALE).reshape(1, total, HEADS, HEAD_DIM)
    err = max((out.double().cpu().reshape(ref.shape) - ref).abs().max().item() for out in outs)
    return {
        "max_abs_err": err,
        "tolerance": TOLERANCE[str(dtype).replace("torch.", "")],
        "host_syncs": syncs.count,
        "seconds": seconds,
        "detail": "%d %s layers (family %s), %d heads x %d, scale %g, "
                  "images of %s tokens packed, %s on %s, NPU op %s"
                  % (LAYERS, class_name, family, HEADS, HEAD_DIM, SCALE, "/".join(map(str, IMAGE_TOKENS)),
                     str(dtype).replace("torch.", ""), device,
                     "/".join(sorted({c.name for c in calls})) or "none"),
    }
