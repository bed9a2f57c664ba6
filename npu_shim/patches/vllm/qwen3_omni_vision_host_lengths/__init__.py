"""vllm.qwen3_omni_vision_host_lengths — Qwen3-Omni's vision tower: its own ``cu_seqlens`` copy gets the host lengths.

Why: vLLM's Qwen3-Omni vision tower (``Qwen3Omni_VisionTransformer``) builds
  ``cu_seqlens`` on the host from the host ``grid_thw`` (``repeat_interleave``,
  ``cumsum``, ``F.pad``) and copies it to the device itself in ``forward``
  (``cu_seqlens.to(self.device, non_blocking=True)``, or
  ``async_tensor_h2d(cu_seqlens, self.device)`` from 0.30.0), not through
  ``MMEncoderAttention.maybe_recompute_cu_seqlens``, so
  ``vllm.mm_encoder_host_lengths`` never sees it and vllm-ascend's attention
  (with ``vllm.mm_encoder_attn``) reads the tensor back: 1 device->host read
  per tower forward (upstream: 1 per layer). The host ``cu_seqlens_np`` the
  tower computes next (for ``maybe_compute_seq_lens``) is not what
  vllm-ascend's class reads.
How: ``forward`` and ``compute_attn_mask_seqlen`` are wrapped; both upstream
  bodies run untouched, the copy included (same op, same arguments). The
  tower hands ``compute_attn_mask_seqlen`` the device tensor its copy just
  returned. When the running ``forward`` (noted thread-locally) was given a
  host ``grid_thw`` tensor (an integer ``[t, h, w]`` tensor on ``cpu`` with no
  index: ``host_data.host_grid_tensor``, a device stand-in's ``cpu:0`` is not
  the host), the wrapper builds the host lengths from that grid as the tower
  builds ``cu_seqlens`` (``host_data.cu_seqlens_of``: ``repeat_interleave(h * w,
  t).cumsum(int32)`` behind a 0; the values of its ``cu_seqlens_np``) and, where length and
  dtype (int32) match the device tensor, keeps them on it with
  :func:`npu_shim.patches._shared.host_record.remember`; the
  attention's host read takes them once instead of reading back. A
  ``grid_thw`` already on the device keeps upstream's read (the tower reads
  the grid back itself there).
Window: read in the wheels: 0.24.0, 0.25.1, 0.26.0, 0.27.1, 0.28.0, 0.29.0
  (``.to(self.device, non_blocking=True)``; 0.26.0 run in the lane
  latest-vllm) and 0.30.0 (``async_tensor_h2d``; run in the lane vllm-0.30).
  0.22.1 and 0.23.0 do not copy ``cu_seqlens`` (it stays where ``grid_thw``
  is): outside the window.
Upstream fix: none (vllm-ascend reads ``cu_seqlens`` back in every release read).
Remove when: the tower copies ``cu_seqlens`` through
  ``maybe_recompute_cu_seqlens``, or vllm-ascend's attention takes host
  lengths from vLLM (``sequence_lengths`` / ``cu_seqlens_np``).
"""
from npu_shim.patch import Defect, Family, Patch, Selftest

PATCH_NAME = "vllm.qwen3_omni_vision_host_lengths"
CLASS_NAME = "Qwen3Omni_VisionTransformer"
FAMILIES = "npu_shim.patches.vllm.qwen3_omni_vision_host_lengths.families:"

PATCH = Patch(
    name=PATCH_NAME,
    target="vllm.model_executor.models.qwen3_omni_moe_thinker",
    subject=CLASS_NAME,
    replaces=(CLASS_NAME + ".compute_attn_mask_seqlen", CLASS_NAME + ".forward"),
    requires={"vllm": ""},
    outside_window={"vllm": "the two releases read below the window do not copy cu_seqlens to the device (it "
                            "stays where grid_thw is); earlier releases were not read for this patch"},
    needs_npu=True,
    families=(
        Family(FAMILIES + "TENSOR_TO",
               fence=">=0.24.0,<0.30.0", keeps="cu_seqlens.to(self.device, non_blocking=True)"),
        Family(FAMILIES + "ASYNC_H2D", fence=">=0.30.0",
               keeps="async_tensor_h2d(cu_seqlens, self.device)"),
    ),
    summary="Qwen3-Omni's vision tower: its own cu_seqlens copy gets the host lengths of its host grid; "
            "vllm.mm_encoder_attn takes them instead of reading back (0 reads)",
    # None: what this patch is for; a read per layer or per forward is the defect back.
    selftest=Selftest("npu_shim.selftest.vllm_census_tower:run", host_syncs=0, arguments={"tower": "Qwen3-Omni"}),
    defect=Defect("Qwen3-Omni's vision tower reads back the cu_seqlens it copied from the host", shows="reads"),
)
