"""Wires the emulated ops into the two spellings upstream code uses.

* ``torch_npu.<op>(...)``: a Python function that honours ``__torch_function__``
  (``torch.overrides.handle_torch_function``). Why: a TorchFunctionMode — the
  host-sync counter, the call recorder in npu_shim.testing — then sees the op as
  one call and runs its body with the mode popped, so the emulation's own
  internals are never mistaken for the caller's host syncs.
* ``torch.ops.npu.<op>(...)``: the same implementation registered with
  ``torch.library`` in the ``npu`` namespace (sglang calls
  ``torch.ops.npu.npu_fused_infer_attention_score``). The dispatcher applies
  torch-function handling for these itself.

Schemas follow the documented torch_npu signatures (``SymInt[]`` written as
``int[]``).
"""
import inspect

import torch
from torch.overrides import handle_torch_function, has_torch_function
from torch.utils._pytree import tree_flatten

from npu_shim.emulation import (
    activation, decoder_attention, defects, device_print, formats, fusion_attention, moe, norms,
    prompt_flash_attention, rotary, unpad)
from npu_shim.emulation._common import INT_MAX
from npu_shim.emulation.fused_infer_attention import (
    FIA_HOST_ARGS, IFA_HOST_ARGS, npu_fused_infer_attention_score, npu_incre_flash_attention)
from npu_shim.emulation.fusion_attention import npu_fusion_attention
from npu_shim.emulation.decoder_attention import (
    _npu_paged_attention, npu_fused_infer_attention_score_v2)
from npu_shim.emulation.matmul import _npu_matmul_add_fp32
from npu_shim.emulation.kv_cache import _npu_reshape_and_cache, npu_scatter_pa_kv_cache
from npu_shim.emulation import prefix_attention
from npu_shim.emulation.prefix_attention import _npu_flash_attention_qlens
from npu_shim.emulation.prompt_flash_attention import (
    PFA_PRE_TOKENS_DEFAULT, npu_prompt_flash_attention)
from npu_shim.emulation.scatter import npu_scatter_nd_update_
from npu_shim.emulation.unpad import _npu_flash_attention_unpad

_T = "Tensor? {}=None"


def _opt_tensors(*names):
    return ", ".join(_T.format(n) for n in names)


