"""The tensor dtypes each emulated op takes, per device class, from the vendor's documentation.

Why: the emulation computes in float32 whatever it is given, so without this table a
test could feed float32 (or bfloat16 on 310P) to an op that rejects it on the device,
and pass. Each op below lists what its reference page says it takes for the inputs
the emulation implements (the int8/int4 quantisation inputs are refused elsewhere as
not implemented), with the page and the sentence it comes from.

Device classes: ``"310P"`` (Atlas inference series, "Atlas 推理系列加速卡产品",
SoC 200-205) and ``"A2"`` (everything else the emulation knows: Atlas A2/A3; their
pages list the same types). An empty tuple means the page does not list the op for
that device class at all.

float32 where the hardware rejects it is available only through
:func:`float32_not_on_hardware`, which the math checks of the tests enter on purpose
(float32 against the float64 reference measures the emulation's and the patches'
arithmetic to ~1e-7, far below what half-precision inputs allow).
"""
import contextlib
import threading

import torch

from npu_shim.emulation import soc

__all__ = ["SUPPORTED", "check", "device_class", "float32_not_on_hardware", "stands_in", "supported"]

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32

# op -> {device class: dtypes of query/key/value (or the tensors named in the note)}
SUPPORTED = {
    # CANN ATB SelfAttentionOperation (PA_ENCODER is what _npu_flash_attention_unpad runs).
    # CANN 8.0.RC3 ATB API, SelfAttentionParam, QuantType: "TYPE_QUANT_UNDEFINED:默认值,
    # 不与量化融合,此时q,k,v为bf16/float16".
    # MindIE 1.0.RC1 ATB SelfAttentionOperation, 约束: "Atlas 推理系列产品(配置Ascend 310P
    # AI处理器)上,q、k、v、attentionMask输入的数据类型不支持bf16".
    "_npu_flash_attention_unpad": {"A2": (F16, BF16), "310P": (F16,)},
    # query, key, value, mask: the same ATB SelfAttentionOperation, PA_ENCODER with maskType NORM
    # (op-plugin atb/SelfAttentionAtb.cpp); the same pages as the unpad row above (mask included in
    # "q、k、v、attentionMask输入的数据类型不支持bf16" on 310P).
    "_npu_flash_attention": {"A2": (F16, BF16), "310P": (F16,)},
    # Ascend Extension for PyTorch (CANN 7.0.0) API reference, torch_npu.npu_fusion_attention:
    # "query:Device侧的Tensor,公式中输入Q,数据类型支持FLOAT16、BFLOAT16" (key, value alike);
    # 支持的型号: "Atlas A2 训练系列产品" only, so nothing on 310P.
    "npu_fusion_attention": {"A2": (F16, BF16), "310P": ()},
    # Ascend Extension for PyTorch 7.0.0 API reference, torch_npu.npu_prompt_flash_attention:
    # "Atlas 推理系列加速卡产品:数据类型支持float16。 Atlas A2 训练系列产品/Atlas 800I A2
    # 推理产品/A200I A2 Box 异构组件:数据类型支持float16、bfloat16、int8。"
    "npu_prompt_flash_attention": {"A2": (F16, BF16), "310P": (F16,)},
    # Ascend Extension for PyTorch 6.0.0 API reference, torch_npu.npu_fused_infer_attention_score:
    # "query(Tensor*,计算输入):Device侧的Tensor,attention结构的Query输入,数据类型支持FLOAT16、
    # BFLOAT16、INT8"; CANN ops-transformer FusedInferAttentionScore README, 产品支持情况:
    # "Atlas 推理系列加速卡产品 ×".
    "npu_fused_infer_attention_score": {"A2": (F16, BF16), "310P": ()},
    # Ascend Extension for PyTorch 6.0.0 API reference, torch_npu.npu_incre_flash_attention:
    # "query: ... Atlas 推理系列加速卡产品 :数据类型支持FLOAT16。 Atlas A2 训练系列产品/Atlas 800I
    # A2 推理产品 :数据类型支持FLOAT16、BFLOAT16。"
    "npu_incre_flash_attention": {"A2": (F16, BF16), "310P": (F16,)},
    # key, value, key_cache, value_cache. CANN 8.0.RC2 ATB ReshapeAndCacheOperation, 输入:
    # "key ... float16/bfloat16/int8" (value and both caches alike), 约束: "key、value、keyCache、
    # valueCache、keyCacheOut、valueCacheOut的数据类型都必须完全一致". The page names no
    # per-device difference; 310P's bfloat16 is refused by ATB in general (see the unpad note).
    "_npu_reshape_and_cache": {"A2": (F16, BF16, torch.int8), "310P": (F16, torch.int8)},
    # key, value, key_cache, value_cache. CANN ops-transformer aclnnScatterPaKvCache, key:
    # "Atlas A3 训练系列产品/Atlas A3 推理系列产品、Atlas A2 训练系列产品/Atlas A2 推理系列产品:
    # 数据类型仅支持FLOAT16、BFLOAT16、INT8"; 产品支持情况: "Atlas 推理系列产品 ×".
    "npu_scatter_pa_kv_cache": {"A2": (F16, BF16, torch.int8), "310P": ()},
    # query, key_cache, value_cache. CANN ATB PagedAttentionOperation (8.0.RC2), 约束:
    # "query、keyCache、valueCache、maskTensor四个入参在Atlas 推理系列产品上只支持float16";
    # 输入输出列表 (8.2.RC1): query / keyCache / valueCache "float16/bf16/int8" (int8 only with
    # the quantisation features, not emulated).
    "_npu_paged_attention": {"A2": (F16, BF16), "310P": (F16,)},
    # query, key_cache, value_cache, mask. CANN 8.3.RC1 ATB API, SelfAttention calcType=PREFIX_ENCODER
    # 输入输出: query / key / value "float16/bf16"; the op's PREFIX_ENCODER pages name Atlas A2 / 800I A2
    # only (nothing on 310P).
    "_npu_flash_attention_qlens": {"A2": (F16, BF16), "310P": ()},
    # query, key, value. op-plugin docs torch_npu-npu_fused_infer_attention_score_v2.md:
    # query "数据类型支持float16、bfloat16" (key/value add int8/int4, quantisation, not
    # emulated); 产品支持情况 lists Atlas A2/A3 only.
    "npu_fused_infer_attention_score_v2": {"A2": (F16, BF16), "310P": ()},
    # input, updates. op-plugin 7.3.0 docs, torch_npu.npu_scatter_nd_update_: "Atlas A2 训练系列
    # 产品/Atlas A2 推理系列产品:数据类型支持float32、float16、bool、bfloat16、int64、int8";
    # "Atlas 推理系列产品:数据类型支持float32、float16、bool". float32 is real here.
    # The ops vllm-ascend's text/VL/MoE layers run (norms, activation, rotary, MoE); see
    # docs/emulation-ops.md for where each is called. float32 is a real input type for all of
    # them (their pages list it), so float32 tests need no float32_not_on_hardware() here.
    # CANN aclnnRmsNorm, x: "Atlas 推理系列产品:数据类型支持FLOAT32、FLOAT16。 Atlas A2训练系列
    # 产品/Atlas 800I A2推理产品:数据类型支持FLOAT32、FLOAT16、BFLOAT16".
    "npu_rms_norm": {"A2": (F32, F16, BF16), "310P": (F32, F16)},
    # x1, x2. Taken as aclnnRmsNorm's list; aclnnAddRmsNorm's own page was not read
    # (unverified).
    "npu_add_rms_norm": {"A2": (F32, F16, BF16), "310P": (F32, F16)},
    # x1, x2. vllm-ascend's own kernel (torch.ops._C_ascend), csrc add_rms_norm_bias_def.cpp:
    # x1/x2 ".DataType({ge::DT_FLOAT16, ge::DT_FLOAT, ge::DT_BF16})", AddConfig "ascend910b",
    # "ascend910_93" only (vllm-ascend's 310P layernorm calls npu_add_rms_norm instead).
    "npu_add_rms_norm_bias": {"A2": (F16, F32, BF16), "310P": ()},
    # x. vllm-ascend's own kernel (torch.ops._C_ascend), csrc moe_gating_top_k_proto.h:
    # "REG_OP(MoeGatingTopK) .INPUT(x, TensorType({DT_FLOAT, DT_FLOAT16, DT_BF16}))"; not
    # built for 310P (whose router calls npu_moe_gating_top_k_softmax).
    "moe_gating_top_k": {"A2": (F32, F16, BF16), "310P": ()},
    # x, weight. MindSpeed's npu_matmul_add_fp32 page (the same ATB kernel): "x: 数据类型float16,
    # bf16", "weight: ... float16, bf16" (C float32, checked by the op); vllm-ascend's 310P worker
    # skips it ("310p device do not support torch_npu._npu_matmul_add_fp32 atb ops").
    "_npu_matmul_add_fp32": {"A2": (F16, BF16), "310P": ()},
    # self. Unverified: the torch_npu.npu_swiglu page was not read; the list is the norms'
    # (vllm-ascend's 310P activation calls it, so 310P is not empty).
    "npu_swiglu": {"A2": (F32, F16, BF16), "310P": (F32, F16)},
    # input, r1, r2. Unverified: the torch_npu.npu_rotary_mul page was not read; the list is
    # the norms'.
    "npu_rotary_mul": {"A2": (F32, F16, BF16), "310P": (F32, F16)},
    # query, key, cos_sin_cache. CANN RopeWithSinCosCache (npu_mrope) README, 产品支持情况:
    # "Atlas inference products ×"; the dtype list is unverified (page's table not read).
    "npu_mrope": {"A2": (F32, F16, BF16), "310P": ()},
    # query, key, cos_sin_cache. Unverified (no page read): the norms' list; vllm-ascend's 310P
    # rotary calls it too.
    "_npu_rotary_embedding": {"A2": (F32, F16, BF16), "310P": (F32, F16)},
    # query, key, cos, sin. CANN aclnnApplyRotaryPosEmb: "数据类型支持BFLOAT16(仅Atlas A2 ...)、FLOAT16、
    # FLOAT32"; 产品支持情况 lists Atlas 推理系列产品 ("不支持BFLOAT16").
    "npu_apply_rotary_pos_emb": {"A2": (F32, F16, BF16), "310P": (F32, F16)},
    # x. torch_npu.npu_moe_gating_top_k (7.0.0): "x … 数据类型支持float16、bfloat16、float32";
    # CANN aclnnMoeGatingTopK 产品支持情况: "Atlas 推理系列产品 ×".
    "npu_moe_gating_top_k": {"A2": (F32, F16, BF16), "310P": ()},
    # x. torch_npu.npu_moe_init_routing_v2 (7.0.0): "x … 数据类型支持float16、bfloat16、float32、
    # int8" (int8 only with quantisation, not emulated); CANN aclnnMoeInitRoutingV2 lists A2.
    # vllm-ascend's 310P MoE calls it too, for float16.
    "npu_moe_init_routing_v2": {"A2": (F32, F16, BF16), "310P": (F16,)},
    # x, weight. Unverified: the torch_npu.npu_grouped_matmul page was not read; 310P lists
    # float16, which vllm-ascend's 310P MoE runs.
    "npu_grouped_matmul": {"A2": (F32, F16, BF16), "310P": (F16,)},
    # permuted_tokens. CANN aclnnMoeTokenUnpermute 产品支持情况: "Atlas 推理系列产品 ×"; the
    # dtype list is unverified (the parameter table was not read).
    "npu_moe_token_unpermute": {"A2": (F32, F16, BF16), "310P": ()},
    # expanded_permuted_rows. Ascend Extension for PyTorch 6.0.RC3 API reference,
    # torch_npu.npu_moe_finalize_routing: "数据类型支持FLOAT16、BFLOAT16、FLOAT32"; 支持的型号: Atlas A2
    # only.
    "npu_moe_finalize_routing": {"A2": (F32, F16, BF16), "310P": ()},
    "npu_scatter_nd_update_": {
        "A2": (F32, F16, torch.bool, BF16, torch.int64, torch.int8),
        "310P": (F32, F16, torch.bool),
    },
}

