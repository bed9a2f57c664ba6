"""Emulation of ``torch_npu.npu_fusion_attention``.

Documented behaviour implemented (Ascend Extension for PyTorch API reference,
"torch_npu.npu_fusion_attention"; sparse modes from the CANN "sparseMode
introduction"):

* Signature ``(query, key, value, head_num, input_layout, pse=None,
  padding_mask=None, atten_mask=None, scale=1., keep_prob=1.,
  pre_tockens=2147483647, next_tockens=2147483647, inner_precise=0, prefix=None,
  actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
  gen_mask_parallel=True, sync=False, softmax_layout="", sink=None)`` returning 7 values
  (``softmax_layout`` since Ascend Extension for PyTorch 7.2.0, ``sink`` in the
  newest op-plugin); keyword-only ``dropout_mask=None, seed=0, offset=0``, which
  the vendor's op tests pass at these neutral values, are accepted too:
  ``attention_out``, ``softmax_max``, ``softmax_sum``, a reserved tensor, and the
  dropout seed / offset / mask length (ints).
* Layouts BSH, SBH, BSND, BNSD and TND (varlen: ``actual_seq_qlen`` /
  ``actual_seq_kvlen`` are *cumulative* lengths without the leading 0, e.g.
  lengths 2 2 2 -> [2, 4, 6]; a zero-length batch repeats the previous value;
  trailing zeros mark batches that do not take part; at most 1024 batches).
* ``atten_mask``: True / 1 = masked out (the opposite of SDPA's boolean mask).
  Shapes BNSS, B1SS, 11SS, SS; TND accepts only SS of (maxSq, maxSkv), each
  batch reading its top-left (Sq, Skv) block.
* ``atten_mask=None``: ``sparse_mode``, ``pre_tockens`` and ``next_tockens`` have
  no effect; every query attends to every key of its batch (documented: "fixed
  to full computation").
* sparse_mode 0 (defaultMask): the mask, and only positions with
  ``-pre_tockens <= col - row <= next_tockens`` (top-left origin) are computed;
  1 (allMask): the full mask, tokens ignored; 2 (leftUpCausal): ``col <= row``;
  3 (rightDownCausal): ``col <= row + Skv - Sq``; 4 (band): the pre/next band
  anchored at the bottom-right corner. Modes 2, 3, 4 require the compressed
  2048x2048 lower-triangular mask (checked for shape and content).
* GQA: ``N_q / N_kv`` must be a positive integer; ``D_q == D_k`` and
  ``D_k >= D_v`` (the output takes ``D_v``).

Not implemented (NotImplementedError naming the argument): ``pse``,
``padding_mask`` (documented as unsupported), ``prefix``, ``sink``, dropout
(``keep_prob != 1``, a ``dropout_mask``, a non-zero ``seed`` / ``offset``),
sparse modes 5-8, ``actual_seq_*`` outside TND. Integer arguments (``head_num``,
lengths) must be integers (0-d integer tensors and NumPy integers included).
Hardware limits on sizes/alignment are not enforced beyond the ones above.
``softmax_max`` / ``softmax_sum`` are returned as (B, N, Sq, 8) — TND: (N, T, 8),
or (T, N, 8) with ``softmax_layout="TND"`` — float32 views whose last axis
repeats one value (the 8 copies the NPU kernel stores).
"""
import torch

from npu_shim.emulation import _common as C
from npu_shim.emulation._engine import Band, Explicit, attend_segment

