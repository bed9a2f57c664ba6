"""Blockwise softmax attention for one segment, the engine under every emulated op.

Why blockwise: the real NPU kernels never hold a score matrix larger than a tile,
so an emulation that materialised ``(S, S)`` scores (or a mask across segments)
would fail exactly where the seed did (303,548 packed tokens: an 85.8 GiB mask).
Here one call of :func:`attend_segment` keeps its extra memory under a byte bound
(default 256 MiB, ``NPU_SHIM_EMULATE_MEMORY_MIB`` overrides it) whatever the
segment length: queries are processed in row chunks and, when even one row
against the whole key range would not fit, keys in column chunks with an online
(running max / running sum) softmax.

Numerics: inputs of any float dtype are upcast chunk by chunk to float32; scores,
softmax and the weighted sum accumulate in float32; the result is cast to the
output tensor's dtype when written.

Masks are *specs*, not tensors: a spec answers "which positions of rows r0:r1 x
columns c0:c1 are masked" for one chunk at a time (True = masked out, the
torch_npu polarity). Rows with no visible key produce zeros and a log-sum-exp of
-inf (the "invalid row" convention of the NPU ops with row correction enabled).
"""
import math

import torch

DEFAULT_MEMORY_MIB = 256
_F32 = 4  # bytes per float32


def memory_bound_bytes():
    """The per-call byte budget for the emulation's temporaries (read each call)."""
    from npu_shim._config import env_positive_number

    return int(env_positive_number("NPU_SHIM_EMULATE_MEMORY_MIB", DEFAULT_MEMORY_MIB) * (1 << 20))


# --------------------------------------------------------------------------- masks


class Band:
    """Keep positions with ``-pre <= col - (row + offset) <= next``.

    ``offset`` moves the diagonal: 0 anchors it at the top-left corner (torch_npu
    leftUpCausal / defaultMask band), ``Skv - Sq`` at the bottom-right corner
    (rightDownCausal / band mode). ``None`` means unbounded on that side.
    Causal attention is ``Band(None, 0, offset)``.
    """

    __slots__ = ("pre", "next", "offset")

    def __init__(self, pre, next_, offset):
        self.pre = pre
        self.next = next_
        self.offset = offset

    def col_range(self, r0, r1, skv):
        lo = 0 if self.pre is None else max(0, r0 + self.offset - self.pre)
        hi = skv if self.next is None else min(skv, r1 - 1 + self.offset + self.next + 1)
        return lo, max(lo, hi)

    def block(self, r0, r1, c0, c1, device):
        rows = torch.arange(r0, r1, device=device).unsqueeze(1) + self.offset
        cols = torch.arange(c0, c1, device=device).unsqueeze(0)
        rel = cols - rows
        masked = None
        if self.next is not None:
            masked = rel > self.next
        if self.pre is not None:
            before = rel < -self.pre
            masked = before if masked is None else masked | before
        return masked


class Explicit:
    """A user mask for this segment: a tensor viewable as ``(Nm, Sq', Skv')`` with
    ``Nm`` 1 or the number of query heads and ``Sq' >= Sq``, ``Skv' >= Skv``
    (padding beyond the segment is ignored). Non-zero / True = masked out."""

    __slots__ = ("mask",)

    def __init__(self, mask):
        self.mask = mask

    def col_range(self, r0, r1, skv):
        return 0, skv

    def block(self, r0, r1, c0, c1, device):
        part = self.mask[..., r0:r1, c0:c1]
        if part.dtype != torch.bool:
            part = part != 0
        return part.to(device)


def _combined_col_range(specs, r0, r1, skv):
    lo, hi = 0, skv
    for spec in specs:
        a, b = spec.col_range(r0, r1, skv)
        lo, hi = max(lo, a), min(hi, b)
    return lo, max(lo, hi)


def _combined_block(specs, r0, r1, c0, c1, device):
    masked = None
    for spec in specs:
        part = spec.block(r0, r1, c0, c1, device)
        if part is None:
            continue
        masked = part if masked is None else masked | part
    return masked


# --------------------------------------------------------------------- planning