_lock = threading.Lock()
_float32_depth = 0


@contextlib.contextmanager
def float32_not_on_hardware():
    """Let the attention ops take float32, which the real ones reject: for math checks
    only (float32 against the float64 reference). Nested uses are fine; every thread
    of the process sees it while any use is open."""
    global _float32_depth
    with _lock:
        _float32_depth += 1
    try:
        yield
    finally:
        with _lock:
            _float32_depth -= 1


def float32_allowed():
    return _float32_depth > 0


def stands_in(given, named):
    """Whether a tensor of dtype ``given`` stands in for one the caller names as ``named``: float32 for
    float16 / bfloat16, inside :func:`float32_not_on_hardware` only. For callers that name the
    model's half dtype outright (sglang's NPU MoE runner passes ``output_dtype=torch.bfloat16``
    unless its input is float16)."""
    return float32_allowed() and given == F32 and named in (F16, BF16)


def device_class():
    return "310P" if soc.is_310p() else "A2"


def supported(op):
    """The dtypes ``op`` takes on the emulated SoC (float32 added inside
    :func:`float32_not_on_hardware`)."""
    listed = SUPPORTED[op][device_class()]
    if float32_allowed() and F32 not in listed:
        listed = listed + (F32,)
    return listed


def _names(dtypes):
    return ", ".join(str(d).replace("torch.", "") for d in dtypes) or "none"


def check(op, **tensors):
    """Raise ``ValueError`` (the emulation's rule for what the documented op rejects) for
    the first tensor whose dtype ``op`` does not take on the
    emulated SoC, naming the op, the argument, the dtype and the supported list."""
    allowed = supported(op)
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError("%s: %s must be a tensor, got %s" % (op, name, type(t).__name__))
        if t.dtype not in allowed:
            cls = device_class()
            if not allowed:
                raise ValueError("%s: not documented for %s (%s): no dtype is supported there"
                                % (op, soc.soc_name(), cls))
            hint = ("; float32 is for math checks only, inside "
                    "npu_shim.emulation.dtypes.float32_not_on_hardware()"
                    if t.dtype == F32 else "")
            raise ValueError("%s: %s has dtype %s, which the op does not take on %s (%s); "
                            "supported: %s%s" % (op, name, str(t.dtype).replace("torch.", ""),
                                                 soc.soc_name(), cls, _names(allowed), hint))