SCHEMAS = {
    "npu_fusion_attention": (
        npu_fusion_attention,
        "npu_fusion_attention(Tensor query, Tensor key, Tensor value, int head_num, "
        "str input_layout, Tensor? pse=None, Tensor? padding_mask=None, "
        "Tensor? atten_mask=None, float scale=1., float keep_prob=1., "
        "int pre_tockens=%d, int next_tockens=%d, int inner_precise=0, int[]? prefix=None, "
        "int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, int sparse_mode=0, "
        "bool gen_mask_parallel=True, bool sync=False, str softmax_layout=\"\", Tensor? sink=None, "
        "*, Tensor? dropout_mask=None, int seed=0, int offset=0) "
        "-> (Tensor, Tensor, Tensor, Tensor, int, int, int)" % (INT_MAX, INT_MAX),
    ),
    "npu_prompt_flash_attention": (
        npu_prompt_flash_attention,
        "npu_prompt_flash_attention(Tensor query, Tensor key, Tensor value, *, "
        + _opt_tensors("pse_shift", "padding_mask", "atten_mask")
        + ", int[]? actual_seq_lengths=None, "
        + _opt_tensors("deq_scale1", "quant_scale1", "deq_scale2", "quant_scale2", "quant_offset2")
        + ", int num_heads=1, float scale_value=1.0, int pre_tokens=%d, int next_tokens=0, "
        "str input_layout=\"BSH\", int num_key_value_heads=0, "
        "int[]? actual_seq_lengths_kv=None, int sparse_mode=0) -> Tensor" % PFA_PRE_TOKENS_DEFAULT,
    ),
    "npu_fused_infer_attention_score": (
        npu_fused_infer_attention_score,
        "npu_fused_infer_attention_score(Tensor query, Tensor key, Tensor value, *, "
        + _opt_tensors("pse_shift", "atten_mask")
        + ", int[]? actual_seq_lengths=None, int[]? actual_seq_lengths_kv=None, "
        + _opt_tensors("dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2",
                       "quant_offset2", "antiquant_scale", "antiquant_offset", "block_table",
                       "query_padding_size", "kv_padding_size", "key_antiquant_scale",
                       "key_antiquant_offset", "value_antiquant_scale", "value_antiquant_offset",
                       "key_shared_prefix", "value_shared_prefix")
        + ", int[]? actual_shared_prefix_len=None, "
        + _opt_tensors("query_rope", "key_rope", "key_rope_antiquant_scale")
        + ", int num_heads=1, float scale=1.0, int pre_tokens=%d, int next_tokens=%d, "
        "str input_layout=\"BSH\", int num_key_value_heads=0, int sparse_mode=0, "
        "int inner_precise=0, int block_size=0, int antiquant_mode=0, "
        "bool softmax_lse_flag=False, int key_antiquant_mode=0, int value_antiquant_mode=0) "
        "-> (Tensor, Tensor)" % (INT_MAX, INT_MAX),
    ),
    "npu_incre_flash_attention": (
        npu_incre_flash_attention,
        "npu_incre_flash_attention(Tensor query, Tensor key, Tensor value, *, "
        + _opt_tensors("padding_mask", "pse_shift", "atten_mask")
        + ", int[]? actual_seq_lengths=None, "
        + _opt_tensors("dequant_scale1", "quant_scale1", "dequant_scale2", "quant_scale2",
                       "quant_offset2", "antiquant_scale", "antiquant_offset", "block_table",
                       "kv_padding_size")
        + ", int num_heads=1, float scale_value=1.0, str input_layout=\"BSH\", "
        "int num_key_value_heads=0, int block_size=0, int inner_precise=1) -> Tensor",
    ),
    "_npu_flash_attention_unpad": (
        _npu_flash_attention_unpad,
        "_npu_flash_attention_unpad(Tensor query, Tensor key, Tensor value, Tensor seq_len, "
        "float scale_value, int num_heads, int num_kv_heads, Tensor(a!) out) -> ()",
    ),
    "_npu_flash_attention": (
        unpad._npu_flash_attention,
        "_npu_flash_attention(Tensor query, Tensor key, Tensor value, Tensor mask, Tensor seq_len, "
        "float scale_value, int num_heads, int num_kv_heads, Tensor(a!) out) -> ()",
    ),
    "_npu_reshape_and_cache": (
        _npu_reshape_and_cache,
        "_npu_reshape_and_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_indices) -> ()",
    ),
    "npu_scatter_pa_kv_cache": (
        npu_scatter_pa_kv_cache,
        "npu_scatter_pa_kv_cache(Tensor key, Tensor value, Tensor(a!) key_cache, "
        "Tensor(b!) value_cache, Tensor slot_mapping, *, Tensor? compress_lens=None, "
        "Tensor? compress_seq_offsets=None, Tensor? seq_lens=None, str cache_mode=\"Norm\") -> ()",
    ),
    "_npu_flash_attention_qlens": (
        _npu_flash_attention_qlens,
        "_npu_flash_attention_qlens(Tensor query, Tensor key_cache, Tensor value_cache, Tensor block_table, "
        "Tensor mask, Tensor seq_len, Tensor context_lens, int num_kv_heads, int num_heads, float scale_value, "
        "Tensor(a!) out) -> ()",
    ),
    "_npu_paged_attention": (
        _npu_paged_attention,
        "_npu_paged_attention(Tensor query, Tensor key_cache, Tensor value_cache, int num_kv_heads, "
        "int num_heads, float scale_value, Tensor block_table, Tensor context_lens, "
        "Tensor(a!) out) -> ()",
    ),
    "npu_fused_infer_attention_score_v2": (
        npu_fused_infer_attention_score_v2,
        "npu_fused_infer_attention_score_v2(Tensor query, Tensor key, Tensor value, *, "
        + _opt_tensors("query_rope", "key_rope", "pse_shift", "atten_mask")
        + ", int[]? actual_seq_qlen=None, int[]? actual_seq_kvlen=None, "
        + _opt_tensors("block_table", "dequant_scale_query", "dequant_scale_key",
                       "dequant_offset_key", "dequant_scale_value", "dequant_offset_value",
                       "dequant_scale_key_rope", "quant_scale_out", "quant_offset_out",
                       "learnable_sink")
        + ", int num_query_heads=1, int num_key_value_heads=0, float softmax_scale=1.0, "
        "int pre_tokens=%d, int next_tokens=%d, str input_layout=\"BSH\", int sparse_mode=0, "
        "int block_size=0, int query_quant_mode=0, int key_quant_mode=0, int value_quant_mode=0, "
        "int inner_precise=0, bool return_softmax_lse=False, int? query_dtype=None, "
        "int? key_dtype=None, int? value_dtype=None, int? query_rope_dtype=None, "
        "int? key_rope_dtype=None, int? key_shared_prefix_dtype=None, "
        "int? value_shared_prefix_dtype=None, int? dequant_scale_query_dtype=None, "
        "int? dequant_scale_key_dtype=None, int? dequant_scale_value_dtype=None, "
        "int? dequant_scale_key_rope_dtype=None) -> (Tensor, Tensor)" % (INT_MAX, INT_MAX),
    ),
    # The engine's layer ops (norms, activation, rotary, MoE): see docs/emulation-ops.md.
    "npu_rms_norm": (
        norms.npu_rms_norm,
        "npu_rms_norm(Tensor self, Tensor gamma, float epsilon=1e-06) -> (Tensor, Tensor)",
    ),
    "npu_add_rms_norm": (
        norms.npu_add_rms_norm,
        "npu_add_rms_norm(Tensor x1, Tensor x2, Tensor gamma, float epsilon=1e-06) "
        "-> (Tensor, Tensor, Tensor)",
    ),
    "npu_swiglu": (
        activation.npu_swiglu,
        "npu_swiglu(Tensor self, int dim=-1) -> Tensor",
    ),
    "npu_rotary_mul": (
        rotary.npu_rotary_mul,
        "npu_rotary_mul(Tensor self, Tensor r1, Tensor r2, str rotary_mode=\"half\") -> Tensor",
    ),
    "npu_mrope": (
        rotary.npu_mrope,
        "npu_mrope(Tensor positions, Tensor query, Tensor key, Tensor cos_sin_cache, int head_size, *, "
        "int[]? mrope_section=None, str rotary_mode=\"half\", str cache_mode=\"default\") "
        "-> (Tensor, Tensor)",
    ),
    "_npu_rotary_embedding": (
        rotary._npu_rotary_embedding,
        "_npu_rotary_embedding(Tensor positions, Tensor(a!) query, Tensor(b!) key, int head_size, "
        "Tensor cos_sin_cache, bool is_neox_style) -> ()",
    ),
    "npu_apply_rotary_pos_emb": (
        rotary.npu_apply_rotary_pos_emb,
        "npu_apply_rotary_pos_emb(Tensor(a!) query, Tensor(b!) key, Tensor cos, Tensor sin, str layout=\"BSH\", "
        "str rotary_mode=\"half\") -> (Tensor(a!), Tensor(b!))",
    ),
    "npu_moe_gating_top_k": (
        moe.npu_moe_gating_top_k,
        "npu_moe_gating_top_k(Tensor x, int k, *, Tensor? bias=None, int k_group=1, int group_count=1, "
        "int group_select_mode=0, int renorm=0, int norm_type=1, bool out_flag=False, "
        "float routed_scaling_factor=1.0, float eps=1e-20) -> (Tensor, Tensor, Tensor)",
    ),
    "npu_moe_init_routing_v2": (
        moe.npu_moe_init_routing_v2,
        "npu_moe_init_routing_v2(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
        "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
        "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=0, "
        "int[] active_expert_range=[], int row_idx_type=0) -> (Tensor, Tensor, Tensor, Tensor)",
    ),
    "npu_grouped_matmul": (
        moe.npu_grouped_matmul,
        "npu_grouped_matmul(Tensor[] x, Tensor[] weight, *, Tensor[]? bias=None, Tensor[]? scale=None, "
        "Tensor[]? offset=None, Tensor[]? antiquant_scale=None, Tensor[]? antiquant_offset=None, "
        "Tensor[]? per_token_scale=None, Tensor? group_list=None, Tensor[]? activation_input=None, "
        "Tensor[]? activation_quant_scale=None, Tensor[]? activation_quant_offset=None, "
        "int split_item=0, int? group_type=None, int group_list_type=0, int act_type=0, "
        "ScalarType? output_dtype=None, int[]? tuning_config=None) -> Tensor[]",
    ),
    "npu_moe_token_unpermute": (
        moe.npu_moe_token_unpermute,
        "npu_moe_token_unpermute(Tensor permuted_tokens, Tensor sorted_indices, Tensor? probs=None, "
        "bool padded_mode=False, int[]? restore_shape=None) -> Tensor",
    ),
    "npu_moe_finalize_routing": (
        moe.npu_moe_finalize_routing,
        "npu_moe_finalize_routing(Tensor expanded_permuted_rows, Tensor? skip1, Tensor? skip2, Tensor? bias, "
        "Tensor? scales, Tensor expanded_src_to_dst_row, Tensor? export_for_source_row, int? drop_pad_mode=0) "
        "-> Tensor",
    ),
    "_npu_matmul_add_fp32": (
        _npu_matmul_add_fp32,
        "_npu_matmul_add_fp32(Tensor x, Tensor weight, Tensor(a!) C) -> ()",
    ),
    "npu_format_cast": (
        formats.npu_format_cast,
        "npu_format_cast(Tensor self, int acl_format, *, ScalarType? customize_dtype=None, "
        "ScalarType? input_dtype=None) -> Tensor",
    ),
    "npu_scatter_nd_update_": (
        npu_scatter_nd_update_,
        "npu_scatter_nd_update_(Tensor(a!) input, Tensor indices, Tensor updates) -> Tensor(a!)",
    ),
}


