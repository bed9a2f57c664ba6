"""Emulation of the decoder attention ops of vllm-ascend's ``AscendAttentionBackendImpl``
(``vllm_ascend.attention.attention_v1``), kept apart from the encoder ops:

* ``_npu_paged_attention``: ATB PagedAttention, the decode path (one query token per
  sequence) of a layer without a sliding window, where vllm-ascend's
  ``using_paged_attention`` picks it;
* ``npu_fused_infer_attention_score_v2`` (FIA v2): the path of every layer with learnable
  sinks (``learnable_sink``), prefill and decode, from vllm-ascend 0.21.0rc1 on.

The other ops these paths call live with the encoder's: ``npu_fused_infer_attention_score``
(TND, paged or not; fused_infer_attention.py) and the cache writes ``_npu_reshape_and_cache``
/ ``npu_scatter_pa_kv_cache`` (kv_cache.py). Paged-cache reading, block-table checks and the
blockwise softmax are shared (``_common.PagedRows`` / ``check_block_table``, ``_engine``).

Value head dim != key head dim (what each document says; encoded below):

* FIA v2, op-plugin docs/context/torch_npu-npu_fused_infer_attention_score_v2.md, 约束说明,
  "TND、TND_NTD、NTD_TND场景下query、key、value输入的综合限制", query d != 512, no rope:
  "TND场景,要求Q_D、K_D、V_D等于128,或者Q_D、K_D等于192,V_D等于128/192", with, in the same
  list, "数据类型仅支持BFLOAT16", "不支持tensorlist、pse、page attention、伪量化、全量化、后量化"
  and "sparse模式仅支持sparse_mode=0且不传mask,或sparse_mode=3且传入mask". Elsewhere:
  "参数key、value中对应tensor的shape需要完全一致". So K 192 / V 128 is documented for TND,
  bfloat16, without page attention (no block_table), sparse_mode 0 or 3 only; the emulation
  accepts exactly that and refuses every other V != K combination (NotImplementedError).
* ATB PagedAttention: the documented inputs take one head size for the caches (the separate
  V head size exists only as ``mlaVHeadSize`` in the MLA-merged cache mode, not emulated):
  V != K is refused.

Where the same document restricts TND further for K == V (D 128/192 only, no page
attention, sparse_mode 0/3), vllm-ascend's own releases call it outside those limits on
hardware (paged TND, sparse_mode 4 for sliding windows); the emulation follows those calls
for K == V and says so here rather than refuse what the released code runs.
"""
import math

import torch

from npu_shim.emulation import _common as C
from npu_shim.emulation import dtypes
from npu_shim.emulation._engine import Band, attend_segment

PA = "_npu_paged_attention"
FIA_V2 = "npu_fused_infer_attention_score_v2"
SWA_INT_MAX = 2147483647

# Host-only arguments. ATB PagedAttention's input list (CANN 8.2.RC1 ATB, PagedAttention
# 输入输出列表): "contextLens [batch] int32 ND cpu 每个query对应的key/value的token数量";
# blockTables is "npu". FIA v2's actual_seq_qlen / actual_seq_kvlen are ``SymInt[]`` in the
# op-plugin prototype (host integer lists).
PA_HOST_ARGS = ("context_lens",)
FIA_V2_HOST_ARGS = ("actual_seq_qlen", "actual_seq_kvlen")

# ATB PagedAttentionOperation (CANN 8.0.RC2 ATB API), 约束: "block_size %16 == 0 ...
# head_size 范围(0, 256]", "因硬件限制,embedding * blockSize ≤ 128 * 128".
PA_MAX_HEAD_SIZE = 256
PA_BLOCK_ALIGN = 16
PA_MAX_EMBED_X_BLOCK = 128 * 128
# FIA v2: "num_query_heads与num_key_value_heads的比值不能大于64".
MAX_GQA_RATIO = 64
# FIA v2, TND without page attention: the only documented (Q_D=K_D, V_D) with V_D != K_D.
DOCUMENTED_TND_DIFF_DIMS = ((192, 128),)


def _host_lengths(op, name, values):
    if isinstance(values, torch.Tensor) and values.device.type != "cpu":
        raise ValueError("%s: %s must be host data (a list or a CPU tensor), got a tensor on %s"
                         % (op, name, values.device))
    return C.host_ints(values, op, name)


