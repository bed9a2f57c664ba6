"""Emulation of ``torch_npu.npu_prompt_flash_attention`` (full / prefill FA).

Documented behaviour implemented (Ascend Extension for PyTorch API reference,
"torch_npu.npu_prompt_flash_attention"):

* Signature ``(query, key, value, *, pse_shift=None, padding_mask=None,
  atten_mask=None, actual_seq_lengths=None, deq_scale1=None, quant_scale1=None,
  deq_scale2=None, quant_scale2=None, quant_offset2=None, num_heads=1,
  scale_value=1.0, pre_tokens=2147473647, next_tokens=0, input_layout="BSH",
  num_key_value_heads=0, actual_seq_lengths_kv=None, sparse_mode=0)`` returning
  one tensor shaped like the query.
* Layouts BSH, BSND, BNSD and BNSD_BSND (BNSD in, BSND out). For BSH the key/value
  heads are ``num_key_value_heads`` (0 = ``num_heads``).
* ``actual_seq_lengths`` / ``actual_seq_lengths_kv``: per-batch valid lengths
  (not cumulative); one value applies to every batch, otherwise the first B
  values are used. Query rows past a batch's valid length are written as zeros.
* ``atten_mask``: True / 1 = masked out; shapes (Sq, Skv), (B|1, Sq, Skv),
  (B|1, 1, Sq, Skv), possibly padded past the sequence lengths.
* sparse_mode 0: with ``atten_mask=None`` nothing is masked and the tokens are
  ignored; with a mask, the mask applies and only the band
  ``-pre_tokens <= col - row <= next_tokens`` is computed. NOTE the defaults
  (pre_tokens=2147473647, next_tokens=0): passing a mask with the default tokens
  therefore yields *causal* attention inside the mask. 1: the full mask
  (required). 2: leftUpCausal, 3: rightDownCausal, 4: band anchored bottom-right;
  2-4 require the compressed 2048x2048 mask.

Not implemented (NotImplementedError naming the argument): ``pse_shift``,
``padding_mask`` (documented as reserved), the int8 quantisation arguments,
value head dim != key head dim (not documented for this op).
"""

from npu_shim.emulation import _common as C
from npu_shim.emulation._engine import Band, Explicit, attend_segment

OP = "npu_prompt_flash_attention"
LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND")
PFA_PRE_TOKENS_DEFAULT = 2147473647
# Arguments torch_npu reads on the host (a device tensor there is a device->host read
# inside the op call, which npu_shim.testing.syncs counts): int[]? in the API reference,
# hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_000171.html.
HOST_ARGS = ("actual_seq_lengths", "actual_seq_lengths_kv")


def npu_prompt_flash_attention(query, key, value, *, pse_shift=None, padding_mask=None,
                               atten_mask=None, actual_seq_lengths=None, deq_scale1=None,
                               quant_scale1=None, deq_scale2=None, quant_scale2=None,
                               quant_offset2=None, num_heads=1, scale_value=1.0,
                               pre_tokens=PFA_PRE_TOKENS_DEFAULT, next_tokens=0,
                               input_layout="BSH", num_key_value_heads=0,
                               actual_seq_lengths_kv=None, sparse_mode=0):
    C.reject_set(OP, pse_shift=pse_shift, padding_mask=padding_mask, deq_scale1=deq_scale1,
                 quant_scale1=quant_scale1, deq_scale2=deq_scale2, quant_scale2=quant_scale2,
                 quant_offset2=quant_offset2)
    if input_layout not in LAYOUTS:
        raise ValueError("%s: input_layout=%r; documented: %s" % (OP, input_layout, ", ".join(LAYOUTS)))
    if sparse_mode not in (0, 1, 2, 3, 4):
        raise ValueError("%s: sparse_mode=%r; only 0-4 are supported by the op" % (OP, sparse_mode))
    C.check_float_inputs(OP, query=query, key=key, value=value)
    n = C.as_int(OP, "num_heads", num_heads)
    nkv = C.as_int(OP, "num_key_value_heads", num_key_value_heads) or n
    C.check_heads(OP, n, nkv)
    in_layout = "BNSD" if input_layout == "BNSD_BSND" else input_layout
    q = C.to_bsnd(OP, query, in_layout, n, "query")
    k = C.to_bsnd(OP, key, in_layout, nkv, "key")
    v = C.to_bsnd(OP, value, in_layout, nkv, "value")
    b, sq, qn, d = q.shape
    skv = k.shape[1]
    if qn != n:
        raise ValueError("%s: num_heads=%d but query has %d heads" % (OP, n, qn))
    if k.shape != v.shape:
        raise C.not_implemented(OP, "value", "value shape must equal key shape for this op")
    if k.shape[0] != b or k.shape[2] != nkv or k.shape[3] != d:
        raise ValueError("%s: key shape %s does not match query (B=%d, Nkv=%d, D=%d)"
                         % (OP, tuple(key.shape), b, nkv, d))
    q_lens = C.per_batch_lengths(OP, "actual_seq_lengths", actual_seq_lengths, b, sq)
    kv_lens = C.per_batch_lengths(OP, "actual_seq_lengths_kv", actual_seq_lengths_kv, b, skv)

    mask = atten_mask
    if sparse_mode in (2, 3, 4):
        C.check_compressed_mask(OP, mask, sparse_mode)
        mask = None
    elif sparse_mode == 1 and mask is None:
        raise ValueError("%s: sparse_mode=1 (allMask) requires the full atten_mask" % OP)
    if mask is not None:
        if mask.dim() not in (2, 3, 4) or mask.shape[-2] < sq or mask.shape[-1] < skv:
            raise ValueError("%s: atten_mask shape %s does not cover (Sq=%d, Skv=%d)"
                             % (OP, tuple(mask.shape), sq, skv))
        if mask.dim() >= 3 and mask.shape[0] not in (1, b):
            raise ValueError("%s: atten_mask batch %d is neither 1 nor B=%d" % (OP, mask.shape[0], b))
        if mask.dim() == 4 and mask.shape[1] != 1:
            raise ValueError("%s: 4-D atten_mask must be (B, 1, Sq, Skv)" % OP)

    out, out_bsnd = C.alloc_out_bsnd(input_layout, b, sq, n, d, query)
    for i in range(b):
        specs = _specs(mask, i, sparse_mode, pre_tokens, next_tokens, q_lens[i], kv_lens[i])
        ql, kl = q_lens[i], kv_lens[i]
        attend_segment(q[i, :ql], k[i, :kl], v[i, :kl], out_bsnd[i, :ql], scale=float(scale_value),
                       masks=specs)
        if ql < sq:
            out_bsnd[i, ql:].zero_()
    return out


def _specs(mask, i, sparse_mode, pre, nxt, sq, skv):
    if sparse_mode == 2:
        return (Band(None, 0, 0),)
    if sparse_mode == 3:
        return (Band(None, 0, skv - sq),)
    if sparse_mode == 4:
        return (Band(C.band_limit(pre), C.band_limit(nxt), skv - sq),)
    if mask is None:
        return ()  # sparse_mode 0 without a mask: tokens ignored
    if mask.dim() == 2:
        seg = mask.unsqueeze(0)
    else:
        seg = mask[i if mask.shape[0] > 1 else 0]
        if seg.dim() == 3:
            seg = seg[0]
        seg = seg.unsqueeze(0)
    if sparse_mode == 1:
        return (Explicit(seg),)
    return (Explicit(seg), Band(C.band_limit(pre), C.band_limit(nxt), 0))