def _positions(impl, names):
    """{argument: its position when passed positionally, or None if keyword-only}."""
    params = list(inspect.signature(impl).parameters.values())
    out = {}
    for name in names:
        index = next(i for i, p in enumerate(params) if p.name == name)
        out[name] = index if params[index].kind is inspect.Parameter.POSITIONAL_OR_KEYWORD else None
    return out


# The arguments each op reads on the host (declared, with the vendor's documentation,
# beside each op), keyed like SCHEMAS: what a caller hands there must be host data.
HOST_ARGS = {
    name: _positions(SCHEMAS[name][0], names) for name, names in (
        ("_npu_flash_attention_unpad", unpad.HOST_ARGS),
        ("_npu_flash_attention", unpad.MASKED_HOST_ARGS),
        ("npu_fusion_attention", fusion_attention.HOST_ARGS),
        ("npu_prompt_flash_attention", prompt_flash_attention.HOST_ARGS),
        ("npu_fused_infer_attention_score", FIA_HOST_ARGS),
        ("npu_incre_flash_attention", IFA_HOST_ARGS),
        ("_npu_paged_attention", decoder_attention.PA_HOST_ARGS),
        ("_npu_flash_attention_qlens", prefix_attention.HOST_ARGS),
        ("npu_fused_infer_attention_score_v2", decoder_attention.FIA_V2_HOST_ARGS),
    )
}


