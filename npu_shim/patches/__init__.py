"""Index of the shim's patches.

One module per patch; each declares a module-level ``PATCH``
(:class:`npu_shim.patch.Patch`). This index is read at interpreter start, so it
holds plain strings only: the patch modules themselves are imported once one of
the watched frameworks starts importing.

| name                       | module                    | fixes                                          |
|----------------------------|---------------------------|------------------------------------------------|
| transformers.attn_check    | transformers_attn_check   | transformers rejects attn_implementation="ascend_fa" |
| vllm.moonvit_attn          | vllm_moonvit_attn         | MoonViT falls back to SDPA with an S x S mask  |
| vllm.mm_encoder_attn       | vllm_mm_encoder_attn      | vllm-ascend syncs cu_seqlens to host per layer, ignores scale |
| vllm.mm_encoder_attn_310p  | vllm_mm_encoder_attn_310p | the same in vllm-ascend's 310P class           |
| sglang.cp_fia              | sglang_cp_fia             | sglang CP attention on NPU correct for bs == 1 only |
| sglang.cp_pad_gather       | sglang_cp_pad_gather      | sglang 0.5.16-0.5.19 NPU CP prefill crashes on CP-v2 pad rows |
| sglang.cp_npu_refuse       | sglang_cp_npu_refuse      | sglang 0.5.21-0.5.22 accept NPU prefill CP, whose KV gather is a stub |
| sglang.cp_fia_host_lengths | sglang_cp_fia_host_lengths | sglang 0.5.23 CP prefill: 4 device->host syncs per layer (.tolist() of the zigzag lengths) |
| sglang.small_page_fia      | sglang_small_page_fia     | sglang prefill with page size < 128 corrupts output on NPU (legacy qlens op); route it through FIA |
"""

BUILTIN_PATCHES = (
    ("transformers.attn_check", "npu_shim.patches.transformers_attn_check"),
    ("vllm.moonvit_attn", "npu_shim.patches.vllm_moonvit_attn"),
    ("vllm.mm_encoder_attn", "npu_shim.patches.vllm_mm_encoder_attn"),
    ("vllm.mm_encoder_attn_310p", "npu_shim.patches.vllm_mm_encoder_attn_310p"),
    ("sglang.cp_fia", "npu_shim.patches.sglang_cp_fia"),
    ("sglang.cp_pad_gather", "npu_shim.patches.sglang_cp_pad_gather"),
    ("sglang.cp_npu_refuse", "npu_shim.patches.sglang_cp_npu_refuse"),
    ("sglang.cp_fia_host_lengths", "npu_shim.patches.sglang_cp_fia_host_lengths"),
    ("sglang.small_page_fia", "npu_shim.patches.sglang_small_page_fia"),
)

# Top-level packages whose import loads the patch machinery.
WATCHED_PACKAGES = frozenset({"transformers", "vllm", "vllm_ascend", "sglang"})
