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

* FIA v2, op-plugin docs/context/torch_npu-npu_fused_infer_attention_score_v2.md, revision
  5e735e5 (the newest one read), 约束说明, "TND、TND_NTD、NTD_TND场景下query、key、value输入的
  综合限制", query D != 512, no rope: "TND场景,要求Q_D、K_D、V_D等于128,或者Q_D、K_D等于192,
  V_D等于128/192 ... GQA和PA场景不支持V_D等于192", and "page attention场景下仅支持blocksize为16
  对齐且小于等于1024". So K 192 / V 128 is documented for TND, with GQA and with page
  attention (block_size a multiple of 16, <= 1024); V_D 192 is not, with GQA or paging. The
  emulation accepts (192, 128) in TND, paged or not, and refuses every other V != K pair
  and V_D 192 with GQA or paging (NotImplementedError / ValueError).
  An earlier revision (0d45aab) of the same page was narrower for that case: "数据类型仅支持
  BFLOAT16", "不支持...page attention", "sparse模式仅支持sparse_mode=0且不传mask,或
  sparse_mode=3且传入mask": a CANN older than the page's 5e735e5 revision may refuse
  paged or sliding-window 192/128 calls the emulation runs.
* ``learnable_sink`` (same revision, "learnable_sink的参数约束"): "仅支持TND、NTD_TND;
  仅支持value的d小于等于128": refused with V_D > 128; and its parameter entry, "数据类型支持
  `bfloat16`": any other dtype (float16, float32) is refused (ValueError quoting it).
* ATB PagedAttention: the documented inputs take one head size for the caches (the separate
  V head size exists only as ``mlaVHeadSize`` in the MLA-merged cache mode, not emulated):
  V != K is refused.

For K == V the same list allows only D 128 (or 192) in TND; vllm-ascend's releases call TND
for every head size of the models they serve, and the emulation does not refuse other
equal head sizes (the tests use D 128).

