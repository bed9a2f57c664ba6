"""Index of the shim's patches, grouped by the upstream they patch.

Each patch is a module (or a package with its release families beside it)
declaring a module-level ``PATCH`` (:class:`npu_shim.patch.Patch`). This index
is read at interpreter start, so it holds plain strings only: the patch
modules are imported once one of the watched frameworks starts importing.
What each patch fixes, where, and how is generated from the declarations into
``docs/reference.md`` (``npu-shim reference``).
"""

BUILTIN_PATCHES = (
    ("transformers.attn_check", "npu_shim.patches.transformers.attn_check"),
    ("vllm.moonvit_attn", "npu_shim.patches.vllm.moonvit_attn"),
    ("vllm.mm_encoder_attn", "npu_shim.patches.vllm_ascend.mm_encoder_attn"),
    ("vllm.mm_encoder_attn_310p", "npu_shim.patches.vllm_ascend.mm_encoder_attn_310p"),
    ("vllm.encoder_acl_graph_refs", "npu_shim.patches.vllm_ascend.encoder_acl_graph_refs"),
    ("vllm.mm_encoder_host_lengths", "npu_shim.patches.vllm.mm_encoder_host_lengths"),
    ("vllm.qwen2_5_vl_host_lengths", "npu_shim.patches.vllm.qwen2_5_vl_host_lengths"),
    ("vllm.qwen2_vl_host_lengths", "npu_shim.patches.vllm.qwen2_vl_host_lengths"),
    ("vllm.qwen3_omni_vision_host_lengths", "npu_shim.patches.vllm.qwen3_omni_vision_host_lengths"),
    ("vllm.kimi_vl_host_grid", "npu_shim.patches.vllm.kimi_vl_host_grid"),
    ("vllm.glm4_1v_host_lengths", "npu_shim.patches.vllm.glm4_1v_host_lengths"),
    ("vllm.glm4_1v_rotary_ids", "npu_shim.patches.vllm.glm4_1v_rotary_ids"),
    ("vllm.glm_ocr_host_lengths", "npu_shim.patches.vllm.glm_ocr_host_lengths"),
    ("vllm.hunyuan_vision_host_lengths", "npu_shim.patches.vllm.hunyuan_vision_host_lengths"),
    ("vllm.radio_host_lengths", "npu_shim.patches.vllm.radio_host_lengths"),
    ("vllm.dots_ocr_host_lengths", "npu_shim.patches.vllm.dots_ocr_host_lengths"),
    ("vllm.paddleocr_vl_host_lengths", "npu_shim.patches.vllm.paddleocr_vl_host_lengths"),
    ("vllm.cast_overflow_on_device", "npu_shim.patches.vllm.cast_overflow_on_device"),
    ("vllm.mm_merge_310p", "npu_shim.patches.vllm.mm_merge_310p"),
    ("vllm.mimo_v2_v_head_dim", "npu_shim.patches.vllm.mimo_v2_v_head_dim"),
    ("vllm.mimo_v2_flash_v_head_dim", "npu_shim.patches.vllm.mimo_v2_flash_v_head_dim"),
    ("vllm.mimo_v2_flash_sinks_refuse", "npu_shim.patches.vllm.mimo_v2_flash_sinks_refuse"),
    ("vllm.sinks_refuse", "npu_shim.patches.vllm_ascend.sinks_refuse"),
    ("vllm.ascend_attention_v_head_dim", "npu_shim.patches.vllm_ascend.attention_v_head_dim"),
    ("vllm.ascend_kv_split_exact", "npu_shim.patches.vllm_ascend.kv_split_exact"),
    ("vllm.ascend_qkv_v_head_size", "npu_shim.patches.vllm_ascend.qkv_v_head_size"),
    ("sglang.cp_fia", "npu_shim.patches.sglang.cp_fia"),
    ("sglang.cp_pad_gather", "npu_shim.patches.sglang.cp_pad_gather"),
    ("sglang.cp_npu_refuse", "npu_shim.patches.sglang.cp_npu_refuse"),
    ("sglang.cp_fia_host_lengths", "npu_shim.patches.sglang.cp_fia_host_lengths"),
    ("sglang.small_page_fia", "npu_shim.patches.sglang.small_page_fia"),
    ("sglang.vision_host_lengths", "npu_shim.patches.sglang.vision_host_lengths"),
    ("sglang.vision_device_lengths", "npu_shim.patches.sglang.vision_device_lengths"),
    # after the two above: it wraps the forward they leave (their replacements keep upstream's FIA call)
    ("sglang.vision_head_pad", "npu_shim.patches.sglang.vision_head_pad"),
    ("sglang.qwen2_5_vl_host_lengths", "npu_shim.patches.sglang.qwen2_5_vl_host_lengths"),
    ("sglang.qwen2_5_vl_rotary_ids", "npu_shim.patches.sglang.qwen2_5_vl_rotary_ids"),
    ("sglang.npu_mrope_positions", "npu_shim.patches.sglang.npu_mrope_positions"),
    ("sglang.glm4v_host_lengths", "npu_shim.patches.sglang.glm4v_host_lengths"),
    ("sglang.qwen3_vl_host_lengths", "npu_shim.patches.sglang.qwen3_vl_host_lengths"),
    ("sglang.npu_mha_v_head_dim", "npu_shim.patches.sglang.npu_mha_v_head_dim"),
    ("sglang.npu_mha_v_head_dim_inline", "npu_shim.patches.sglang.npu_mha_v_head_dim_inline"),
    ("sglang.npu_kv_cpu_copy_v_head_dim", "npu_shim.patches.sglang.npu_kv_cpu_copy_v_head_dim"),
    ("sglang.npu_decode_v_head_dim", "npu_shim.patches.sglang.npu_decode_v_head_dim"),
)

# Top-level packages whose import loads the patch machinery.
WATCHED_PACKAGES = frozenset({"transformers", "vllm", "vllm_ascend", "sglang"})