def plan_chunks(sq, skv, num_heads, num_kv_heads, head_dim, v_head_dim, bound=None):
    """(query rows, key columns) per block so one block's temporaries fit ``bound``.

    Accounting, all float32: a key/value column chunk upcast (``kc * Nkv * (D+Dv)``),
    per query row the upcast query, the accumulator, the block product and two
    output staging copies (``N * (D + 4 Dv)``), the running max / sum (``2 N``),
    and three score-sized buffers (scores, probabilities, mask) of ``N * kc`` each.
    """
    bound = memory_bound_bytes() if bound is None else bound
    kv_row = num_kv_heads * (head_dim + v_head_dim) * _F32
    kc = max(1, min(skv, (bound // 4) // max(kv_row, 1)))
    while True:
        per_row = (3 * num_heads * kc + num_heads * (head_dim + 4 * v_head_dim + 2)) * _F32
        room = bound - kc * kv_row
        if room >= per_row or kc == 1:
            break
        kc = max(1, kc // 2)
    qc = max(1, min(max(sq, 1), room // per_row if room > 0 else 1))
    return qc, max(kc, 1)


# ----------------------------------------------------------------------- engine


def attend_segment(q, k, v, out, *, scale, masks=(), lse_out=None, max_out=None,
                   sum_out=None, bound=None, sink=None):
    """Softmax attention of one segment, written into ``out``.

    q: (Sq, N, D); k: (Skv, Nkv, D); v: (Skv, Nkv, Dv); out: (Sq, N, Dv) (any
    strides; written in place). GQA: query head h reads key/value head
    ``h // (N // Nkv)``. ``masks``: specs combined with OR (masked if any masks).
    Optional float32 outputs of shape (Sq, N): ``lse_out`` (log-sum-exp of the
    scaled, masked scores), ``max_out`` / ``sum_out`` (row max and the sum of
    ``exp(score - max)``, the pair torch_npu returns for the backward pass).
    ``sink``: optional (N,) per-query-head logit of a learnable attention sink: one more
    term ``exp(sink_h)`` in every softmax denominator of head h, with no value (the
    row's weights then sum to less than 1). ``max_out`` / ``sum_out`` are refused with it.
    """
    sq, n, d = q.shape
    skv, nkv, dv = v.shape
    if sq == 0:
        return
    groups = n // nkv
    device = out.device
    if sink is not None and (max_out is not None or sum_out is not None):
        raise NotImplementedError("attend_segment: max_out/sum_out with a sink")
    if sink is not None:
        sink = sink.to(device=device, dtype=torch.float32).reshape(nkv, groups, 1, 1)
    if skv == 0 and sink is None:
        out.zero_()
        _fill_empty_rows(lse_out, max_out, sum_out, slice(0, sq))
        return
    qc, kc = plan_chunks(sq, skv, n, nkv, d, dv, bound)
    for r0 in range(0, sq, qc):
        r1 = min(sq, r0 + qc)
        rows = r1 - r0
        c_lo, c_hi = _combined_col_range(masks, r0, r1, skv)
        # (Nkv, G, rows, D): query head h = kvh * G + g
        qb = q[r0:r1].to(torch.float32).reshape(rows, nkv, groups, d).permute(1, 2, 0, 3)
        qb = qb.reshape(nkv, groups * rows, d)
        run_max = torch.full((nkv, groups * rows, 1), -math.inf, device=device)
        run_sum = torch.zeros((nkv, groups * rows, 1), device=device)
        acc = torch.zeros((nkv, groups * rows, dv), device=device)
        for c0 in range(c_lo, c_hi, kc):
            c1 = min(c_hi, c0 + kc)
            kb = k[c0:c1].to(torch.float32).permute(1, 2, 0)  # (Nkv, D, cols)
            vb = v[c0:c1].to(torch.float32).permute(1, 0, 2)  # (Nkv, cols, Dv)
            scores = torch.matmul(qb, kb)
            scores.mul_(scale)
            masked = _combined_block(masks, r0, r1, c0, c1, device)
            if masked is not None:
                # masked: (rows, cols) or (Nm, rows, cols) with Nm in {1, N}
                if masked.dim() == 2:
                    masked = masked.unsqueeze(0).unsqueeze(0)  # (1, 1, rows, cols)
                else:
                    masked = masked.reshape(-1, 1, rows, c1 - c0) if masked.shape[0] == 1 \
                        else masked.reshape(nkv, groups, rows, c1 - c0)
                scores = scores.view(nkv, groups, rows, c1 - c0)
                scores.masked_fill_(masked, -math.inf)
                scores = scores.view(nkv, groups * rows, c1 - c0)
                del masked
            block_max = scores.amax(dim=-1, keepdim=True)
            new_max = torch.maximum(run_max, block_max)
            safe_max = torch.where(torch.isinf(new_max), torch.zeros_like(new_max), new_max)
            scores.sub_(safe_max).exp_()  # probabilities (unnormalised), masked -> 0
            correction = torch.exp(run_max - safe_max)
            run_sum.mul_(correction).add_(scores.sum(dim=-1, keepdim=True))
            acc.mul_(correction).add_(torch.matmul(scores, vb))
            run_max = new_max
            del scores, kb, vb
        if sink is not None:
            # the sink as one more score column whose value row is zero
            s = sink.expand(nkv, groups, rows, 1).reshape(nkv, groups * rows, 1)
            new_max = torch.maximum(run_max, s)
            correction = torch.exp(run_max - new_max)
            run_sum.mul_(correction).add_(torch.exp(s - new_max))
            acc.mul_(correction)
            run_max = new_max
        empty = run_sum == 0
        result = acc / torch.where(empty, torch.ones_like(run_sum), run_sum)
        # (Nkv, G*rows, Dv) -> (rows, N, Dv)
        result = result.reshape(nkv, groups, rows, dv).permute(2, 0, 1, 3).reshape(rows, n, dv)
        out[r0:r1].copy_(result)
        if lse_out is not None or max_out is not None or sum_out is not None:
            _write_stats(run_max, run_sum, empty, nkv, groups, rows, n,
                         lse_out, max_out, sum_out, slice(r0, r1))


def _to_rows_heads(stat, nkv, groups, rows, n):
    return stat.reshape(nkv, groups, rows).permute(2, 0, 1).reshape(rows, n)


def _write_stats(run_max, run_sum, empty, nkv, groups, rows, n, lse_out, max_out,
                 sum_out, where):
    if lse_out is not None:
        lse = run_max + torch.log(torch.where(empty, torch.ones_like(run_sum), run_sum))
        lse = torch.where(empty, torch.full_like(lse, -math.inf), lse)
        lse_out[where].copy_(_to_rows_heads(lse, nkv, groups, rows, n))
    if max_out is not None:
        max_out[where].copy_(_to_rows_heads(run_max, nkv, groups, rows, n))
    if sum_out is not None:
        sum_out[where].copy_(_to_rows_heads(run_sum, nkv, groups, rows, n))


def _fill_empty_rows(lse_out, max_out, sum_out, where):
    if lse_out is not None:
        lse_out[where].fill_(-math.inf)
    if max_out is not None:
        max_out[where].fill_(-math.inf)
    if sum_out is not None:
        sum_out[where].zero_()
