"""npu-shim's pure-PyTorch emulation of torch_npu -- NOT the real package.

Resolves as ``torch_npu`` only after ``npu_shim.emulation.install()`` (or
``NPU_SHIM_EMULATE=1``) and only when no real torch_npu is importable. It runs
the documented semantics of the attention ops the shim and its seeds use on CPU
or CUDA tensors (see npu_shim/emulation/*.py for what each op implements), and
registers them as ``torch.ops.npu.*`` too.

Deliberately absent: ``torch.npu`` and an "npu" device. transformers decides
"NPU available" by ``hasattr(torch, "npu") and torch.npu.is_available()``; the
emulation must not make it move models to a device that does not exist.
``torch_npu.npu.is_available()`` is False for the same reason.
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
_npu_reshape_and_cache = _registry.PUBLIC["_npu_reshape_and_cache"]
npu_scatter_nd_update_ = _registry.PUBLIC["npu_scatter_nd_update_"]

from torch_npu import _C, npu  # noqa: E402  (submodules after the ops exist)

__all__ = [
    "npu_fusion_attention", "npu_prompt_flash_attention", "npu_fused_infer_attention_score",
    "npu_incre_flash_attention", "_npu_flash_attention_unpad", "_npu_reshape_and_cache",
    "npu_scatter_nd_update_", "npu", "_C",
]