# ------------------------------------------------------------------ paged attention


def _npu_paged_attention(query, key_cache, value_cache, num_kv_heads, num_heads, scale_value,
                         block_table, context_lens, out):
    """``torch_npu._npu_paged_attention``: decode attention over a paged KV cache.

    Follows CANN ATB PagedAttentionOperation (API reference 8.0.RC2 and the 8.2.RC1 input
    list) as op-plugin's ``atb/PagedAttentionAtb.cpp`` calls it (maskType UNDEFINED, no
    quantisation): query (num_tokens, N, D), one token per sequence; key_cache /
    value_cache (num_blocks, block_size, Nkv, D); block_table (num_tokens, max_blocks)
    int32 device tensor; context_lens (batch,) int32 *host* tensor, each sequence's KV
    length; writes ``out`` (num_tokens, N, D) in place. No mask: each query sees all of its
    sequence's context_lens keys. Constraints checked: block_size % 16 == 0, head size in
    (0, 256], D * block_size <= 128 * 128, block ids in [0, num_blocks), dtypes per device
    class (npu_shim.emulation.dtypes), N a multiple of Nkv. Refused: V head dim != K head
    dim (not documented for this mode), any other cache layout.
    """
    dtypes.check(PA, query=query, key_cache=key_cache, value_cache=value_cache)
    if len({query.dtype, key_cache.dtype, value_cache.dtype}) != 1:
        raise ValueError("%s: query, key_cache and value_cache must share one dtype" % PA)
    n, nkv = C.as_int(PA, "num_heads", num_heads), C.as_int(PA, "num_kv_heads", num_kv_heads)
    C.check_heads(PA, n, nkv)
    if query.dim() != 3 or query.shape[1] != n:
        raise ValueError("%s: query must be (num_tokens, num_heads=%d, D), got %s"
                         % (PA, n, tuple(query.shape)))
    if key_cache.dim() != 4 or value_cache.dim() != 4 or key_cache.shape[2] != nkv \
            or key_cache.shape[:3] != value_cache.shape[:3]:
        raise ValueError("%s: caches must be (num_blocks, block_size, num_kv_heads=%d, D), got "
                         "%s / %s" % (PA, nkv, tuple(key_cache.shape), tuple(value_cache.shape)))
    d, dk, dv = query.shape[2], key_cache.shape[3], value_cache.shape[3]
    if dk != d:
        raise ValueError("%s: key head dim %d != query head dim %d" % (PA, dk, d))
    if dv != dk:
        raise C.not_implemented(PA, "value_cache", "value head dim %d != key head dim %d is not "
                                "documented for ATB PagedAttention without mlaVHeadSize" % (dv, dk))
    block_size = key_cache.shape[1]
    if block_size % PA_BLOCK_ALIGN:
        raise ValueError("%s: block_size %d must be a multiple of %d" % (PA, block_size, PA_BLOCK_ALIGN))
    if not 0 < d <= PA_MAX_HEAD_SIZE:
        raise ValueError("%s: head size %d outside (0, %d]" % (PA, d, PA_MAX_HEAD_SIZE))
    if d * block_size > PA_MAX_EMBED_X_BLOCK:
        raise ValueError("%s: head size * block_size = %d exceeds 128 * 128"
                         % (PA, d * block_size))
    lengths = _host_lengths(PA, "context_lens", context_lens)
    b = query.shape[0]
    if len(lengths) != b:
        raise ValueError("%s: %d context lengths for %d query tokens (one per sequence)"
                         % (PA, len(lengths), b))
    if block_table.dtype != torch.int32:
        raise ValueError("%s: block_table must be int32, got %s" % (PA, block_table.dtype))
    C.check_block_table(PA, block_table, b, lengths, block_size, num_blocks=key_cache.shape[0],
                        lengths_name="context_lens")
    if out is None or tuple(out.shape) != (b, n, dv) or out.dtype != query.dtype:
        raise ValueError("%s: out must be a %s tensor of shape %s, got %s"
                         % (PA, query.dtype, (b, n, dv),
                            None if out is None else (out.dtype, tuple(out.shape))))
    for i in range(b):
        ks = C.PagedRows(key_cache, block_table[i], block_size, lengths[i])
        vs = C.PagedRows(value_cache, block_table[i], block_size, lengths[i])
        attend_segment(query[i:i + 1], ks, vs, out[i:i + 1], scale=float(scale_value))


