"""vllm.mm_encoder_attn — one host copy per encoder forward, honour ``scale``.

Why: vllm-ascend's ``AscendMMEncoderAttention.forward_oot`` (the attention of
  every ViT tower vLLM builds on ``MMEncoderAttention``: Qwen2.5/3-VL,
  MoonViT, ...) needs the segment lengths on the host and copies
  ``cu_seqlens`` device->host in every layer (27 copies per 27-layer forward)
  in every release from 0.13.0 on, except where vLLM hands it host
  ``sequence_lengths`` (0.18.0 .. 0.22.1rc1, Qwen-VL towers only). Through
  0.22.1rc1 it passes ``head_size ** -0.5`` to the kernel, ignoring a
  ``scale`` the model gave. 0.15.0rc1 (with any vLLM but 0.15.0) parses the
  prefix digits into a layer index and shares a module-global lengths cache
  between every encoder in the process.
How: one family per vllm-ascend release family (modules in
  :mod:`npu_shim.patches.vllm_ascend.mm_encoder`, declared below), each fenced by
  a version range and accepted by the structure of the installed class; the one
  that applies is shown by ``npu-shim status``. Each keeps upstream's op call and
  argument layout of its release and changes only where the host lengths come
  from (read once per encoder forward, see
  :mod:`npu_shim.patches.vllm_ascend.mm_encoder.common`) and the scale. A layer's state
  is built from its own attributes on first use (layers made with
  ``__new__``, before install, or unpickled work).

  Graph path (0.22.1rc1 and later): while vllm-ascend's encoder ACL-graph capture is
  active (``get_encoder_forward_context().capturing``), upstream's
  ``forward_oot`` runs (counted as ``upstream_calls``), and its
  ``_forward_capture_fia`` and ``_run_vit_fia`` are upstream's edited at one
  expression: the head count handed to FIA (workspace, captured op, the replay's
  rebinding) is the repeated K/V's, not ``num_kv_heads`` (upstream repeats K/V to
  the query heads on this path too; for a grouped tower, EXAONE 4.5's in vLLM
  0.22.1 .. 0.30.0, its call does not match its K/V). Towers with as many K/V heads
  as query heads get upstream's very call.
  Optional, off by default: ``NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1`` makes the
  0.22.1rc1 and 0.23.0rc1+ families' eager path call what family 0.18.0 calls
  for the same layer, ``torch_npu.npu_fusion_attention`` with ``input_layout="TND"``
  and 0.18.0's arguments (the cumulative lengths as 0-d host tensors for queries
  and keys, ``head_num``, ``scale``), instead of ``npu_fused_infer_attention_score``.
  vllm-ascend #13699 (open) reports that FIA call (TND, ``sparse_mode=0``, no mask)
  returning a uniform average (error ~3.1 against an fp32 reference, single and
  multi-image inputs) on one stack (torch_npu 2.10); it may be stack-specific.
  Verified here, on the emulated ops: with the switch on no FIA call is made,
  every layer makes 0.18.0's call with 0.18.0's argument layout, the output
  matches the float64 reference, and status shows the switch. Not verified: the
  defect itself (not reproduced: the emulation computes what the documentation
  says), that the fusion op avoids it on an affected stack (its evidence is that
  vllm-ascend 0.18.0 shipped that call for this layer), and the ACL-graph capture
  path, where upstream's FIA call runs (with the head count above), switch or not. Under the switch
  a call with different query and key lengths raises ``ValueError`` (0.18.0's
  call takes one list for both).
Upstream fix: none yet for the copy of towers that pass no ``sequence_lengths``
  (0.18.0+); the scale is honoured from 0.23.0rc1.
Remove when: vllm-ascend computes host lengths once per encoder forward for
  every tower.
"""
from npu_shim.patch import Defect, Family, Patch, Selftest

PATCH_NAME = "vllm.mm_encoder_attn"
CLASS_NAME = "AscendMMEncoderAttention"
FAMILIES = "npu_shim.patches.vllm_ascend.mm_encoder."

PATCH = Patch(
    name=PATCH_NAME,
    target="vllm_ascend.ops.mm_encoder_attention",
    subject=CLASS_NAME,
    # Every attribute some family replaces (each replaces a subset); the capture functions only the
    # fused-infer families replace, in the releases that have the encoder ACL graph.
    replaces=(CLASS_NAME + ".__init__", CLASS_NAME + ".forward_oot"),
    may_replace=(CLASS_NAME + "._forward_capture_fia", CLASS_NAME + "._run_vit_fia"),
    requires={"vllm-ascend": ""},
    outside_window={"vllm-ascend": "below the window vllm-ascend had no AscendMMEncoderAttention"},
    needs_npu=True,
    families=(
        Family(FAMILIES + "v013", id="unpad-per-layer-lengths",
               fence=">=0.13.0rc1,<0.18.0rc1",
               keeps="torch_npu._npu_flash_attention_unpad, K/V repeated to the query heads "
                     "(NPU_SHIM_MM_ENCODER_TND=1: npu-shim's TND npu_fusion_attention)"),
        Family(FAMILIES + "v018", id="fusion-attention-tnd", fence=">=0.18.0rc1,<0.19.0rc1",
               keeps="torch_npu.npu_fusion_attention, input_layout TND"),
        Family(FAMILIES + "v019", id="device-operator-fa", fence=">=0.19.0rc1,<0.22.0rc1",
               keeps="DeviceOperator.npu_flash_attention"),
        Family(FAMILIES + "v022", id="fia-tnd-sequence-lengths", fence=">=0.22.0rc1,<0.23.0rc1",
               keeps="torch_npu.npu_fused_infer_attention_score, input_layout TND "
                     "(NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1: family fusion-attention-tnd's npu_fusion_attention "
                     "TND)"),
        Family(FAMILIES + "v023", id="fia-tnd-cu-seqlens",
               fence=">=0.23.0rc1",
               keeps="torch_npu.npu_fused_infer_attention_score, input_layout TND "
                     "(NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1: family fusion-attention-tnd's npu_fusion_attention "
                     "TND)"),
    ),
    summary="host seq lens once per encoder forward (no prefix cache, no global), honour scale; "
            "during vllm-ascend's encoder ACL-graph capture (families fia-tnd-*) upstream's forward_oot "
            "runs (counted as upstream_calls), its capture functions edited so the captured FIA call, its "
            "workspace and its replay get the repeated K/V's head count, not num_kv_heads (grouped vision "
            "heads, vLLM's exaone4_5 tower: upstream's call does not match its K/V)",
    # One: the single copy of a device cu_seqlens per encoder forward, whatever the depth.
    selftest=Selftest("npu_shim.selftest.vllm_mm_encoder_attn", host_syncs=1),
    defect=Defect("vllm-ascend's encoder attention reads cu_seqlens back once per layer", shows="reads"),
)