OP = "npu_fusion_attention"
LAYOUTS = ("BSH", "SBH", "BSND", "BNSD", "TND")
VARLEN_MAX_BATCH = 1024
MAX_HEAD_DIM = 768
# Arguments torch_npu reads on the host (a device tensor there is a device->host read
# inside the op call, which npu_shim.testing.syncs counts): the API reference types them
# int[]? and describes actual_seq_qlen / actual_seq_kvlen as host-side int64 arrays
# ("Host侧的int64类型的数组"; hiascend.com/document/detail/zh/Pytorch/60RC3/apiref/apilist/ptaoplist_000445.html).
HOST_ARGS = ("actual_seq_qlen", "actual_seq_kvlen")


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None,
                         padding_mask=None, atten_mask=None, scale=1.0, keep_prob=1.0,
                         pre_tockens=C.INT_MAX, next_tockens=C.INT_MAX, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None,
                         sparse_mode=0, gen_mask_parallel=True, sync=False,
                         softmax_layout="", sink=None, *, dropout_mask=None, seed=0, offset=0):
    C.reject_set(OP, pse=pse, padding_mask=padding_mask, prefix=prefix, sink=sink,
                 dropout_mask=dropout_mask)
    if keep_prob != 1.0:
        raise C.not_implemented(OP, "keep_prob", "dropout; only keep_prob=1 is emulated")
    for name, number in (("seed", seed), ("offset", offset)):
        if C.as_int(OP, name, number) != 0:
            raise C.not_implemented(OP, name, "dropout's random stream; only the neutral 0 "
                                              "(with keep_prob=1) is emulated")
    if input_layout not in LAYOUTS:
        raise ValueError("%s: input_layout=%r; documented: %s" % (OP, input_layout, ", ".join(LAYOUTS)))
    if sparse_mode in (5, 6, 7, 8):
        raise C.not_implemented(OP, "sparse_mode", "modes 5-8 (prefix, varlen outer split)")
    if sparse_mode not in (0, 1, 2, 3, 4):
        raise ValueError("%s: sparse_mode=%r is not a documented mode" % (OP, sparse_mode))
    if inner_precise not in (0, 1, 2):
        raise ValueError("%s: inner_precise=%r; documented values are 0, 1, 2" % (OP, inner_precise))
    if softmax_layout not in ("", "TND") or (softmax_layout and input_layout != "TND"):
        raise ValueError("%s: softmax_layout=%r is only valid as 'TND' with input_layout='TND'"
                         % (OP, softmax_layout))
    C.check_float_inputs(OP, query=query, key=key, value=value)
    head_num = C.as_int(OP, "head_num", head_num)
    scale = float(scale)

    if input_layout == "TND":
        return _tnd(query, key, value, head_num, atten_mask, scale, pre_tockens,
                    next_tockens, actual_seq_qlen, actual_seq_kvlen, sparse_mode, softmax_layout)
    if actual_seq_qlen is not None or actual_seq_kvlen is not None:
        raise C.not_implemented(
            OP, "actual_seq_qlen" if actual_seq_qlen is not None else "actual_seq_kvlen",
            "varlen lengths are used with input_layout='TND' only")
    return _batched(query, key, value, head_num, input_layout, atten_mask, scale,
                    pre_tockens, next_tockens, sparse_mode)


def _dims(n, nkv, dq, dk, dv):
    C.check_heads(OP, n, nkv)
    if dq != dk:
        raise ValueError("%s: query and key head dims must be equal (Dq=%d, Dk=%d)" % (OP, dq, dk))
    if dv > dk:
        raise ValueError("%s: documented constraint Dk >= Dv violated (Dk=%d, Dv=%d)" % (OP, dk, dv))
    if dk > MAX_HEAD_DIM:
        raise ValueError("%s: head dim %d exceeds the documented maximum %d" % (OP, dk, MAX_HEAD_DIM))


def _masks(has_mask, mask_seg, sparse_mode, pre, nxt, sq, skv):
    """Mask specs for one batch (see the module docstring)."""
    if not has_mask:
        return ()
    if sparse_mode == 0:
        return (Explicit(mask_seg), Band(C.band_limit(pre), C.band_limit(nxt), 0))
    if sparse_mode == 1:
        return (Explicit(mask_seg),)
    if sparse_mode == 2:
        return (Band(None, 0, 0),)
    if sparse_mode == 3:
        return (Band(None, 0, skv - sq),)
    return (Band(C.band_limit(pre), C.band_limit(nxt), skv - sq),)  # 4


def _prepare_mask(atten_mask, sparse_mode):
    """(has_mask, explicit mask tensor or None). Modes 2-4 only check the
    compressed mask: the pattern itself comes from the mode."""
    if atten_mask is None:
        return False, None
    if sparse_mode in (2, 3, 4):
        C.check_compressed_mask(OP, atten_mask, sparse_mode)
        return True, None
    return True, atten_mask


