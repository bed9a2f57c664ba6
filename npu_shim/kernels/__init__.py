"""Production attention kernels for Ascend NPUs, written against torch_npu ops.

What the patches call:

* :func:`host_cu_seqlens` -- host copy of ``cu_seqlens``, at most one
  device->host transfer per tensor however many layers ask.
* :class:`VarlenAttention` -- block-diagonal ViT attention: one fused
  ``npu_fusion_attention`` (TND) call per layer, or ``_npu_flash_attention_unpad``
  on 310P; path, scale and padding decided once per layer object.
* :func:`paged_prefill_attention` -- causal paged prefill through
  ``npu_fused_infer_attention_score`` (TND, sparse_mode 3), as sglang's
  context-parallel path calls it.

These modules call whatever ``import torch_npu`` gives (the real package, or the
emulation when ``NPU_SHIM_EMULATE=1``); they never import npu_shim.emulation.
"""
from npu_shim.kernels.paged import compressed_causal_mask, paged_prefill_attention
from npu_shim.kernels.seqlens import host_cu_seqlens
from npu_shim.kernels.varlen import VarlenAttention, padded_head_dim

__all__ = ["VarlenAttention", "compressed_causal_mask", "host_cu_seqlens",
           "padded_head_dim", "paged_prefill_attention"]