# ------------------------------------------------------------------------- FIA v2


def _refuse_set(op, **args):
    C.reject_set(op, **args)


def npu_fused_infer_attention_score_v2(
        query, key, value, *, query_rope=None, key_rope=None, pse_shift=None, atten_mask=None,
        actual_seq_qlen=None, actual_seq_kvlen=None, block_table=None, dequant_scale_query=None,
        dequant_scale_key=None, dequant_offset_key=None, dequant_scale_value=None,
        dequant_offset_value=None, dequant_scale_key_rope=None, quant_scale_out=None,
        quant_offset_out=None, learnable_sink=None, num_query_heads=1, num_key_value_heads=0,
        softmax_scale=1.0, pre_tokens=SWA_INT_MAX, next_tokens=SWA_INT_MAX, input_layout="BSH",
        sparse_mode=0, block_size=0, query_quant_mode=0, key_quant_mode=0, value_quant_mode=0,
        inner_precise=0, return_softmax_lse=False, query_dtype=None, key_dtype=None,
        value_dtype=None, query_rope_dtype=None, key_rope_dtype=None,
        key_shared_prefix_dtype=None, value_shared_prefix_dtype=None,
        dequant_scale_query_dtype=None, dequant_scale_key_dtype=None,
        dequant_scale_value_dtype=None, dequant_scale_key_rope_dtype=None):
    """``torch_npu.npu_fused_infer_attention_score_v2``, the TND layout as vllm-ascend's
    decoder calls it (with ``learnable_sink``).

    Follows op-plugin docs/context/torch_npu-npu_fused_infer_attention_score_v2.md:
    returns (attention_out, softmax_lse); attention_out has the query's shape with the
    value's D; softmax_lse is a one-element zero float32 tensor when return_softmax_lse is
    False. TND: actual_seq_qlen is required and cumulative, its length is the batch, its
    last value the query's T; actual_seq_kvlen is cumulative without page attention and,
    with ``block_table``, each sequence's own KV length ("page attention场景下,必须传入
    actual_seq_kvlen"; caches (num_blocks, block_size, H) or (num_blocks, KV_N, block_size, D),
    "key和value的shape需保证一致"). sparse_mode: 0 without atten_mask (nothing masked,
    pre/next tokens ignored), 3 (rightDownCausal) and 4 (band: keys ``kv_len - q_len + i -
    pre_tokens .. kv_len - q_len + i + next_tokens`` for query row i) with the compressed
    2048 x 2048 mask. GQA: num_query_heads a multiple of num_key_value_heads (0 = equal),
    ratio <= 64.

    ``learnable_sink`` (not in the prototype of that document's revision; its use is
    op-plugin's test_fused_infer_attention_score_v2 golden, ``npSoftmax_new(x, sinks)`` with
    ``sinks.view(1, -1, 1, 1)``): one logit per query head, shape (num_query_heads,), added to
    each softmax denominator as ``exp(sink_h)``, with no value.

    Value head dim != key head dim: see the module docstring (192/128, TND, bfloat16, no
    block_table, sparse_mode 0/3). Not implemented (NotImplementedError): layouts other than
    TND, query_rope/key_rope, pse_shift, every (de)quantisation argument, return_softmax_lse
    with a sink, sparse_mode 1/2, inner_precise row correction (2, 3) with a user mask.
    """
    _refuse_set(FIA_V2, query_rope=query_rope, key_rope=key_rope, pse_shift=pse_shift,
                dequant_scale_query=dequant_scale_query, dequant_scale_key=dequant_scale_key,
                dequant_offset_key=dequant_offset_key, dequant_scale_value=dequant_scale_value,
                dequant_offset_value=dequant_offset_value,
                dequant_scale_key_rope=dequant_scale_key_rope, quant_scale_out=quant_scale_out,
                quant_offset_out=quant_offset_out, query_dtype=query_dtype, key_dtype=key_dtype,
                value_dtype=value_dtype, query_rope_dtype=query_rope_dtype,
                key_rope_dtype=key_rope_dtype, key_shared_prefix_dtype=key_shared_prefix_dtype,
                value_shared_prefix_dtype=value_shared_prefix_dtype,
                dequant_scale_query_dtype=dequant_scale_query_dtype,
                dequant_scale_key_dtype=dequant_scale_key_dtype,
                dequant_scale_value_dtype=dequant_scale_value_dtype,
                dequant_scale_key_rope_dtype=dequant_scale_key_rope_dtype)
    if input_layout != "TND":
        raise C.not_implemented(FIA_V2, "input_layout", "only 'TND' is emulated, got %r"
                                % (input_layout,))
    for name, mode in (("query_quant_mode", query_quant_mode), ("key_quant_mode", key_quant_mode),
                       ("value_quant_mode", value_quant_mode)):
        if C.as_int(FIA_V2, name, mode) != 0:
            raise C.not_implemented(FIA_V2, name)
    if inner_precise not in (0, 1, 2, 3):
        raise ValueError("%s: inner_precise=%r; documented values are 0-3" % (FIA_V2, inner_precise))
    if return_softmax_lse and learnable_sink is not None:
        raise C.not_implemented(FIA_V2, "return_softmax_lse", "with learnable_sink")
    C.check_float_inputs(FIA_V2, query=query, key=key, value=value)
    n = C.as_int(FIA_V2, "num_query_heads", num_query_heads)
    nkv = C.as_int(FIA_V2, "num_key_value_heads", num_key_value_heads) or n
    C.check_heads(FIA_V2, n, nkv, MAX_GQA_RATIO)
    if query.dim() != 3 or query.shape[1] != n:
        raise ValueError("%s: TND query must be (T, num_query_heads=%d, D), got %s"
                         % (FIA_V2, n, tuple(query.shape)))
    t, _, dq = query.shape
    sparse_mode = C.as_int(FIA_V2, "sparse_mode", sparse_mode)
    if sparse_mode == 0:
        if atten_mask is not None:
            raise C.not_implemented(FIA_V2, "atten_mask", "with sparse_mode=0 (a user mask)")
    elif sparse_mode in (3, 4):
        C.check_compressed_mask(FIA_V2, atten_mask, sparse_mode)
    elif sparse_mode in (1, 2):
        raise C.not_implemented(FIA_V2, "sparse_mode", "%d with TND" % sparse_mode)
    else:
        raise ValueError("%s: sparse_mode=%r; only 0-4 are supported by the op" % (FIA_V2, sparse_mode))
    pre = C.as_int(FIA_V2, "pre_tokens", pre_tokens)
    nxt = C.as_int(FIA_V2, "next_tokens", next_tokens)
    if actual_seq_qlen is None:
        raise ValueError("%s: input_layout='TND' requires actual_seq_qlen" % FIA_V2)
    q_cum = _host_lengths(FIA_V2, "actual_seq_qlen", actual_seq_qlen)
    seg_q = _cumulative(q_cum, t, "actual_seq_qlen")
    if seg_q and seg_q[-1][1] != t:
        raise ValueError("%s: TND actual_seq_qlen must end at the query's token count T=%d, got %d"
                         % (FIA_V2, t, seg_q[-1][1]))
    b = len(seg_q)
    if actual_seq_kvlen is None:
        raise ValueError("%s: input_layout='TND' requires actual_seq_kvlen" % FIA_V2)
    kv_arg = _host_lengths(FIA_V2, "actual_seq_kvlen", actual_seq_kvlen)
    if block_table is not None:
        bs = C.as_int(FIA_V2, "block_size", block_size)
        kc = C.paged_cache_view(FIA_V2, key, "key cache", bs, nkv, True)
        vc = C.paged_cache_view(FIA_V2, value, "value cache", bs, nkv, True)
        if kc.shape[0] != vc.shape[0]:
            raise ValueError("%s: key and value caches have different block counts" % FIA_V2)
        if len(kv_arg) != b:
            raise ValueError("%s: %d KV lengths for %d sequences" % (FIA_V2, len(kv_arg), b))
        if block_table.dtype != torch.int32:
            raise ValueError("%s: block_table must be int32 (\"数据类型支持int32\"), got %s"
                             % (FIA_V2, block_table.dtype))
        C.check_block_table(FIA_V2, block_table, b, kv_arg, bs, num_blocks=kc.shape[0],
                            lengths_name="actual_seq_kvlen")
        ks = [C.PagedRows(kc, block_table[i], bs, kv_arg[i]) for i in range(b)]
        vs = [C.PagedRows(vc, block_table[i], bs, kv_arg[i]) for i in range(b)]
        kv_lens = kv_arg
        dk, dv = kc.shape[3], vc.shape[3]
    else:
        if key.dim() != 3 or value.dim() != 3 or key.shape[1] != nkv or \
                value.shape[:2] != key.shape[:2]:
            raise ValueError("%s: TND key/value must be (T, num_key_value_heads=%d, D), got %s / %s"
                             % (FIA_V2, nkv, tuple(key.shape), tuple(value.shape)))
        seg_kv = _cumulative(kv_arg, key.shape[0], "actual_seq_kvlen")
        if len(seg_kv) != b:
            raise ValueError("%s: %d query batches but %d KV batches" % (FIA_V2, b, len(seg_kv)))
        ks = [key[s:e] for s, e in seg_kv]
        vs = [value[s:e] for s, e in seg_kv]
        kv_lens = [e - s for s, e in seg_kv]
        dk, dv = key.shape[2], value.shape[2]
    if dk != dq:
        raise ValueError("%s: key head dim %d != query head dim %d" % (FIA_V2, dk, dq))
    if dv != dk:
        _check_documented_diff_dims(dk, dv, query.dtype, block_table, sparse_mode)
    sink = None
    if learnable_sink is not None:
        if not isinstance(learnable_sink, torch.Tensor) or tuple(learnable_sink.shape) != (n,):
            raise ValueError("%s: learnable_sink must be a (num_query_heads=%d,) tensor, got %r"
                             % (FIA_V2, n, getattr(learnable_sink, "shape", learnable_sink)))
        if not learnable_sink.is_floating_point():
            raise ValueError("%s: learnable_sink must be a float tensor, got %s"
                             % (FIA_V2, learnable_sink.dtype))
        sink = learnable_sink
    out = torch.zeros((t, n, dv), dtype=query.dtype, device=query.device)
    lse = torch.full((t, n, 1), -math.inf, dtype=torch.float32, device=query.device) \
        if return_softmax_lse else None
    for (q0, q1), k_rows, v_rows, kl in zip(seg_q, ks, vs, kv_lens):
        sq = q1 - q0
        if sparse_mode == 3:
            specs = (Band(None, 0, kl - sq),)
        elif sparse_mode == 4:
            specs = (Band(C.band_limit(pre), C.band_limit(nxt), kl - sq),)
        else:
            specs = ()
        attend_segment(query[q0:q1], k_rows, v_rows, out[q0:q1], scale=float(softmax_scale),
                       masks=specs, sink=sink,
                       lse_out=None if lse is None else lse[q0:q1, :, 0])
    if lse is None:
        lse = torch.zeros(1, dtype=torch.float32, device=query.device)
    return out, lse


