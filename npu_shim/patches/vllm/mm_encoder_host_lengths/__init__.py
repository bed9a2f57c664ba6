"""vllm.mm_encoder_host_lengths — the encoder attention reads the host's own ``cu_seqlens``.

Why: the vision towers vLLM builds on ``MMEncoderAttention`` (Qwen2.5-VL,
  Qwen3-VL, GLM-4.1V from 0.26, LLaVA-OneVision-2, Kimi-K2.5's ViT, ...) make
  ``cu_seqlens`` with NumPy on the host and copy it to the device once per
  forward, through ``MMEncoderAttention.maybe_recompute_cu_seqlens`` (the
  copy is its last line). vllm-ascend's attention then needs those very
  numbers on the host again and reads the device tensor back: with
  ``vllm.mm_encoder_attn`` once per tensor per forward (Qwen2.5-VL: 2, window
  and full; Qwen3-VL: 1), without it once per layer. On an NPU each read
  drains the queue before the first token of every multimodal request.
How: ``maybe_recompute_cu_seqlens`` is wrapped: upstream's body runs
  untouched (its copy, ``non_blocking=True``, included); where the tensor it
  returns holds the host array it was given (every backend but FlashInfer,
  whose offsets are rescaled and padded), a host copy of that array is kept
  on the returned device tensor (an attribute: it dies with the tensor, is
  never pickled or deep-copied), with the tensor's storage pointer, version
  and length. ``vllm.mm_encoder_attn``'s per-forward host read
  (:func:`npu_shim.patches.vllm_ascend.mm_encoder.common.host_values`) takes
  it (:func:`npu_shim.patches._shared.host_record.take`) the first time a
  layer reads that tensor, instead of the device read; the record is taken once, so a tensor reused for
  another forward (an encoder graph buffer refilled with ``copy_``) is read
  from the device as before. Without ``vllm.mm_encoder_attn`` (or
  vllm-ascend) the record is unused.
Window: vllm 0.18.0 (``torch.from_numpy(...).to(device, non_blocking=True)``),
  0.22.1 and 0.23.0 (same, plus ``fp8_padded_hidden_size``); 0.24.0, 0.25.1,
  0.26.0 and 0.30.0 (``async_tensor_h2d``, from 0.24.0), read in the wheels
  and run in the lanes. Towers
  that copy ``cu_seqlens`` themselves instead: Qwen2.5-VL in 0.18.0 .. 0.21.0
  (served by ``vllm.qwen2_5_vl_host_lengths``); Qwen2-VL from 0.22 and
  Qwen3-Omni's vision tower from 0.24 (served by ``vllm.qwen2_vl_host_lengths``
  and ``vllm.qwen3_omni_vision_host_lengths``); GLM-4.1V in 0.18.0 ..
  0.23.0 (served by ``vllm.glm4_1v_host_lengths``).
Upstream fix: none (vllm-ascend reads ``cu_seqlens`` back in every release read).
Remove when: vllm-ascend's attention takes host lengths from vLLM for every tower.
"""
from npu_shim.patch import Defect, Family, Patch, Selftest

PATCH_NAME = "vllm.mm_encoder_host_lengths"
CLASS_NAME = "MMEncoderAttention"
FAMILIES = "npu_shim.patches.vllm.mm_encoder_host_lengths.families:"

PATCH = Patch(
    name=PATCH_NAME,
    target="vllm.model_executor.layers.attention.mm_encoder_attention",
    subject=CLASS_NAME,
    replaces=(CLASS_NAME + ".maybe_recompute_cu_seqlens",),
    requires={"vllm": ""},
    outside_window={"vllm": "below the window vLLM had no MMEncoderAttention.maybe_recompute_cu_seqlens"},
    needs_npu=True,
    families=(
        Family(FAMILIES + "FROM_NUMPY", fence=">=0.18.0,<0.24.0",
               keeps="torch.from_numpy(cu_seqlens).to(device, non_blocking=True)"),
        Family(FAMILIES + "ASYNC_H2D", fence=">=0.24.0",
               keeps="async_tensor_h2d(cu_seqlens, device=device)"),
    ),
    summary="the host cu_seqlens vLLM copies to the device is kept on the device tensor; "
            "vllm.mm_encoder_attn takes it instead of reading the tensor back (0 reads)",
    # None: what this patch is for; a read per layer or per forward is the defect back.
    selftest=Selftest("npu_shim.selftest.vllm_mm_encoder_host_lengths", host_syncs=0),
    defect=Defect("the encoder attention reads back the cu_seqlens vLLM copied from the host",
                  shows="reads",
                  hidden={
                      "vllm.mm_encoder_attn:" + family: "the selftest's Qwen3-VL tower hands vllm-ascend's "
                      "attention its host sequence_lengths, so no cu_seqlens is read back, with or without the patch"
                      for family in ("fusion-attention-tnd", "device-operator-fa", "fia-tnd-sequence-lengths")}),
)