The window edge (sparse_mode 4, what vllm-ascend passes a sliding-window layer:
``pre_tokens=sliding_window``, ``next_tokens=0``). The page (same revision) defines the two
counts by what they admit, not by a formula: "pre_tokens: 用于稀疏计算，表示attention需要和前几个
Token计算关联" (how many *preceding* tokens attention relates to) and "next_tokens: ... 表示
attention需要和后几个Token计算关联"; "sparse_mode为4时，代表band模式的mask". The kernel family's
sparse-mode page (FlashAttentionScore's, "sparseMode为4时，代表band场景，即计算preTokens和
nextTokens之间的部分，参数起点为右下角") fixes the arithmetic in its worked examples: mode 8's card 2
(Sq 3, Skv 4, leftUpCausal rows 2-4 of a 5 x 4 mask) is "preTokens=4, nextTokens=1", which is
exactly keys ``diag - pre .. diag + next`` with ``diag = Skv - Sq + i``, both ends included (row 2
sees keys 0-2 = diag 1 + 1); mode 7's card 1 (Sq 2, Skv 6, rows 0-1 of a rightDownCausal 4 x 6)
is "nextTokens=-2" the same way. The examples fix the upper end; the lower end is read the same
way (symmetric, and "前几个Token" counts tokens *before* the current one). So the emulation
admits, for query row i of a segment,
``kv_len - q_len + i - pre_tokens <= j <= kv_len - q_len + i + next_tokens``: pre_tokens=W,
next_tokens=0 is the current key and the W before it, **W + 1 keys**. vLLM's FlashAttention
(``window_size=(W - 1, 0)``), its KV-cache manager and HF (a query at i sees i - W < j <= i) use
W: under this reading the op needs ``pre_tokens=W - 1`` (what ``vllm.ascend_attention_v_head_dim``
passes for the layers it serves; ``NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE=1`` for every layer).
Which reading an installed CANN has is probed on the box by the MiMo selftest
(:func:`npu_shim.testing.window_edge.probe_window_edge`).

Q_S = 1: the page says of pre_tokens and next_tokens "Q_S为1时该参数无效" and of sparse_mode
"Q_S为1且不带rope输入时该参数无效", Q_S being "query shape中的S". A TND query (T, N, D) has no S
axis; the page's TND rules (约束说明, "TND、TND_NTD、NTD_TND场景下...综合限制", query D != 512)
restrict head dims, GQA and block sizes but neither sparse_mode nor a Q_S of 1, and its Q_S=1
section defers TND to them ("当query的input_layout为TND/TND_NTD时，综合约束请见..."). The emulation therefore applies the band to every TND segment, a
decode segment of one query token included (the only layout it emulates for this op). Whether
the installed op does the same in a decode-only TND call is probed by the same selftest; an op
that ignores it there would attend past the window, to the null block vLLM's KV manager leaves in
the block table for the blocks it has freed.
"""
import math

import torch

from npu_shim.emulation import _common as C
from npu_shim.emulation import dtypes, formats
from npu_shim.emulation._engine import Band, attend_segment

PA = "_npu_paged_attention"
FIA_V2 = "npu_fused_infer_attention_score_v2"
SWA_INT_MAX = 2147483647

# Host-only arguments. ATB PagedAttention's input list (CANN 8.2.RC1 ATB, PagedAttention
# 输入输出列表): "contextLens [batch] int32 ND cpu 每个query对应的key/value的token数量";
# blockTables is "npu". FIA v2's actual_seq_qlen / actual_seq_kvlen are ``SymInt[]`` in the
# op-plugin prototype (host integer lists).
PA_HOST_ARGS = ("context_lens",)
NZ = formats.NZ
FIA_V2_HOST_ARGS = ("actual_seq_qlen", "actual_seq_kvlen")

# ATB PagedAttentionOperation (CANN 8.0.RC2 ATB API), 约束: "block_size %16 == 0 ...
# head_size 范围(0, 256]", "因硬件限制,embedding * blockSize ≤ 128 * 128".
PA_MAX_HEAD_SIZE = 256
PA_BLOCK_ALIGN = 16
PA_MAX_EMBED_X_BLOCK = 128 * 128
# FIA v2: "num_query_heads与num_key_value_heads的比值不能大于64".
MAX_GQA_RATIO = 64
# FIA v2, TND: the only documented (Q_D=K_D, V_D) with V_D != K_D; V_D 192 not with GQA or
# paging; learnable_sink only with V_D <= 128; TND page attention block_size (see above).
DOCUMENTED_TND_DIFF_DIMS = ((192, 128),)
NO_GQA_OR_PAGING_V_DIM = 192
SINK_MAX_V_DIM = 128
SINK_DTYPE = torch.bfloat16      # learnable_sink: "数据类型支持`bfloat16`" (5e735e5's parameter list)
TND_PA_BLOCK_ALIGN, TND_PA_MAX_BLOCK = 16, 1024


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
    if NZ in (formats.acl_format_of(key_cache), formats.acl_format_of(value_cache)):
        return _paged_attention_nz(query, key_cache, value_cache, n, nkv, scale_value, block_table,
                                   context_lens, out)
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
    _check_head_size(d, block_size)
    lengths = _host_lengths(PA, "context_lens", context_lens)
    b = _check_sequences(query, n, dv, block_size, lengths, block_table, key_cache.shape[0], out)
    for i in range(b):
        ks = C.PagedRows(key_cache, block_table[i], block_size, lengths[i])
        vs = C.PagedRows(value_cache, block_table[i], block_size, lengths[i])
        attend_segment(query[i:i + 1], ks, vs, out[i:i + 1], scale=float(scale_value))


def _check_head_size(d, block_size):
    if not 0 < d <= PA_MAX_HEAD_SIZE:
        raise ValueError("%s: head size %d outside (0, %d]" % (PA, d, PA_MAX_HEAD_SIZE))
    if d * block_size > PA_MAX_EMBED_X_BLOCK:
        raise ValueError("%s: head size * block_size = %d exceeds 128 * 128" % (PA, d * block_size))


def _check_sequences(query, n, dv, block_size, lengths, block_table, num_blocks, out):
    """One context length per query token (sequence), the block table covering them, ``out`` (b, n, dv)
    in the query's dtype; returns b."""
    b = query.shape[0]
    if len(lengths) != b:
        raise ValueError("%s: %d context lengths for %d query tokens (one per sequence)" % (PA, len(lengths), b))
    if block_table.dtype != torch.int32:
        raise ValueError("%s: block_table must be int32, got %s" % (PA, block_table.dtype))
    C.check_block_table(PA, block_table, b, lengths, block_size, num_blocks=num_blocks, lengths_name="context_lens")
    if out is None or tuple(out.shape) != (b, n, dv) or out.dtype != query.dtype:
        raise ValueError("%s: out must be a %s tensor of shape %s, got %s"
                         % (PA, query.dtype, (b, n, dv), None if out is None else (out.dtype, tuple(out.shape))))
    return b


def _paged_attention_nz(query, key_cache, value_cache, n, nkv, scale_value, block_table, context_lens, out):
    """``_npu_paged_attention`` over 310P's FRACTAL_NZ caches (num_blocks, Nkv * D / 16, block_size, 16):
    CANN ATB's paged_attention inference demo ("本用例仅支持Atlas 推理系列产品 ... kvCache shape改为:
    [block_num, head_size * head_num / 16, block_size, 16]。kvCache数据格式改为:ACL_FORMAT_FRACTAL_NZ",
    CANN 8.3.RC1 ATB API); each block's (block_size, Nkv * D) rows read back as
    :func:`npu_shim.emulation.formats.nz_to_nd` says. The rest as the ND op. ``context_lens`` may be a
    device tensor here: vllm-ascend 0.30's 310P metadata builder binds the device lengths for this call
    on purpose ("Paged and splitfuse attention consume device-side context lengths",
    ``vllm_ascend/_310p/attention/metadata_builder.py``), and op-plugin hands a device tensor to ATB as
    device data (``AtTensor2AtbTensor``); read here as the kernel reads it, counted as a host argument
    at dispatch like every ``context_lens`` (``_registry.HOST_ARGS``)."""
    from npu_shim.emulation.kv_cache import nz_cache_hidden

    d = query.shape[2]
    block_size = nz_cache_hidden(PA, key_cache, "key_cache", nkv * d)
    if nz_cache_hidden(PA, value_cache, "value_cache", nkv * d) != block_size or \
            key_cache.shape[0] != value_cache.shape[0]:
        raise ValueError("%s: key and value caches differ in (num_blocks, block_size)" % PA)
    _check_head_size(d, block_size)
    lengths = C.host_ints(context_lens, PA, "context_lens")
    b = _check_sequences(query, n, d, block_size, lengths, block_table, key_cache.shape[0], out)
    for i in range(b):
        ks = NzPagedRows(key_cache, block_table[i], block_size, lengths[i], nkv, d)
        vs = NzPagedRows(value_cache, block_table[i], block_size, lengths[i], nkv, d)
        attend_segment(query[i:i + 1], ks, vs, out[i:i + 1], scale=float(scale_value))


class NzPagedRows(C.PagedRows):
    """Rows 0..length of one sequence in a 310P FRACTAL_NZ paged cache (num_blocks, Nkv * D / 16,
    block_size, 16), as (length, Nkv, D), gathered per slice (the blocks the slice touches)."""

    def __init__(self, cache, block_ids, block_size, length, nkv, d):
        self.cache, self.block_ids, self.block_size = cache, block_ids, block_size
        self.shape = (length, nkv, d)

    def _rows_of(self, blocks):                                    # (nb, Nkv*D/16, bs, 16)
        return blocks.permute(0, 2, 1, 3).reshape(-1, self.shape[1], self.shape[2])   # (nb*bs, Nkv, D)


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

    ``learnable_sink`` (parameter list of a later revision: "可学习的Sink Token", shape
    (Q_N,); op-plugin's test_fused_infer_attention_score_v2 golden, ``npSoftmax_new(x,
    sinks)`` with ``sinks.view(1, -1, 1, 1)``): one logit per query head added to each
    softmax denominator as ``exp(sink_h)``, with no value; only with V_D <= 128. That later
    revision lists bfloat16 only for it ("数据类型支持`bfloat16`"); vllm-ascend passes the
    model's parameter as it is (a float16 model's sinks are float16): the emulation refuses any
    dtype but bfloat16, as the page does (upcast to float32 inside).

    ``pre_tokens`` / ``next_tokens`` with sparse_mode 4: the band of the module docstring, both
    ends included (pre_tokens=W, next_tokens=0 admits W + 1 keys), applied to every TND segment,
    one-token decode segments included.

    Value head dim != key head dim: see the module docstring (Q_D=K_D=192 with V_D=128 in
    TND, paged or not). Not implemented (NotImplementedError): layouts other than
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
        if bs <= 0 or bs % TND_PA_BLOCK_ALIGN or bs > TND_PA_MAX_BLOCK:
            raise ValueError("%s: TND page attention takes block_size a multiple of 16, <= 1024 "
                             "(\"仅支持blocksize为16对齐且小于等于1024\"), got %d" % (FIA_V2, bs))
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
    if dv != dk and (dk, dv) not in DOCUMENTED_TND_DIFF_DIMS:
        raise C.not_implemented(FIA_V2, "value", "K_D=%d, V_D=%d: with V_D != K_D only Q_D=K_D=192, "
                                "V_D=128 is documented for TND (torch_npu-npu_fused_infer_attention_"
                                "score_v2.md, 约束说明)" % (dk, dv))
    if dv == NO_GQA_OR_PAGING_V_DIM and (nkv != n or block_table is not None):
        raise C.not_implemented(FIA_V2, "value", "V_D=192 with GQA or page attention "
                                "(\"GQA和PA场景不支持V_D等于192\")")
    sink = None
    if learnable_sink is not None:
        if not isinstance(learnable_sink, torch.Tensor) or tuple(learnable_sink.shape) != (n,):
            raise ValueError("%s: learnable_sink must be a (num_query_heads=%d,) tensor, got %r"
                             % (FIA_V2, n, getattr(learnable_sink, "shape", learnable_sink)))
        if dv > SINK_MAX_V_DIM:
            raise C.not_implemented(FIA_V2, "learnable_sink", "with V_D=%d (\"仅支持value的d小于等于"
                                    "128\")" % dv)
        # float32 sinks only inside dtypes.float32_not_on_hardware() (math checks against float64, as
        # for the op's other float32 inputs there)
        if learnable_sink.dtype != SINK_DTYPE and not (learnable_sink.dtype == torch.float32
                                                       and dtypes.float32_allowed()):
            raise ValueError("%s: learnable_sink must be bfloat16 (the op page, op-plugin 5e735e5: "
                             "\"数据类型支持`bfloat16`\"), got %s" % (FIA_V2, learnable_sink.dtype))
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