def _check_documented_diff_dims(dk, dv, dtype, block_table, sparse_mode):
    where = "documented only for TND with Q_D=K_D=192, V_D=128, bfloat16, no page attention, " \
            "sparse_mode 0 or 3 (torch_npu-npu_fused_infer_attention_score_v2.md, 约束说明)"
    if (dk, dv) not in DOCUMENTED_TND_DIFF_DIMS:
        raise C.not_implemented(FIA_V2, "value", "K_D=%d, V_D=%d: %s" % (dk, dv, where))
    if dtype != torch.bfloat16 and not dtypes.float32_allowed():
        raise C.not_implemented(FIA_V2, "value", "K_D != V_D in %s: %s" % (dtype, where))
    if block_table is not None:
        raise C.not_implemented(FIA_V2, "block_table", "K_D != V_D with page attention: %s" % where)
    if sparse_mode not in (0, 3):
        raise C.not_implemented(FIA_V2, "sparse_mode", "K_D != V_D with sparse_mode=%d: %s"
                                % (sparse_mode, where))


def _cumulative(cum, total, name):
    segments, start = [], 0
    for end in cum:
        if end < start:
            raise ValueError("%s: TND %s must be cumulative (non-decreasing), got %r"
                             % (FIA_V2, name, cum))
        segments.append((start, end))
        start = end
    if start > total:
        raise ValueError("%s: %s ends at %d but the tensor has %d tokens" % (FIA_V2, name, start, total))
    return segments
