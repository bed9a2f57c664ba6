"""Selftest of ``vllm.ascend_qkv_v_head_size``: vllm-ascend's QKV projection with V narrower than K.

Builds vllm-ascend's ``AscendQKVParallelLinear`` (the patched class, the one ``register_ascend_customop``
hands vLLM for ``QKVParallelLinear``) with MiMo-V2-Flash's head dims (K 192, V 128; 4 heads over 2 KV
heads, hidden 64, float32) and, for comparison, a standard layer (K = V = 128); loads a q, a k and a v
tensor through the layer's own weight loader (vLLM's, by shard id, as a model's ``load_weights``
does), runs the layer's forward (vllm-ascend's gemm op) on ``device``, and splits the output as the
model does (``[q_size, k_size, v_size]``). Reference: each of q, k and v projected in float64 from the
loaded tensors. Error: max |out - ref| over both layers; tolerance 1e-5 * max |ref| (float32
rounding of a 64-term dot product). A layer sized with ``head_size`` for V (upstream's) fails the
split. Off an NPU (``device`` cpu), vllm-ascend's gemm op, which it registers for the NPU only, is
registered for CPU with upstream's own function (:mod:`npu_shim.testing.mimo`). Host syncs: none.
"""
import time

PATCH_NAME = "vllm.ascend_qkv_v_head_size"
HIDDEN, HEADS, KV_HEADS = 64, 4, 2
DIMS = ((192, 128), (128, 128))


def run(device=None):
    import torch
    from vllm.config import set_current_vllm_config

    from npu_shim import emulation
    from npu_shim.selftest import applied_target, on_upstream
    from npu_shim.testing import count_host_syncs, mimo
    from npu_shim.testing.isolation import import_vllm_ascend_module

    module = applied_target(PATCH_NAME)
    cls = module.AscendQKVParallelLinear
    if not on_upstream(PATCH_NAME) and getattr(cls.__init__, "__npu_shim_patch__", None) != PATCH_NAME:
        raise RuntimeError("%s reports applied but AscendQKVParallelLinear.__init__ is not the shim's" % PATCH_NAME)
    device = device or "cpu"
    config = mimo.setup(emulate=emulation.is_emulated())
    if device == "cpu":
        mimo._gemm_on_cpu()
    generator = torch.Generator().manual_seed(3)
    started = time.perf_counter()
    errors, scales, reads = [], [], 0
    with set_current_vllm_config(config):
        import_vllm_ascend_module("vllm_ascend.ascend_config").init_ascend_config(config)
        for head, v_head in DIMS:
            layer = cls(HIDDEN, head, HEADS, KV_HEADS, bias=False, params_dtype=torch.float32,
                        prefix="npu_shim_selftest.qkv_proj", v_head_size=v_head)
            sizes = [HEADS * head, KV_HEADS * head, KV_HEADS * v_head]
            if layer.output_sizes != sizes:
                raise RuntimeError("AscendQKVParallelLinear(head_size %d, v_head_size %d) sized %s, not %s"
                                   % (head, v_head, layer.output_sizes, sizes))
            shards = {name: torch.randn(size, HIDDEN, generator=generator) * 0.2 for name, size in zip("qkv", sizes)}
            for name, weight in shards.items():
                layer.weight.weight_loader(layer.weight, weight, name)
            layer.to(device)
            x = torch.randn(5, HIDDEN, generator=generator)
            on_device = x.to(device)
            with count_host_syncs(cpu_is_device=True) as syncs, torch.no_grad():
                out, _ = layer(on_device)
            reads += syncs.count
            parts = out.cpu().double().split(sizes, dim=-1)
            for part, weight in zip(parts, shards.values()):
                reference = x.double() @ weight.double().T
                errors.append((part - reference).abs().max().item())
                scales.append(reference.abs().max().item())
    return {"max_abs_err": max(errors), "tolerance": 1e-5 * max(scales), "host_syncs": reads,
            "seconds": time.perf_counter() - started,
            "detail": "AscendQKVParallelLinear (K, V) head dims %s: q, k, v loaded by shard id, the forward's "
                      "output split as the model splits it, against float64 on %s"
                      % (", ".join("%d/%d" % d for d in DIMS), device)}
