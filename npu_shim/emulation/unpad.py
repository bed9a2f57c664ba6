"""Emulation of ``torch_npu._npu_flash_attention_unpad`` (ATB self-attention,
PA_ENCODER, the op vllm-ascend's ViT encoder uses on every device up to 0.15 and
the only varlen path on 310P), and of ``torch_npu._npu_flash_attention`` (the same ATB
operation with a NORM mask: vllm-ascend 0.30's 310P decoder prefill,
``vllm_ascend/_310p/attention/attention_v1.py``; documented at :func:`_npu_flash_attention`).

Documented behaviour implemented (vllm-ascend's call sites and the ATB
SelfAttention "constraints" page):

* ``(query, key, value, seq_len, scale_value, num_heads, num_kv_heads, out)``;
  query (T, N, D) or (T, N*D), key/value (T, Nkv, D) or 2-D; writes ``out``
  (T, N, Dv) in place and returns nothing.
* ``seq_len``: the per-segment lengths (not cumulative) as a *host* tensor —
  vllm-ascend copies ``cu_seqlens`` to the CPU because the op breaks with a
  device tensor; the emulation refuses a non-CPU ``seq_len``, and
  ``npu_shim.testing.syncs`` counts a device stand-in there as a device->host
  read (see ``HOST_ARGS``). The tokens of all segments sum to T.
* No mask: each segment attends to itself only (non-causal, block diagonal).
* GQA when ``num_heads > num_kv_heads``.
* On an emulated 310P (``NPU_SHIM_EMULATE_SOC=Ascend310P*``): head sizes must be
  multiples of 16, the value head size must equal the key head size, and
  0 < batch <= 2000.
"""
import torch

from npu_shim.emulation import _common as C
from npu_shim.emulation import dtypes, formats, soc
from npu_shim.emulation._engine import Explicit, attend_segment

OP = "_npu_flash_attention_unpad"
MAX_BATCH_310P = 2000
# Arguments torch_npu reads on the host, so a device tensor there is a device->host
# read inside the op call (npu_shim.testing.syncs counts it). ATB's PA_ENCODER
# self-attention takes the per-segment lengths as a host tensor: "seqLenHost ...
# host侧tensor值" in the CANN ATB fa_pa_encoder demo
# (hiascend.com/document/detail/zh/CANNCommunityEdition/82RC1alpha001/API/ascendtbapi/ascendtb_01_0271.html).
HOST_ARGS = ("seq_len",)


def _npu_flash_attention_unpad(query, key, value, seq_len, scale_value, num_heads,
                               num_kv_heads, out):
    C.check_float_inputs(OP, query=query, key=key, value=value)
    n, nkv = C.as_int(OP, "num_heads", num_heads), C.as_int(OP, "num_kv_heads", num_kv_heads)
    C.check_heads(OP, n, nkv)
    q = query if query.dim() == 3 else C.split_hidden(OP, query, n, "query")
    k = key if key.dim() == 3 else C.split_hidden(OP, key, nkv, "key")
    v = value if value.dim() == 3 else C.split_hidden(OP, value, nkv, "value")
    if q.shape[1] != n:
        raise ValueError("%s: num_heads=%d but query has %d heads" % (OP, n, q.shape[1]))
    if k.shape[1] != nkv or v.shape[1] != nkv:
        raise ValueError("%s: num_kv_heads=%d but key/value have %d/%d heads"
                         % (OP, nkv, k.shape[1], v.shape[1]))
    t, _, d = q.shape
    if k.shape[0] != t or v.shape[0] != t or k.shape[2] != d:
        raise ValueError("%s: key/value must be (T=%d, Nkv, D=%d)" % (OP, t, d))
    dv = v.shape[2]
    if isinstance(seq_len, torch.Tensor) and seq_len.device.type != "cpu":
        raise ValueError("%s: seq_len must be a host (CPU) tensor, got one on %s"
                         % (OP, seq_len.device))
    lengths = C.host_ints(seq_len, OP, "seq_len")
    if any(x < 0 for x in lengths) or sum(lengths) != t:
        raise ValueError("%s: seq_len %r must be non-negative lengths summing to T=%d"
                         % (OP, lengths, t))
    if soc.is_310p():
        if d % 16 or dv % 16:
            raise ValueError("%s: on %s (310P) head sizes must be multiples of 16, got D=%d, Dv=%d"
                             % (OP, soc.soc_name(), d, dv))
        if d != dv:
            raise ValueError("%s: on %s (310P) the value head size must equal the key head size"
                             % (OP, soc.soc_name()))
        if not 0 < len(lengths) <= MAX_BATCH_310P:
            raise ValueError("%s: on 310P the batch must be in 1..%d, got %d"
                             % (OP, MAX_BATCH_310P, len(lengths)))
    o = out if out.dim() == 3 else C.split_hidden(OP, out, n, "out")
    if tuple(o.shape) != (t, n, dv):
        raise ValueError("%s: out has shape %s, expected (%d, %d, %d)"
                         % (OP, tuple(out.shape), t, n, dv))
    start = 0
    for length in lengths:
        end = start + length
        attend_segment(q[start:end], k[start:end], v[start:end], o[start:end],
                       scale=float(scale_value))
        start = end


