"""vllm.qwen2_vl_host_lengths — Qwen2-VL's own ``cu_seqlens`` copy keeps its host array.

Why: vLLM's Qwen2-VL vision tower (``Qwen2VisionTransformer``) builds
  ``cu_seqlens`` with NumPy on the host in ``prepare_encoder_metadata`` and
  copies it to the device itself (``cu_seqlens.to(device=device,
  non_blocking=True)``, or ``async_tensor_h2d(cu_seqlens, device)`` from
  0.30.0), not through ``MMEncoderAttention.maybe_recompute_cu_seqlens``, so
  ``vllm.mm_encoder_host_lengths`` never sees it and vllm-ascend's attention
  (with ``vllm.mm_encoder_attn``) reads the tensor back: 1 device->host read
  per tower forward (upstream: 1 per layer).
How: ``prepare_encoder_metadata`` and ``compute_attn_mask_seqlen`` are
  wrapped; both upstream bodies run untouched, the copy included (same op,
  same arguments). The tower hands ``compute_attn_mask_seqlen`` the host
  tensor just before it copies that tensor; the wrapper notes it for the
  running ``prepare_encoder_metadata`` call (thread-local), which, once
  upstream's body has returned, keeps that host tensor on the device tensor
  it returns under ``"cu_seqlens"`` (same length and dtype) with
  :func:`npu_shim.patches._shared.host_record.remember`.
  The attention's host read takes it once instead of reading back. A call
  that skips ``compute_attn_mask_seqlen`` (the encoder-graph path, which
  passes ``max_seqlen_override``) keeps upstream's read.
Window: read in the wheels: 0.22.1, 0.23.0, 0.24.0, 0.25.1, 0.26.0, 0.27.1,
  0.28.0, 0.29.0 (``.to(device=device, non_blocking=True)``; 0.26.0 run in
  the lane latest-vllm) and 0.30.0 (``async_tensor_h2d``; run in the lane
  vllm-0.30). Releases before 0.22.0 were not read for this patch.
Upstream fix: none (vLLM's open PR #55882 would keep ``cu_seqlens`` on the
  host for the Qwen towers under TORCH_SDPA only; vllm-ascend reads it back).
Remove when: the tower copies ``cu_seqlens`` through
  ``maybe_recompute_cu_seqlens`` (the check then says "not needed"), or
  vllm-ascend's attention takes host lengths from vLLM.
"""
from npu_shim.patch import Defect, Family, Patch, Selftest

PATCH_NAME = "vllm.qwen2_vl_host_lengths"
CLASS_NAME = "Qwen2VisionTransformer"
FAMILIES = "npu_shim.patches.vllm.qwen2_vl_host_lengths.families:"

PATCH = Patch(
    name=PATCH_NAME,
    target="vllm.model_executor.models.qwen2_vl",
    subject=CLASS_NAME,
    replaces=(CLASS_NAME + ".compute_attn_mask_seqlen", CLASS_NAME + ".prepare_encoder_metadata"),
    requires={"vllm": ""},
    outside_window={"vllm": "releases below the window were not read for this patch"},
    needs_npu=True,
    families=(
        Family(FAMILIES + "TENSOR_TO", fence=">=0.22.0,<0.30.0",
               keeps="cu_seqlens.to(device=device, non_blocking=True)"),
        Family(FAMILIES + "ASYNC_H2D", fence=">=0.30.0",
               keeps="async_tensor_h2d(cu_seqlens, device)"),
    ),
    summary="Qwen2-VL's own cu_seqlens copy keeps the host array on the device tensor; "
            "vllm.mm_encoder_attn takes it instead of reading back (0 reads)",
    # None: what this patch is for; a read per layer or per forward is the defect back.
    selftest=Selftest("npu_shim.selftest.vllm_census_tower:run", host_syncs=0, arguments={"tower": "Qwen2-VL"}),
    defect=Defect("Qwen2-VL's tower reads back the cu_seqlens it copied from the host", shows="reads"),
)
