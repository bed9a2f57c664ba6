"""npu-shim's pure-PyTorch emulation of torch_npu -- NOT the real package.

Resolves as ``torch_npu`` only after ``npu_shim.emulation.install()`` (or
``NPU_SHIM_EMULATE=1``) and only when no real torch_npu is importable. It runs
the documented semantics of the attention ops the shim and its seeds use on CPU
or CUDA tensors (see npu_shim/emulation/*.py for what each op implements), and
registers them as ``torch.ops.npu.*`` too.

Absent by default: ``torch.npu`` and an "npu" device. transformers decides
"NPU available" by ``hasattr(torch, "npu") and torch.npu.is_available()``; the
emulation must not make it move models to a device that does not exist.
``torch_npu.npu.is_available()`` is False for the same reason. sglang (0.5.23's
``is_npu()``) even raises when ``torch.npu`` exists but is not available. Code that
needs ``torch.npu`` to exist, as vllm-ascend does (the real torch_npu registers it),
calls ``npu_shim.emulation.register_device_module()``. With ``NPU_SHIM_EMULATE_DEVICE=1``
importing this package makes ``npu`` a device (``npu_shim.emulation.device``), and
``torch.npu`` a one-device machine with ``is_available()`` True.
"""
import torch  # noqa: F401  (the ops need it; importing torch_npu imports torch, as the real one does)

from npu_shim.emulation import _registry

__version__ = "0.0.0+npu_shim.emulated"
__npu_shim_emulated__ = True

_registry.register_ops()

npu_fusion_attention = _registry.PUBLIC["npu_fusion_attention"]
npu_prompt_flash_attention = _registry.PUBLIC["npu_prompt_flash_attention"]
npu_fused_infer_attention_score = _registry.PUBLIC["npu_fused_infer_attention_score"]
npu_incre_flash_attention = _registry.PUBLIC["npu_incre_flash_attention"]
_npu_flash_attention_unpad = _registry.PUBLIC["_npu_flash_attention_unpad"]
_npu_flash_attention = _registry.PUBLIC["_npu_flash_attention"]  # vllm-ascend's 310P decoder prefill
_npu_reshape_and_cache = _registry.PUBLIC["_npu_reshape_and_cache"]
npu_scatter_nd_update_ = _registry.PUBLIC["npu_scatter_nd_update_"]
npu_scatter_pa_kv_cache = _registry.PUBLIC["npu_scatter_pa_kv_cache"]
_npu_paged_attention = _registry.PUBLIC["_npu_paged_attention"]
_npu_flash_attention_qlens = _registry.PUBLIC["_npu_flash_attention_qlens"]
npu_fused_infer_attention_score_v2 = _registry.PUBLIC["npu_fused_infer_attention_score_v2"]
# The engine's layer ops (npu_shim/emulation: norms, activation, rotary, moe).
npu_rms_norm = _registry.PUBLIC["npu_rms_norm"]
npu_add_rms_norm = _registry.PUBLIC["npu_add_rms_norm"]
npu_swiglu = _registry.PUBLIC["npu_swiglu"]
npu_rotary_mul = _registry.PUBLIC["npu_rotary_mul"]
npu_mrope = _registry.PUBLIC["npu_mrope"]
_npu_rotary_embedding = _registry.PUBLIC["_npu_rotary_embedding"]
npu_apply_rotary_pos_emb = _registry.PUBLIC["npu_apply_rotary_pos_emb"]  # vllm-ascend's 310P M-RoPE
npu_moe_gating_top_k = _registry.PUBLIC["npu_moe_gating_top_k"]
npu_moe_init_routing_v2 = _registry.PUBLIC["npu_moe_init_routing_v2"]
npu_grouped_matmul = _registry.PUBLIC["npu_grouped_matmul"]
npu_moe_token_unpermute = _registry.PUBLIC["npu_moe_token_unpermute"]
npu_moe_finalize_routing = _registry.PUBLIC["npu_moe_finalize_routing"]  # sglang's NPU MoE combine
npu_format_cast = _registry.PUBLIC["npu_format_cast"]  # sglang's MoE weights after loading
_npu_matmul_add_fp32 = _registry.PUBLIC["_npu_matmul_add_fp32"]  # ATB, vllm-ascend's worker warm-up
# torch_npu's format factories and query (plain functions: a factory has no tensor to dispatch on);
# vllm-ascend's 310P KV cache is made with empty_with_format(..., acl_format=29)
from npu_shim.emulation.formats import empty_with_format, get_npu_format  # noqa: E402

