"""Emulation of ``torch_npu._npu_flash_attention_qlens``: prefill attention over a paged KV cache
(sglang's Ascend backend, ``AscendAttnBackend.forward_extend`` without FIA; vllm-ascend's prefill
with a prefix-cache hit on older releases).

What the op is (op-plugin ``op_plugin/ops/atb/SelfAttentionQlensAtb.cpp``): ATB
``SelfAttentionOperation`` with ``calcType = PREFIX_ENCODER``, ``kernelType = KERNELTYPE_HIGH_PRECISION``,
``maskType = MASK_TYPE_NORM_COMPRESS``, ``isTriuMask = 1``, ``kvcacheCfg = K_CACHE_V_CACHE``, ``qkScale =
scale_value``, inputs ``(query, key_cache, value_cache, block_table, mask, seq_len, context_lens)``, output
``out``; schema ``_npu_flash_attention_qlens(Tensor query, Tensor key_cache, Tensor value_cache, Tensor
block_table, Tensor mask, Tensor seq_len, Tensor context_lens, int num_kv_heads, int num_heads, float
scale_value, Tensor(a!) out) -> ()``.

Semantics (CANN 8.3.RC1 ATB API, "calcType=PREFIX_ENCODER ... 时输入输出", and op-plugin's own test
``test/test_custom_ops/test_atb_flash_attention_qlens.py``, whose reference ``ref_fa_with_prefix_cache``
is the definition used here): sequence ``b`` has ``seq_len[b]`` new query tokens (packed in ``query`` in
batch order) and ``context_lens[b]`` keys (its cached prefix and the new tokens, already written to the
cache), read through ``block_table[b]``; its query ``i`` is position ``context_lens[b] - seq_len[b] + i``
and sees keys ``0 ..`` that position (causal, aligned to the end). GQA: query head ``h`` reads KV head
``h // (num_heads // num_kv_heads)``. The result is written into ``out`` (query's shape).

Constraints checked (the same pages; a call outside them raises ValueError naming the rule):

* query ``(nTokens, headNum * headSize)`` or ``(nTokens, headNum, headSize)``; caches ``(numBlocks,
  blockSize, kvHeadNum * headSize)`` or ``(numBlocks, blockSize, kvHeadNum, headSize)``, "key,value的shape
  必须一致"; dtypes float16/bfloat16 (npu_shim.emulation.dtypes; float32 only inside
  ``float32_not_on_hardware``), one dtype;
* "blockSize必须设为128" (op-plugin's test expects a RuntimeError naming ``blockSize=128`` for 16, 32
  and 64: sglang #38196 reported wrong prefill there before that check), "BlockSize × HeadSize <= 128 ×
  128", "key,value的HeadSize <= 128", "headSize需要16对齐";
* "PrefixCacheLen的计算由kvseqlen减seqLen得到,由于实现方案限制,需要让prefixCacheLen 128对齐" (read on the
  MASK_TYPE_CAUSAL_MASK page of the same calcType; applied here too: the kernel is the same);
* ``seq_len`` / ``context_lens``: ``[batch]`` int32 *host* tensors ("cpu"), ``seq_len[b] <=
  context_lens[b]``, their sum of ``seq_len`` the query's tokens; ``block_table`` ``[batch, maxBlockNum]``
  int32, every block a sequence reads inside the cache;
* ``mask``: the compressed causal mask, ``[128, 128]`` ("开启压缩mask功能且maskType为
  MASK_TYPE_NORM_COMPRESS时,mask的维度:在Atlas 800I A2推理产品上为[128, 128]"), non-zero exactly strictly
  above the diagonal (its content is not read otherwise: the op derives the causal pattern). The
  high-precision kernel wants the masked value 1 ("当开启高精度功能且maskType为NORM、NORM_COMPRESS时,
  mask值需传1"): not enforced, the value is not used by the emulation.

Refused: a value head size other than the key's (the caches' shapes must be equal; op-plugin sets
``mlaVHeadSize = 0``), and 310P (the op's PREFIX_ENCODER pages list Atlas A2 / 800I A2 only).
"""
import torch

from npu_shim.emulation import _common as C
from npu_shim.emulation import dtypes
from npu_shim.emulation._engine import Band, attend_segment

QLENS = "_npu_flash_attention_qlens"
# seq_len and context_lens are "cpu" tensors in the ATB input list.
HOST_ARGS = ("seq_len", "context_lens")
BLOCK_SIZE = 128
MAX_HEAD_SIZE = 128
HEAD_ALIGN = 16
PREFIX_ALIGN = 128
MASK_SIZE = 128


def _host_lengths(name, values, batch=None):
    if not isinstance(values, torch.Tensor) or values.device.type != "cpu":
        where = values.device if isinstance(values, torch.Tensor) else type(values).__name__
        raise ValueError("%s: %s must be an int32 host (cpu) tensor [batch], got %s" % (QLENS, name, where))
    if values.dtype not in (torch.int32, torch.uint32) or values.dim() != 1:
        raise ValueError("%s: %s must be an int32 host tensor [batch], got %s %s"
                         % (QLENS, name, values.dtype, tuple(values.shape)))
    return C.host_ints(values, QLENS, name)


