"""vllm.qwen2_5_vl_host_lengths — Qwen2.5-VL's own ``cu_seqlens`` copies keep their host arrays.

Why: in the releases below (0.18.0 .. 0.21.0), vLLM's Qwen2.5-VL vision tower builds
  ``cu_seqlens`` and ``cu_window_seqlens`` on the host and copies them to the
  device itself (``cu_seqlens.to(device=self.device, non_blocking=True)`` in
  ``Qwen2_5_VisionTransformer.forward``), not through
  ``MMEncoderAttention.maybe_recompute_cu_seqlens``, so
  ``vllm.mm_encoder_host_lengths`` never sees them and vllm-ascend's attention
  (with ``vllm.mm_encoder_attn``) reads both tensors back: 2 device->host
  reads per tower forward.
How: ``Qwen2_5_VisionTransformer.compute_attn_mask_seqlen`` is wrapped. The
  tower hands it each host tensor just before copying that tensor; upstream's
  method runs untouched and, for a 1-D host tensor, the tensor's next ``.to``
  (an entry in the tensor's own ``__dict__``, removed when called) runs
  ``torch.Tensor.to`` with upstream's arguments (``non_blocking=True`` kept)
  and keeps the host array on the tensor it returns, exactly as
  ``vllm.mm_encoder_host_lengths`` does after its copy
  (:func:`npu_shim.patches._shared.host_record.remember`);
  the attention's host read takes it once instead of reading back. A copy
  made without that call (0.21.0's encoder-graph path, which passes
  ``max_seqlen_override``) keeps upstream's read.
Window: read in the wheels: 0.18.0, 0.18.1, 0.19.0, 0.19.1, 0.20.0, 0.20.2
  copy in ``forward`` (``device=self.device``; 0.18.0 run in the lane
  vllm-0.18); 0.21.0 copies in ``prepare_encoder_metadata``
  (``device=device``; read only, no lane). 0.22.0 and later copy through
  ``maybe_recompute_cu_seqlens`` (served by ``vllm.mm_encoder_host_lengths``):
  outside the window, and the check says "not needed" there.
Upstream fix: 0.22.0's tower copies through ``maybe_recompute_cu_seqlens``.
Remove when: the pinned vLLM is 0.22.0 or later.
"""
from npu_shim.patch import Defect, Family, Patch, Selftest

PATCH_NAME = "vllm.qwen2_5_vl_host_lengths"
CLASS_NAME = "Qwen2_5_VisionTransformer"
FAMILIES = "npu_shim.patches.vllm.qwen2_5_vl_host_lengths.families:"

PATCH = Patch(
    name=PATCH_NAME,
    target="vllm.model_executor.models.qwen2_5_vl",
    subject=CLASS_NAME,
    replaces=(CLASS_NAME + ".compute_attn_mask_seqlen",),
    requires={"vllm": ""},
    outside_window={"vllm": "releases below the window were not read for this patch; from its end on, "
                            "cu_seqlens is copied through maybe_recompute_cu_seqlens (vllm.mm_encoder_host_lengths)"},
    needs_npu=True,
    families=(
        Family(FAMILIES + "FORWARD_COPY",
               fence=">=0.18.0,<0.21.0", keeps="cu_seqlens.to(device=self.device, non_blocking=True)"),
        Family(FAMILIES + "METADATA_COPY", fence=">=0.21.0,<0.22.0",
               keeps="cu_seqlens.to(device=device, non_blocking=True)"),
    ),
    summary="Qwen2.5-VL's own non-blocking cu_seqlens copies keep the host arrays on the device "
            "tensors; vllm.mm_encoder_attn takes them instead of reading back (0 reads)",
    # None: what this patch is for; a read per layer or per forward is the defect back.
    selftest=Selftest("npu_shim.selftest.vllm_qwen2_5_vl_host_lengths", host_syncs=0),
    defect=Defect("Qwen2.5-VL's tower reads back the cu_seqlens it copied from the host",
                  shows="reads", fixed_at="vllm"),
)