from torch_npu import _C, multiprocessing, npu, profiler  # noqa: E402  (submodules after the ops exist)


def _apply_patches(patches):
    """torch_npu's patch hook: each ``[dotted name under torch, value]`` is set on ``torch``.

    As the real one, ``["profiler.profile", torch_npu.profiler.profile]`` makes
    ``torch.profiler.profile`` torch_npu's (sglang.srt.utils.profile_utils calls it at import).
    A name that does not lead to an attribute of ``torch`` is refused by name.
    """
    for entry in patches:
        if len(entry) != 2 or not isinstance(entry[0], str):
            raise TypeError(f"torch_npu._apply_patches: each patch is [dotted name, value], got {entry!r}")
        name, value = entry
        *path, last = name.split(".")
        target = torch
        for part in path:
            if not hasattr(target, part):
                raise AttributeError(f"torch_npu._apply_patches: torch has no {name!r} to patch ({part!r} missing)")
            target = getattr(target, part)
        setattr(target, last, value)


# Import placeholders (npu_shim.emulation.placeholders): torch_npu's own dtype ids, which
# vllm-ascend (0.21.0rc1 on) reads at import time; using one anywhere fails.
from npu_shim.emulation.placeholders import DtypePlaceholder as _DtypePlaceholder  # noqa: E402

float4_e2m1fn_x2 = _DtypePlaceholder("torch_npu.float4_e2m1fn_x2")
float8_e8m0fnu = _DtypePlaceholder("torch_npu.float8_e8m0fnu")
hifloat8 = _DtypePlaceholder("torch_npu.hifloat8")
# imported by name at the top of sglang 0.5.11's npu_communicator (its quantized all-reduce, never
# run by a one-rank engine); calling it refuses, naming it
from npu_shim.emulation.placeholders import placeholder_function as _placeholder_function  # noqa: E402

npu_dynamic_quant = _placeholder_function("torch_npu.npu_dynamic_quant")

# NPU_SHIM_EMULATE_DEVICE=1: ``npu`` becomes a device of this process (npu_shim.emulation.device),
# as importing the real torch_npu makes it one.
from npu_shim._config import env_flag as _env_flag  # noqa: E402
import os as _os  # noqa: E402

if _env_flag("NPU_SHIM_EMULATE_DEVICE", False, _os.environ):
    from npu_shim.emulation import device as _device

    _device.activate()

__all__ = [
    "npu_fusion_attention", "npu_prompt_flash_attention", "npu_fused_infer_attention_score",
    "npu_incre_flash_attention", "_npu_flash_attention_unpad", "_npu_reshape_and_cache",
    "npu_scatter_nd_update_", "npu_scatter_pa_kv_cache", "_npu_paged_attention",
    "npu_fused_infer_attention_score_v2", "npu", "_C",
    "npu_rms_norm",
    "npu_add_rms_norm",
    "npu_swiglu",
    "npu_rotary_mul",
    "npu_mrope",
    "_npu_rotary_embedding",
    "npu_apply_rotary_pos_emb",
    "npu_moe_gating_top_k",
    "npu_moe_init_routing_v2",
    "npu_grouped_matmul",
    "npu_moe_token_unpermute",
    "npu_moe_finalize_routing",
    "npu_format_cast",
    "_npu_matmul_add_fp32",
    "_npu_flash_attention",
    "empty_with_format",
    "get_npu_format",
]
