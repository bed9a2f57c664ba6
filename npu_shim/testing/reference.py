"""Float64 reference attention, written from the definition of softmax attention.

Every numerical claim of the project is checked against this module, never
against the code under test; it therefore shares nothing with the emulation
(no helpers, no chunked online softmax, no mask specs). Per segment and per
head it forms the full score rows in float64:

    s_ij = scale * <q_i, k_j>          for the keys j query i may see
    p_ij = exp(s_ij - max_j s_ij) / sum_j exp(s_ij - max_j s_ij)
    out_i = sum_j p_ij v_j
    lse_i = log(sum_j exp(s_ij))

A query that may see no key gets out_i = 0 and lse_i = -inf.

Learnable sinks (``sinks``, one logit per query head): the softmax denominator of head h
gets one more term exp(sink_h), which no value row goes with:

    p_ij = exp(s_ij) / (exp(sink_h) + sum_j exp(s_ij))

(computed against m = max(sink_h, max_j s_ij)); lse_i is then log(exp(sink_h) + sum_j exp(s_ij)).

Segments: queries ``cu_seqlens_q[s]:cu_seqlens_q[s+1]`` attend to keys
``cu_seqlens_kv[s]:cu_seqlens_kv[s+1]`` only. GQA: query head h reads key/value
head ``h // (N // Nkv)``. ``causal=True`` aligns the queries to the *end* of
their segment's keys: query i (0-based) of a segment with Sq queries and Skv
keys sees keys 0 .. i + Skv - Sq.
"""
import math

import torch

__all__ = ["attention_f64", "dense_segments", "mrope_f64"]

_ROW_BUDGET_BYTES = 64 << 20


def _host_list(values, name):
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().tolist()
    values = [int(x) for x in values]
    if not values or values[0] != 0 or any(b < a for a, b in zip(values, values[1:])):
        raise ValueError("%s must start at 0 and never decrease, got %r" % (name, values))
    return values