def host_arguments(name, args, kwargs):
    """``[(argument, value)]`` of op ``name``'s host-only arguments in one call (those
    passed, None left out); empty for an op with none."""
    found = []
    for arg, index in HOST_ARGS.get(name, {}).items():
        if arg in kwargs:
            value = kwargs[arg]
        elif index is not None and index < len(args):
            value = args[index]
        else:
            continue
        if value is not None:
            found.append((arg, value))
    return found


# A testing hook around every emulated op body, both spellings: None, or a callable
# ``hook(name, args, kwargs)`` returning a context manager entered around the body (only the
# body: a TorchFunctionMode's handling of the call is outside it). npu_shim.testing.cuda_syncs
# uses it to keep CUDA's sync-debug mode out of the emulation's internals, which stand in for a
# device kernel. Set with :func:`set_body_hook`.
_body_hook = None


def set_body_hook(hook):
    """Install ``hook`` (or None) around every emulated op body; returns the previous one."""
    global _body_hook
    previous, _body_hook = _body_hook, hook
    return previous


def _body(name, impl):
    def body(*args, **kwargs):
        # NPU_SHIM_EMULATE_DEFECTS: upstream's reported op failures, where asked for (defects)
        hook = _body_hook
        if hook is None:
            return defects.call(name, impl, args, kwargs)
        with hook(name, args, kwargs):
            return defects.call(name, impl, args, kwargs)

    body.__name__ = body.__qualname__ = name
    body.__wrapped__ = impl
    return body