MASKED_OP = "_npu_flash_attention"
MASKED_HOST_ARGS = ("seq_len",)   # the same PA_ENCODER host lengths
_ALIGN_310P = 16


def _npu_flash_attention(query, key, value, mask, seq_len, scale_value, num_heads, num_kv_heads, out):
    """``torch_npu._npu_flash_attention(query, key, value, mask, seq_len, scale_value, num_heads,
    num_kv_heads, out)``: ATB SelfAttentionOperation as op-plugin's ``atb/SelfAttentionAtb.cpp`` sets it
    (calcType PA_ENCODER, maskType MASK_TYPE_NORM, kernel default, no clamp, qScale 1, qkScale
    ``scale_value``, layout BSND), writing ``out`` in place.

    From the ATB SelfAttentionOperation page (CANN 8.0.RC2 API reference, 约束): each segment of
    ``seq_len`` (host lengths, as for the unpad op) attends within itself, q_seq_len = kv_seq_len; the
    mask is added to the scaled scores (NORM); its accepted shapes are [maxSeqLen, maxSeqLen] (one for
    every segment) and [batch, maxSeqLen, maxSeqLen] (one per segment), each segment reading its
    top-left [L, L]; on 310P ("Atlas 推理系列产品") the mask may come as FRACTAL_NZ, read as
    :func:`npu_shim.emulation.formats.nz_to_nd` says; GQA with num_heads % num_kv_heads == 0 and head
    size in (0, 256]; on 310P "PA_ENCODER下为所有batch的seq_len之和向上对齐到16的整数倍": the query may
    carry up to the rounding's padding rows past the segments, which are not written. Not emulated
    (NotImplementedError naming it): mask values other than 0 and -inf (ALIBI-like or finite
    additive masks), the [batch, 1, maxSeqLen] vector mask, an NZ mask on A2.
    """
    C.check_float_inputs(MASKED_OP, query=query, key=key, value=value)
    if not isinstance(mask, torch.Tensor):
        raise TypeError("%s: mask must be a tensor (maskType NORM), got %s" % (MASKED_OP, type(mask).__name__))
    if mask.dtype != query.dtype:
        # the math-check switch lets float32 stand for float16; the mask keeps the model's half dtype
        if not dtypes.stands_in(query.dtype, mask.dtype):
            raise ValueError("%s: mask dtype %s differs from query dtype %s" % (MASKED_OP, mask.dtype, query.dtype))
    else:
        dtypes.check(MASKED_OP, mask=mask)
    n, nkv = C.as_int(MASKED_OP, "num_heads", num_heads), C.as_int(MASKED_OP, "num_kv_heads", num_kv_heads)
    C.check_heads(MASKED_OP, n, nkv)
    q = query if query.dim() == 3 else C.split_hidden(MASKED_OP, query, n, "query")
    k = key if key.dim() == 3 else C.split_hidden(MASKED_OP, key, nkv, "key")
    v = value if value.dim() == 3 else C.split_hidden(MASKED_OP, value, nkv, "value")
    if q.shape[1] != n or k.shape[1] != nkv or v.shape[1] != nkv:
        raise ValueError("%s: num_heads=%d / num_kv_heads=%d but query/key/value have %d/%d/%d heads"
                         % (MASKED_OP, n, nkv, q.shape[1], k.shape[1], v.shape[1]))
    t, _, d = q.shape
    if k.shape[0] != t or v.shape[0] != t or k.shape[2] != d or v.shape[2] != d:
        raise ValueError("%s: key/value must be (T=%d, Nkv, D=%d)" % (MASKED_OP, t, d))
    if not 0 < d <= 256:
        raise ValueError("%s: head size %d outside (0, 256]" % (MASKED_OP, d))
    if isinstance(seq_len, torch.Tensor) and seq_len.device.type != "cpu":
        raise ValueError("%s: seq_len must be a host (CPU) tensor, got one on %s" % (MASKED_OP, seq_len.device))
    lengths = C.host_ints(seq_len, MASKED_OP, "seq_len")
    total = sum(lengths)
    if any(x < 0 for x in lengths):
        raise ValueError("%s: seq_len %r has a negative length" % (MASKED_OP, lengths))
    if soc.is_310p():
        if not 0 < len(lengths) <= MAX_BATCH_310P:
            raise ValueError("%s: on 310P the batch must be in 1..%d, got %d" % (MASKED_OP, MAX_BATCH_310P, len(lengths)))
        if not total <= t <= -(-total // _ALIGN_310P) * _ALIGN_310P:
            raise ValueError("%s: on %s (310P) the query rows T=%d must be sum(seq_len)=%d rounded up to at most "
                             "a multiple of 16" % (MASKED_OP, soc.soc_name(), t, total))
    elif total != t:
        raise ValueError("%s: seq_len %r must sum to T=%d" % (MASKED_OP, lengths, t))
    masks = _nd_masks(mask, len(lengths), max(lengths, default=0))
    o = out if out.dim() == 3 else C.split_hidden(MASKED_OP, out, n, "out")
    if tuple(o.shape) != (t, n, d):
        raise ValueError("%s: out has shape %s, expected (%d, %d, %d)" % (MASKED_OP, tuple(out.shape), t, n, d))
    start = 0
    for i, length in enumerate(lengths):
        end = start + length
        masked = masks[0 if masks.shape[0] == 1 else i][:length, :length]
        attend_segment(q[start:end], k[start:end], v[start:end], o[start:end], scale=float(scale_value),
                       masks=(Explicit(masked),))
        start = end


def _nd_masks(mask, batch, longest):
    """(1 or batch, S, S) booleans, True = masked out (a -inf entry), from the op's mask argument."""
    if formats.acl_format_of(mask) == formats.NZ:
        if not soc.is_310p():
            raise NotImplementedError("%s: a FRACTAL_NZ mask on %s (A2) is not emulated" % (MASKED_OP, soc.soc_name()))
        nd = formats.nz_to_nd(MASKED_OP, "mask", mask).unsqueeze(0)
    elif mask.dim() == 2:
        nd = mask.unsqueeze(0)
    elif mask.dim() == 3 and mask.shape[1] == 1:
        raise NotImplementedError("%s: the [batch, 1, maxSeqLen] vector mask is not emulated" % MASKED_OP)
    elif mask.dim() == 3 and mask.shape[0] == batch:
        nd = mask
    else:
        raise ValueError("%s: mask of shape %s is none of [maxSeqLen, maxSeqLen], [batch=%d, maxSeqLen, maxSeqLen]"
                         % (MASKED_OP, tuple(mask.shape), batch))
    if nd.shape[1] < longest or nd.shape[2] < longest:
        raise ValueError("%s: mask %s is smaller than the longest segment (%d)"
                         % (MASKED_OP, tuple(nd.shape[1:]), longest))
    rows = nd[:, :longest, :longest]
    minus_inf = torch.isinf(rows) & (rows < 0)
    if not bool(((rows == 0) | minus_inf).all()):
        raise NotImplementedError("%s: mask values other than 0 and -inf (a finite additive mask) are not emulated"
                                  % MASKED_OP)
    return minus_inf