def _batched(query, key, value, n, layout, atten_mask, scale, pre, nxt, sparse_mode):
    q = C.to_bsnd(OP, query, layout, n, "query")
    b, sq, _, dq = q.shape
    if layout in ("BSH", "SBH"):
        nkv = key.shape[-1] // dq if dq and key.shape[-1] % dq == 0 else 0
        if nkv == 0:
            raise ValueError("%s: key hidden size %d is not a multiple of D=%d" % (OP, key.shape[-1], dq))
        k = C.to_bsnd(OP, key, layout, nkv, "key")
        v = C.to_bsnd(OP, value, layout, nkv, "value")
    else:
        k = C.to_bsnd(OP, key, layout, 0, "key")
        v = C.to_bsnd(OP, value, layout, 0, "value")
    if q.shape[2] != n:
        raise ValueError("%s: head_num=%d but query has %d heads" % (OP, n, q.shape[2]))
    if k.shape[:3] != v.shape[:3] or k.shape[0] != b:
        raise ValueError("%s: key/value batch, length and heads must match query's batch" % OP)
    skv, nkv, dk, dv = k.shape[1], k.shape[2], k.shape[3], v.shape[3]
    _dims(n, nkv, dq, dk, dv)
    has_mask, mask = _prepare_mask(atten_mask, sparse_mode)
    if mask is not None:
        if mask.dim() not in (2, 4) or mask.shape[-2] < sq or mask.shape[-1] < skv:
            raise ValueError(
                "%s: atten_mask shape %s; documented BNSS, B1SS, 11SS or SS covering (%d, %d)"
                % (OP, tuple(mask.shape), sq, skv))
        if mask.dim() == 4 and (mask.shape[0] not in (1, b) or mask.shape[1] not in (1, n)):
            raise ValueError("%s: atten_mask shape %s does not match B=%d, N=%d"
                             % (OP, tuple(mask.shape), b, n))

    out, out_bsnd = C.alloc_out_bsnd(layout, b, sq, n, dv, query)
    stats_max = torch.empty((b, n, sq), dtype=torch.float32, device=query.device)
    stats_sum = torch.empty((b, n, sq), dtype=torch.float32, device=query.device)
    for i in range(b):
        mask_i = None
        if mask is not None:
            mask_i = mask.unsqueeze(0) if mask.dim() == 2 else mask[i if mask.shape[0] > 1 else 0]
        specs = _masks(has_mask, mask_i, sparse_mode, pre, nxt, sq, skv)
        attend_segment(q[i], k[i], v[i], out_bsnd[i], scale=scale, masks=specs,
                       max_out=stats_max[i].transpose(0, 1),
                       sum_out=stats_sum[i].transpose(0, 1))
    return _result(out, stats_max.unsqueeze(-1).expand(b, n, sq, 8),
                   stats_sum.unsqueeze(-1).expand(b, n, sq, 8), query)


def _tnd(query, key, value, n, atten_mask, scale, pre, nxt, cum_q, cum_kv, sparse_mode,
         softmax_layout):
    if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
        raise ValueError("%s: TND expects 3-D (T, N, D) query, key and value" % OP)
    if cum_q is None or cum_kv is None:
        raise ValueError("%s: input_layout='TND' requires actual_seq_qlen and actual_seq_kvlen" % OP)
    t, nq, dq = query.shape
    tk, nkv, dk = key.shape
    if nq != n:
        raise ValueError("%s: head_num=%d but query has %d heads" % (OP, n, nq))
    if value.shape[:2] != key.shape[:2]:
        raise ValueError("%s: key and value must have the same tokens and heads" % OP)
    dv = value.shape[2]
    _dims(n, nkv, dq, dk, dv)
    seg_q = C.cumulative_segments(OP, "actual_seq_qlen", cum_q, t)
    seg_kv = C.cumulative_segments(OP, "actual_seq_kvlen", cum_kv, tk)
    if len(seg_q) != len(seg_kv):
        raise ValueError("%s: actual_seq_qlen has %d batches, actual_seq_kvlen %d"
                         % (OP, len(seg_q), len(seg_kv)))
    if len(seg_q) > VARLEN_MAX_BATCH:
        raise ValueError("%s: %d batches; the documented varlen maximum is %d"
                         % (OP, len(seg_q), VARLEN_MAX_BATCH))
    has_mask, mask = _prepare_mask(atten_mask, sparse_mode)
    if mask is not None:
        max_sq = max((e - s for s, e in seg_q), default=0)
        max_skv = max((e - s for s, e in seg_kv), default=0)
        if mask.dim() != 2 or mask.shape[0] < max_sq or mask.shape[1] < max_skv:
            raise ValueError("%s: with TND, atten_mask must be SS covering (maxSq=%d, maxSkv=%d), "
                             "got %s" % (OP, max_sq, max_skv, tuple(mask.shape)))
        mask = mask.unsqueeze(0)

    out = torch.zeros((t, n, dv), dtype=query.dtype, device=query.device)
    stats_max = torch.full((t, n), float("-inf"), dtype=torch.float32, device=query.device)
    stats_sum = torch.zeros((t, n), dtype=torch.float32, device=query.device)
    for (q0, q1), (k0, k1) in zip(seg_q, seg_kv):
        sq, skv = q1 - q0, k1 - k0
        specs = _masks(has_mask, mask, sparse_mode, pre, nxt, sq, skv)
        attend_segment(query[q0:q1], key[k0:k1], value[k0:k1], out[q0:q1], scale=scale,
                       masks=specs, max_out=stats_max[q0:q1], sum_out=stats_sum[q0:q1])
    if softmax_layout == "TND":
        smax, ssum = stats_max.unsqueeze(-1), stats_sum.unsqueeze(-1)
        return _result(out, smax.expand(t, n, 8), ssum.expand(t, n, 8), query)
    smax, ssum = stats_max.t().unsqueeze(-1), stats_sum.t().unsqueeze(-1)
    return _result(out, smax.expand(n, t, 8), ssum.expand(n, t, 8), query)


def _result(out, softmax_max, softmax_sum, query):
    reserved = torch.empty(0, dtype=query.dtype, device=query.device)
    return out, softmax_max, softmax_sum, reserved, 0, 0, 0