# vllm-ascend's own compiled ops (``vllm_ascend_C``), which upstream calls as
# ``torch.ops._C_ascend.<op>``: registered in that namespace, never under torch_npu.
C_ASCEND_SCHEMAS = {
    "npu_add_rms_norm_bias": (
        norms.npu_add_rms_norm_bias,
        "npu_add_rms_norm_bias(Tensor x1, Tensor x2, Tensor gamma, Tensor? beta=None, "
        "float epsilon=1e-06) -> (Tensor, Tensor, Tensor)",
    ),
    "device_print": (device_print.device_print, "device_print(str msg) -> ()"),
    "device_print_tensor": (device_print.device_print_tensor, "device_print_tensor(Tensor tensor) -> ()"),
    "moe_gating_top_k": (
        moe.moe_gating_top_k,
        "moe_gating_top_k(Tensor x, int k, int k_group, int group_count, int group_select_mode, "
        "int renorm, int norm_type, bool out_flag, float routed_scaling_factor, float eps, "
        "Tensor? bias_opt=None) -> (Tensor, Tensor, Tensor)",
    ),
    # vllm-ascend's own build of CANN's MoeInitRoutingV2 (csrc/moe_init_routing_custom, up to 0.25;
    # vllm-ascend #12305 then called torch_npu.npu_moe_init_routing_v2 in its place, with the same
    # arguments, "no user-facing change"): the schema is upstream's (its torch binding), the kernel
    # npu_moe_init_routing_v2's emulation. vllm-ascend 0.18's DeviceOperator.npu_moe_init_routing calls it.
    "npu_moe_init_routing_custom": (
        moe.npu_moe_init_routing_v2,
        "npu_moe_init_routing_custom(Tensor x, Tensor expert_idx, *, Tensor? scale=None, Tensor? offset=None, "
        "int active_num=-1, int expert_capacity=-1, int expert_num=-1, int drop_pad_mode=0, "
        "int expert_tokens_num_type=0, bool expert_tokens_num_flag=False, int quant_mode=0, "
        "int[2] active_expert_range=[], int row_idx_type=0) -> (Tensor, Tensor, Tensor, Tensor)",
    ),
}

_library = None
_c_ascend_library = None


def register_ops():
    """Define the ops under ``torch.ops.npu`` (and ``torch.ops._C_ascend``) once per process."""
    global _library, _c_ascend_library
    if _library is not None:
        return
    lib = torch.library.Library("npu", "FRAGMENT")
    for name, (impl, schema) in SCHEMAS.items():
        lib.define(schema)
        lib.impl(name, _body(name, impl), "CompositeExplicitAutograd")
    c_lib = torch.library.Library("_C_ascend", "FRAGMENT")
    for name, (impl, schema) in C_ASCEND_SCHEMAS.items():
        c_lib.define(schema)
        c_lib.impl(name, _body(name, impl), "CompositeExplicitAutograd")
    _library, _c_ascend_library = lib, c_lib


def _torch_function_aware(name, impl):
    body = _body(name, impl)

    def op(*args, **kwargs):
        flat, _ = tree_flatten((args, kwargs))
        tensors = tuple(x for x in flat if isinstance(x, torch.Tensor))
        if tensors and has_torch_function(tensors):
            return handle_torch_function(op, tensors, *args, **kwargs)
        return body(*args, **kwargs)

    op.__name__ = op.__qualname__ = name
    op.__module__ = "torch_npu"
    op.__doc__ = impl.__doc__ or __import__(impl.__module__, fromlist=["_"]).__doc__
    op.__wrapped__ = impl
    op.npu_shim_emulated = True
    return op


PUBLIC = {name: _torch_function_aware(name, impl) for name, (impl, _) in SCHEMAS.items()}
