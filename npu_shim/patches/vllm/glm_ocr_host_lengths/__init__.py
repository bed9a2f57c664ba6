"""vllm.glm_ocr_host_lengths — GLM-OCR's vision tower: its own ``cu_seqlens`` copy gets the host lengths.

Why: vLLM's GLM-OCR vision tower (``GlmOcrVisionTransformer``, a subclass of
  GLM-4.1V's tower with its own ``forward``) builds ``cu_seqlens`` on the host
  from the host ``grid_thw`` (``repeat_interleave(h * w, t).cumsum(int32)``
  behind a 0) and copies it to the device itself
  (``cu_seqlens.to(self.device, non_blocking=True)``; from 0.30.0 the ``cat``
  writes into a pinned buffer first), not through
  ``MMEncoderAttention.maybe_recompute_cu_seqlens``, so
  ``vllm.mm_encoder_host_lengths`` never sees it, and
  ``vllm.glm4_1v_host_lengths`` patches GLM-4.1V's ``forward``, which GLM-OCR
  overrides. vllm-ascend's attention (with ``vllm.mm_encoder_attn``) reads the
  tensor back: 1 device->host read per tower forward (upstream: 1 per layer),
  of numbers the host built a few lines above.
How: ``forward`` and ``compute_attn_mask_seqlen`` (inherited from GLM-4.1V's
  tower; the replacement on GLM-OCR's class calls the parent's at call time)
  are wrapped; both upstream bodies run untouched, the copy included (same op,
  same arguments). The tower hands ``compute_attn_mask_seqlen`` the device
  tensor its copy just returned. When the running ``forward`` (noted
  thread-locally) was given a host grid (a list, which upstream turns into an
  int32 host tensor, or a 2-D integer tensor on the host: ``host_data.host_grid``,
  where a device stand-in's ``cpu:0`` is not the host), the wrapper builds the host lengths
  from that grid with the tower's own ops (``repeat_interleave``, ``cumsum``
  in int32, a 0 in front) and, where length and dtype (int32) match the
  device tensor, keeps them on it with
  :func:`npu_shim.patches._shared.host_record.remember`; the
  attention's host read takes them once instead of reading back. A grid
  already on the device keeps upstream's read.
  Counted on vLLM's own tower (:mod:`npu_shim.testing.census`, 3 layers, two
  grids with multi-frame items, both device classes): 3 -> 0 reads per tower
  forward (vLLM 0.22.1, 0.26.0, 0.30.0), outputs ``torch.equal`` to upstream's.
Window: read in the wheels: 0.16.0 .. 0.28.0 (the same ``forward`` body),
  0.29.0 (``forward`` takes and drops ``encoder_metadata``, the same copy) and
  0.30.0 (``torch.cat(..., out=<pinned buffer>).to(self.device,
  non_blocking=True)``). Run in the lanes vllm-0.22 (0.22.1), latest-vllm
  (0.26.0) and vllm-0.30 (0.30.0); the other releases of the families are
  decided from reading the wheels. 0.16.0 .. 0.18.0 have the same ``forward``,
  but their lanes pin a transformers (4.57.6) without GLM-OCR's configuration
  to build the tower from: not claimed.
Upstream fix: none (vllm-ascend reads ``cu_seqlens`` back in every release read).
Remove when: the tower copies ``cu_seqlens`` through
  ``maybe_recompute_cu_seqlens``, or vllm-ascend's attention takes host
  lengths from vLLM (``sequence_lengths`` / ``cu_seqlens_np``).
"""
from npu_shim.patch import Defect, Family, Patch, Selftest

PATCH_NAME = "vllm.glm_ocr_host_lengths"
CLASS_NAME = "GlmOcrVisionTransformer"
FAMILIES = "npu_shim.patches.vllm.glm_ocr_host_lengths.families:"

PATCH = Patch(
    name=PATCH_NAME,
    target="vllm.model_executor.models.glm_ocr",
    subject=CLASS_NAME,
    replaces=(CLASS_NAME + ".compute_attn_mask_seqlen", CLASS_NAME + ".forward"),
    requires={"vllm": ""},
    outside_window={"vllm": "the releases just below the window have the same forward, but their lanes pin a "
                            "transformers without GLM-OCR's configuration: not run, not claimed; older ones "
                            "have no GLM-OCR"},
    needs_npu=True,
    families=(
        Family(FAMILIES + "TENSOR_TO", fence=">=0.19.0,<0.30.0",
               keeps="cu_seqlens.to(self.device, non_blocking=True)"),
        Family(FAMILIES + "PINNED_CAT", fence=">=0.30.0",
               keeps="torch.cat(..., out=<pinned buffer>).to(self.device, non_blocking=True)"),
    ),
    summary="GLM-OCR's vision tower: its own cu_seqlens copy gets the host lengths of its host grid; "
            "vllm.mm_encoder_attn takes them instead of reading back (0 reads)",
    # None: what this patch is for; a read per layer or per forward is the defect back.
    selftest=Selftest("npu_shim.selftest.vllm_census_tower:run", host_syncs=0, arguments={"tower": "GLM-OCR"}),
    defect=Defect("GLM-OCR's vision tower reads back the cu_seqlens it copied from the host", shows="reads"),
)