def _split(t, heads, what):
    if t.dim() == 2:
        if t.shape[1] % heads:
            raise ValueError("%s: %s %s: its last dim is not a multiple of %d heads"
                             % (QLENS, what, tuple(t.shape), heads))
        return t.view(t.shape[0], heads, t.shape[1] // heads)
    if t.dim() == 3 and t.shape[1] == heads:
        return t
    raise ValueError("%s: %s must be (nTokens, %d * headSize) or (nTokens, %d, headSize), got %s"
                     % (QLENS, what, heads, heads, tuple(t.shape)))


def _cache(t, heads, what):
    if t.dim() == 3:
        if t.shape[2] % heads:
            raise ValueError("%s: %s %s: its last dim is not a multiple of %d KV heads"
                             % (QLENS, what, tuple(t.shape), heads))
        return t.view(t.shape[0], t.shape[1], heads, t.shape[2] // heads)
    if t.dim() == 4 and t.shape[2] == heads:
        return t
    raise ValueError("%s: %s must be (numBlocks, blockSize, %d * headSize) or (numBlocks, blockSize, %d, "
                     "headSize), got %s" % (QLENS, what, heads, heads, tuple(t.shape)))


def _check_mask(mask):
    if not isinstance(mask, torch.Tensor) or tuple(mask.shape) != (MASK_SIZE, MASK_SIZE):
        raise ValueError("%s: mask must be the compressed causal mask [128, 128] (MASK_TYPE_NORM_COMPRESS), "
                         "got %s" % (QLENS, None if mask is None else tuple(mask.shape)))
    expected = torch.ones((MASK_SIZE, MASK_SIZE), dtype=torch.bool, device=mask.device).triu_(1)
    if not torch.equal(mask != 0, expected):
        raise ValueError("%s: mask must be non-zero exactly strictly above the diagonal (the compressed "
                         "causal mask, e.g. torch.triu(torch.ones(128, 128), 1))" % QLENS)


def _npu_flash_attention_qlens(query, key_cache, value_cache, block_table, mask, seq_len, context_lens,
                               num_kv_heads, num_heads, scale_value, out):
    """``torch_npu._npu_flash_attention_qlens``: see the module docstring."""
    dtypes.check(QLENS, query=query, key_cache=key_cache, value_cache=value_cache, mask=mask)
    if len({query.dtype, key_cache.dtype, value_cache.dtype}) != 1:
        raise ValueError("%s: query, key_cache and value_cache must share one dtype" % QLENS)
    n, nkv = C.as_int(QLENS, "num_heads", num_heads), C.as_int(QLENS, "num_kv_heads", num_kv_heads)
    C.check_heads(QLENS, n, nkv)
    q = _split(query, n, "query")
    k, v = _cache(key_cache, nkv, "key_cache"), _cache(value_cache, nkv, "value_cache")
    if k.shape != v.shape:  # "key,value的shape必须一致" (no separate value head size: mlaVHeadSize is 0)
        raise ValueError("%s: key_cache %s and value_cache %s must have one shape"
                         % (QLENS, tuple(key_cache.shape), tuple(value_cache.shape)))
    d, dk, dv = q.shape[2], k.shape[3], v.shape[3]
    if dk != d:
        raise ValueError("%s: key head size %d != query head size %d" % (QLENS, dk, d))
    block_size = k.shape[1]
    if block_size != BLOCK_SIZE:
        raise ValueError("%s: blockSize=128 is required (blockSize必须设为128), got a cache with block size %d"
                         % (QLENS, block_size))
    if not 0 < d <= MAX_HEAD_SIZE or d % HEAD_ALIGN:
        raise ValueError("%s: head size %d must be in (0, 128] and a multiple of 16" % (QLENS, d))
    _check_mask(mask)
    qlens = _host_lengths("seq_len", seq_len)
    kvlens = _host_lengths("context_lens", context_lens)
    if len(qlens) != len(kvlens):
        raise ValueError("%s: %d seq_len for %d context_lens" % (QLENS, len(qlens), len(kvlens)))
    for b, (sq, skv) in enumerate(zip(qlens, kvlens)):
        if not 0 <= sq <= skv:
            raise ValueError("%s: sequence %d has seq_len %d and context_lens %d (0 <= seq_len <= "
                             "context_lens)" % (QLENS, b, sq, skv))
        if (skv - sq) % PREFIX_ALIGN:
            raise ValueError("%s: sequence %d's prefix (context_lens - seq_len = %d) must be a multiple of "
                             "128 (prefixCacheLen 128对齐)" % (QLENS, b, skv - sq))
    if sum(qlens) != q.shape[0]:
        raise ValueError("%s: seq_len sums to %d, query has %d tokens" % (QLENS, sum(qlens), q.shape[0]))
    if block_table.dtype != torch.int32:
        raise ValueError("%s: block_table must be int32, got %s" % (QLENS, block_table.dtype))
    C.check_block_table(QLENS, block_table, len(qlens), kvlens, block_size, num_blocks=k.shape[0],
                        lengths_name="context_lens")
    if out is None or tuple(out.shape) != tuple(query.shape) or out.dtype != query.dtype:
        raise ValueError("%s: out must be a %s tensor of the query's shape %s, got %s"
                         % (QLENS, query.dtype, tuple(query.shape),
                            None if out is None else (out.dtype, tuple(out.shape))))
    o = out.view(q.shape[0], n, dv)
    start = 0
    for b, (sq, skv) in enumerate(zip(qlens, kvlens)):
        if sq:
            ks = C.PagedRows(k, block_table[b], block_size, skv)
            vs = C.PagedRows(v, block_table[b], block_size, skv)
            attend_segment(q[start:start + sq], ks, vs, o[start:start + sq], scale=float(scale_value),
                           masks=(Band(None, 0, skv - sq),))
        start += sq