def attention_f64(q, k, v, cu_seqlens_q, cu_seqlens_kv=None, *, scale=None, causal=False,
                  allowed=None, return_lse=False, sinks=None):
    """Reference attention over packed segments, in float64 on the CPU.

    Args:
        q: (Tq, N, D); k: (Tkv, Nkv, D); v: (Tkv, Nkv, Dv), any float dtype/device.
        cu_seqlens_q: segment boundaries of q with the leading 0 (ints or tensor).
        cu_seqlens_kv: the same for k/v; default: ``cu_seqlens_q``.
        scale: default ``D ** -0.5``.
        causal: end-aligned causal mask (see module docstring).
        allowed: optional ``f(segment, sq, skv) -> bool tensor`` of shape
            (sq, skv) or (N, sq, skv); True = may attend. Combined with ``causal``
            by AND. Lets a test spell out any documented mask pattern.
        return_lse: also return the (Tq, N) float64 log-sum-exp.
        sinks: optional (N,) sink logit per query head (see module docstring).

    Returns: (Tq, N, Dv) float64 [, (Tq, N) float64].
    """
    cq = _host_list(cu_seqlens_q, "cu_seqlens_q")
    ckv = cq if cu_seqlens_kv is None else _host_list(cu_seqlens_kv, "cu_seqlens_kv")
    if len(cq) != len(ckv):
        raise ValueError("q has %d segments, kv %d" % (len(cq) - 1, len(ckv) - 1))
    q = q.detach().to("cpu", torch.float64)
    k = k.detach().to("cpu", torch.float64)
    v = v.detach().to("cpu", torch.float64)
    tq, n, d = q.shape
    nkv = k.shape[1]
    if n % nkv or v.shape[1] != nkv or k.shape[0] != v.shape[0] or k.shape[2] != d:
        raise ValueError("inconsistent shapes q%s k%s v%s" % (tuple(q.shape), tuple(k.shape),
                                                              tuple(v.shape)))
    if cq[-1] > tq or ckv[-1] > k.shape[0]:
        raise ValueError("segment boundaries exceed the tensors")
    scale = d ** -0.5 if scale is None else float(scale)
    group = n // nkv
    if sinks is not None:
        sinks = torch.as_tensor(sinks).detach().to("cpu", torch.float64).reshape(-1)
        if sinks.shape[0] != n:
            raise ValueError("sinks has %d values for %d query heads" % (sinks.shape[0], n))
    out = torch.zeros((tq, n, v.shape[2]), dtype=torch.float64)
    lse = torch.full((tq, n), -math.inf, dtype=torch.float64)
    for seg in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[seg], cq[seg + 1], ckv[seg], ckv[seg + 1]
        sq, skv = q1 - q0, k1 - k0
        if sq == 0 or skv == 0:
            continue
        visible = torch.ones((sq, skv), dtype=torch.bool)
        if causal:
            rows = torch.arange(sq).unsqueeze(1)
            cols = torch.arange(skv).unsqueeze(0)
            visible &= cols <= rows + (skv - sq)
        extra = allowed(seg, sq, skv) if allowed is not None else None
        rows_per_chunk = max(1, _ROW_BUDGET_BYTES // (8 * skv))
        for h in range(n):
            kh = k[k0:k1, h // group]
            vh = v[k0:k1, h // group]
            vis_h = visible if extra is None else visible & (extra[h] if extra.dim() == 3 else extra)
            for r0 in range(0, sq, rows_per_chunk):
                r1 = min(sq, r0 + rows_per_chunk)
                scores = scale * (q[q0 + r0:q0 + r1, h] @ kh.T)
                scores.masked_fill_(~vis_h[r0:r1], -math.inf)
                row_max = scores.amax(dim=1, keepdim=True)
                seen = torch.isfinite(row_max)
                row_max = torch.where(seen, row_max, torch.zeros_like(row_max))
                if sinks is not None:
                    row_max = torch.where(seen, torch.maximum(row_max, sinks[h]),
                                          sinks[h].expand_as(row_max))
                weights = scores.sub_(row_max).exp_()          # exp(-inf) = 0 where hidden
                total = weights.sum(dim=1, keepdim=True)
                if sinks is not None:
                    total = total + torch.exp(sinks[h] - row_max)
                    seen = torch.ones_like(seen)               # the sink is always seen
                total = torch.where(seen, total, torch.ones_like(total))
                out[q0 + r0:q0 + r1, h] = (weights @ vh) / total * seen
                lse[q0 + r0:q0 + r1, h] = torch.where(
                    seen, row_max + torch.log(total), torch.full_like(total, -math.inf)).squeeze(1)
    return (out, lse) if return_lse else out


def dense_segments(lengths):
    """Cumulative boundaries (with the leading 0) of segments with these lengths."""
    cum = [0]
    for n in lengths:
        cum.append(cum[-1] + int(n))
    return cum


def mrope_f64(positions, x, head_size, rotary_dim, base, mrope_section):
    """Multimodal rotary (M-RoPE, Qwen2-VL) of ``x`` (T, heads * head_size) in float64, from the
    definition: frequency ``j`` (0 <= j < rotary_dim / 2) turns by ``p * base ** (-2 j / rotary_dim)``
    where ``p`` is the position of row ``r(j)`` of ``positions`` (3, T): row 0 (time) for the first
    ``mrope_section[0]`` frequencies, row 1 (height) for the next ``mrope_section[1]``, row 2
    (width) for the rest. 1-D positions (T,) are one row for every frequency. Neox pairs
    ``(j, j + rotary_dim / 2)`` of each head are rotated: ``(a, b) -> (a cos - b sin, b cos + a sin)``;
    the dims past ``rotary_dim`` pass through. Returns float64 (T, heads * head_size)."""
    half = rotary_dim // 2
    pos = torch.as_tensor(positions).to("cpu", torch.float64)
    rows = pos.reshape(1, -1) if pos.dim() == 1 else pos
    if rows.dim() == 2 and rows.shape[0] != 1 and (len(mrope_section) != rows.shape[0] or sum(mrope_section) != half):
        raise ValueError("mrope_f64: mrope_section %s must have one entry per positions row (%d) summing to %d"
                         % (list(mrope_section), rows.shape[0], half))
    owner = [0] * half if rows.shape[0] == 1 else [r for r, n in enumerate(mrope_section) for _ in range(n)]
    tokens = rows.shape[1]
    out = x.to("cpu", torch.float64).reshape(tokens, -1, head_size).clone()
    for t in range(tokens):
        for j in range(half):
            angle = float(rows[owner[j], t]) * base ** (-2.0 * j / rotary_dim)
            c, s = math.cos(angle), math.sin(angle)
            a, b = out[t, :, j].clone(), out[t, :, j + half].clone()
            out[t, :, j], out[t, :, j + half] = a * c - b * s, b * c + a * s
    return out.reshape(tokens, -1)
