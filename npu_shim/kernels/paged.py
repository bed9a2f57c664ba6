"""Paged causal prefill attention, the call sglang's context-parallel path makes.

sglang PR 26705 fixed ``do_cp_attn_fia`` for batch > 1: query
tokens packed TND, K/V in the paged cache viewed as
``(num_blocks, block_size, Nkv * D)``, and ``torch.ops.npu.npu_fused_infer_attention_score``
with ``sparse_mode=3`` (causal, query rows aligned to the *end* of each
sequence's KV), ``next_tokens=0``, *cumulative* per-sequence query lengths and
*per-sequence* KV lengths, all as Python ints. :func:`paged_prefill_attention`
is that call, with the lengths validated on the host and the value head dim
allowed to differ from the query/key head dim. The op's own rules stand: TND head
dims 64, 128 or 192 (or 192 / 128) from CANN 8.3, a ``block_size`` that is a multiple
of 16 (npu_shim.emulation.fused_infer_attention).
"""
import functools
import operator

import torch

from npu_shim.kernels import _torch_npu

__all__ = ["paged_prefill_attention", "compressed_causal_mask"]

MASK_SIZE = 2048


@functools.lru_cache(maxsize=8)
def _mask_on(device):
    return torch.ones((MASK_SIZE, MASK_SIZE), dtype=torch.bool, device=device).triu_(1)


def compressed_causal_mask(device):
    """The 2048x2048 compressed lower-triangular mask sparse_mode 3 requires
    (True above the diagonal = masked). A constant; one copy per device."""
    return _mask_on(torch.device(device))


def paged_prefill_attention(q, k_cache, v_cache, *, block_table, block_size, num_heads,
                            num_kv_heads, scale, q_seq_lens, kv_seq_lens, atten_mask=None):
    """Causal attention of packed queries against paged K/V; returns (T, N, Dv).

    q: (T, N, Dqk), the queries of all sequences back to back. k_cache /
    v_cache: any tensors holding (num_blocks, block_size, Nkv, Dqk|Dv) elements
    contiguously (sglang passes (num_blocks * block_size, Nkv, D) buffers); they
    are viewed as (num_blocks, block_size, Nkv * D). block_table: (B, max_blocks)
    int32 block ids per sequence. q_seq_lens / kv_seq_lens: per-sequence lengths
    as host ints (a device tensor is refused: reading it would be a host sync);
    query i of a sequence sees keys 0 .. kv_len - q_len + i. atten_mask: the
    compressed 2048x2048 causal mask, built (once per device) when None.
    """
    q_lens = _host_ints("q_seq_lens", q_seq_lens)
    kv_lens = _host_ints("kv_seq_lens", kv_seq_lens)
    if len(q_lens) != len(kv_lens):
        raise ValueError("q_seq_lens has %d sequences, kv_seq_lens %d" % (len(q_lens), len(kv_lens)))
    for i, (ql, kl) in enumerate(zip(q_lens, kv_lens)):
        if ql < 0 or kl < ql:
            raise ValueError("sequence %d: need 0 <= q_len <= kv_len (queries are the last "
                             "q_len tokens of the sequence), got q_len=%d, kv_len=%d" % (i, ql, kl))
    if q.dim() != 3 or q.shape[1] != num_heads:
        raise ValueError("q must be (T, num_heads=%d, D), got %s" % (num_heads, tuple(q.shape)))
    if sum(q_lens) != q.shape[0]:
        raise ValueError("q_seq_lens sum to %d but q has %d tokens" % (sum(q_lens), q.shape[0]))
    if num_heads % num_kv_heads:
        raise ValueError("num_kv_heads (%d) must divide num_heads (%d)" % (num_kv_heads, num_heads))
    if block_table.dim() != 2 or block_table.shape[0] != len(q_lens):
        raise ValueError("block_table must be (num_sequences=%d, max_blocks), got %s"
                         % (len(q_lens), tuple(block_table.shape)))
    dqk = q.shape[2]
    row = block_size * num_kv_heads
    if k_cache.numel() % (row * dqk):
        raise ValueError("k_cache (%d elements) is not a whole number of (block_size=%d, "
                         "Nkv=%d, D=%d) blocks" % (k_cache.numel(), block_size, num_kv_heads, dqk))
    num_blocks = k_cache.numel() // (row * dqk)
    if num_blocks == 0 or v_cache.numel() % (num_blocks * row):
        raise ValueError("v_cache does not hold the same %d blocks as k_cache" % num_blocks)
    dv = v_cache.numel() // (num_blocks * row)
    k_paged = k_cache.view(num_blocks, block_size, num_kv_heads * dqk)
    v_paged = v_cache.view(num_blocks, block_size, num_kv_heads * dv)
    if atten_mask is None:
        atten_mask = compressed_causal_mask(q.device)
    out, _ = _torch_npu.ops_namespace().npu_fused_infer_attention_score(
        q.contiguous(), k_paged, v_paged,  # the op does not take non-contiguous tensors
        block_table=block_table,
        block_size=block_size,
        num_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        input_layout="TND",
        atten_mask=atten_mask,
        sparse_mode=3,
        next_tokens=0,
        scale=float(scale),
        actual_seq_lengths=_cumulative(q_lens),
        actual_seq_lengths_kv=kv_lens,
    )
    return out


def _cumulative(lengths):
    total, out = 0, []
    for n in lengths:
        total += n
        out.append(total)
    return out


def _host_ints(name, values):
    if isinstance(values, torch.Tensor):
        if values.device.type != "cpu":
            raise ValueError("%s must be host ints (a list); a %s tensor would need a host "
                             "sync to read" % (name, values.device))
        values = values.tolist()
    elif hasattr(values, "tolist"):
        values = values.tolist()
    try:
        return [operator.index(x) for x in values]
    except TypeError:
        raise ValueError("%s must be a sequence of ints, got %r" % (name, values)) from None
