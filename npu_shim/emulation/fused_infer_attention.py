"""Emulation of ``torch_npu.npu_fused_infer_attention_score`` (FIA) and
``torch_npu.npu_incre_flash_attention`` (IFA, paged decode).

Documented behaviour implemented (Ascend Extension for PyTorch API reference,
"torch_npu.npu_fused_infer_attention_score" and
"torch_npu.npu_incre_flash_attention"):

FIA
* Returns ``(attention_out, softmax_lse)``. ``attention_out`` has the query's
  shape with the value's head dim. ``softmax_lse`` (float32) is (B, N, Sq, 1),
  or (T, N, 1) for TND, when ``softmax_lse_flag=True``; otherwise a one-element
  zero tensor.
* Layouts BSH, BSND, BNSD, BNSD_BSND and TND. TND: ``actual_seq_lengths`` is
  required and *cumulative* (its length is the batch), and its last element must be
  the query's token count T (the real op: "queryT(...) must be equal to the last
  element of actualSequenceLengthQ"); without paging
  ``actual_seq_lengths_kv`` is cumulative too. With paged KV
  (``block_table``), ``actual_seq_lengths_kv`` holds each sequence's own KV
  length (this is how sglang's context-parallel path calls it: cumulative query
  lengths, per-sequence KV lengths).
* Paged KV: ``block_table`` (B, max_blocks) int32 block ids, ``block_size``;
  caches (num_blocks, block_size, H) or, for BNSD/TND queries,
  (num_blocks, Nkv, block_size, D). ``actual_seq_lengths_kv`` is required.
* Query S == 1 in batch layouts takes the incremental (IFA) branch:
  ``sparse_mode``, ``pre_tokens`` and ``next_tokens`` have no effect.
* sparse_mode 0: no mask -> no masking, tokens ignored; mask -> mask plus the
  pre/next band (top-left origin). 1: full mask. 2: leftUpCausal,
  3: rightDownCausal (query rows aligned to the *end* of the KV sequence),
  4: band anchored bottom-right (keys ``diag - pre_tokens .. diag + next_tokens``, both ends
  included: pre_tokens=W, next_tokens=0 admits W + 1 keys; the page's words and the worked
  examples that fix it are quoted in decoder_attention.py's module docstring); 2-4 require the
  compressed 2048x2048 mask.
  TND supports only sparse_mode 0 without a mask or 3 with the mask.
* GQA via ``num_key_value_heads`` (0 = ``num_heads``), ratio <= 64.
* Value head dim != key head dim is accepted with TND (documented there, e.g.
  Dqk=192 / Dv=128); other layouts require equal key/value shapes.
* TND head dims, by the emulated CANN release (``NPU_SHIM_EMULATE_CANN``,
  npu_shim.emulation.soc; default 8.5.0): from CANN 8.3 query, key and value
  share D in {64, 128, 192}, or Dqk = 192 with Dv = 128. CANN's own message, quoted
  in vllm-ascend PR #9632: "When layout is TND, queryD(256), keyD(256) and
  valueD(256) must be same equal 192/128/64, or queryD and keyD equal 192 and
  valueD equal 128"; FlagOS sglang-plugin-FL (``patches/vision.py``) states the same
  set for CANN 8.5, where a head-72 vision tower fails on sglang 0.5.18 (vllm-ascend
  pads 64 < D < 128 to 128 for this op). Before CANN 8.3 TND took Dqk = 192 only
  (Dv 192 or 128): the message vllm-ascend issue #8045 quotes ("When layout is TND,
  queryD(128) or keyD(128) must be 192, valueD(128) must be 192/128!"), which its
  reporter matched to the torch_npu 7.1.0 reference (CANN 8.2.RC1) against 7.2.0's.
* Paged KV: ``block_size`` a multiple of 16 (no quantisation): "In NO_QUANT
  situation, block_size should aligned to 16, but got 1" (sglang issue #25169,
  aclnnFusedInferAttentionScoreV4; sglang PR #29815 validates ``page_size % 16``
  for FIA on that evidence).

IFA
* Query S must be 1: BSH (B, 1, H), BSND (B, 1, N, D), BNSD (B, N, 1, D); the
  output has the query's shape. ``actual_seq_lengths`` are per-batch KV lengths
  (one value = all batches), required with ``block_table``; paged caches as for
  FIA, the 4-D one only with BNSD queries. ``atten_mask`` (B, Skv), (B, 1, Skv)
  or (B, 1, 1, Skv), True = masked.

Not implemented (NotImplementedError naming the argument): ``pse_shift``,
``padding_mask``, every (de/anti)quantisation input, ``query_padding_size`` /
``kv_padding_size`` (left padding), shared prefixes, ``query_rope`` /
``key_rope`` (MLA), non-zero antiquant modes, sparse modes 5-8.
"""
import torch

from npu_shim.emulation import _common as C
from npu_shim.emulation import soc
from npu_shim.emulation._engine import Band, Explicit, attend_segment

FIA = "npu_fused_infer_attention_score"
IFA = "npu_incre_flash_attention"
FIA_LAYOUTS = ("BSH", "BSND", "BNSD", "BNSD_BSND", "TND")
IFA_LAYOUTS = ("BSH", "BSND", "BNSD")
MAX_GQA_RATIO = 64
# TND head dims by CANN release (module docstring): from TND_WIDE_SINCE these, or Dqk 192 / Dv 128
TND_HEAD_DIMS = (64, 128, 192)
TND_WIDE_SINCE = (8, 3)
FIA_BLOCK_ALIGN = 16     # paged KV, no quantisation
# Arguments torch_npu reads on the host (a device tensor there is a device->host read
# inside the op call, which npu_shim.testing.syncs counts). FIA: SymInt[]? in the API
# reference (hiascend.com/document/detail/zh/Pytorch/700/apiref/apilist/ptaoplist_001232.html);
# TorchAir's guide says these lengths are copied host->device for tiling and only its
# tiling-sink graph mode takes a device tensor
# (hiascend.com/document/detail/zh/Pytorch/710/modthirdparty/torchairuseguide/torchair_00086.html).
# IFA: "actual_seq_lengths: Host侧的Input数组"
# (hiascend.com/document/detail/zh/Pytorch/60RC1/apiref/apilist/ptaoplist_000451.html).
FIA_HOST_ARGS = ("actual_seq_lengths", "actual_seq_lengths_kv")
IFA_HOST_ARGS = ("actual_seq_lengths",)


def npu_fused_infer_attention_score(
        query, key, value, *, pse_shift=None, atten_mask=None, actual_seq_lengths=None,
        actual_seq_lengths_kv=None, dequant_scale1=None, quant_scale1=None,
        dequant_scale2=None, quant_scale2=None, quant_offset2=None, antiquant_scale=None,
        antiquant_offset=None, block_table=None, query_padding_size=None,
        kv_padding_size=None, key_antiquant_scale=None, key_antiquant_offset=None,
        value_antiquant_scale=None, value_antiquant_offset=None, key_shared_prefix=None,
        value_shared_prefix=None, actual_shared_prefix_len=None, query_rope=None,
        key_rope=None, key_rope_antiquant_scale=None, num_heads=1, scale=1.0,
        pre_tokens=C.INT_MAX, next_tokens=C.INT_MAX, input_layout="BSH",
        num_key_value_heads=0, sparse_mode=0, inner_precise=0, block_size=0,
        antiquant_mode=0, softmax_lse_flag=False, key_antiquant_mode=0,
        value_antiquant_mode=0):
    C.reject_set(FIA, pse_shift=pse_shift, dequant_scale1=dequant_scale1,
                 quant_scale1=quant_scale1, dequant_scale2=dequant_scale2,
                 quant_scale2=quant_scale2, quant_offset2=quant_offset2,
                 antiquant_scale=antiquant_scale, antiquant_offset=antiquant_offset,
                 query_padding_size=query_padding_size, kv_padding_size=kv_padding_size,
                 key_antiquant_scale=key_antiquant_scale,
                 key_antiquant_offset=key_antiquant_offset,
                 value_antiquant_scale=value_antiquant_scale,
                 value_antiquant_offset=value_antiquant_offset,
                 key_shared_prefix=key_shared_prefix, value_shared_prefix=value_shared_prefix,
                 actual_shared_prefix_len=actual_shared_prefix_len, query_rope=query_rope,
                 key_rope=key_rope, key_rope_antiquant_scale=key_rope_antiquant_scale)
    for name, val in (("antiquant_mode", antiquant_mode), ("key_antiquant_mode", key_antiquant_mode),
                      ("value_antiquant_mode", value_antiquant_mode)):
        if val:
            raise C.not_implemented(FIA, name)
    if input_layout not in FIA_LAYOUTS:
        raise ValueError("%s: input_layout=%r; emulated: %s" % (FIA, input_layout, ", ".join(FIA_LAYOUTS)))
    if sparse_mode in (5, 6, 7, 8):
        raise C.not_implemented(FIA, "sparse_mode", "modes 5-8 are documented as unsupported")
    if sparse_mode not in (0, 1, 2, 3, 4):
        raise ValueError("%s: sparse_mode=%r is not a documented mode" % (FIA, sparse_mode))
    if inner_precise not in (0, 1, 2, 3):
        raise ValueError("%s: inner_precise=%r; documented values are 0-3" % (FIA, inner_precise))
    C.check_float_inputs(FIA, query=query, key=key, value=value)
    n = C.as_int(FIA, "num_heads", num_heads)
    nkv = C.as_int(FIA, "num_key_value_heads", num_key_value_heads) or n
    block_size = C.as_int(FIA, "block_size", block_size)
    C.check_heads(FIA, n, nkv, MAX_GQA_RATIO)
    scale = float(scale)
    if input_layout == "TND":
        return _fia_tnd(query, key, value, n, nkv, atten_mask, actual_seq_lengths,
                        actual_seq_lengths_kv, block_table, block_size, scale, sparse_mode,
                        softmax_lse_flag)
    return _fia_batched(query, key, value, n, nkv, atten_mask, actual_seq_lengths,
                        actual_seq_lengths_kv, block_table, block_size, scale, pre_tokens,
                        next_tokens, input_layout, sparse_mode, softmax_lse_flag)


def _causal_specs(op, sparse_mode, pre, nxt, sq, skv, mask_seg):
    """Mask specs of the batched FIA path (see the module docstring); the
    compressed mask of modes 2-4 is checked once by the caller."""
    if sparse_mode in (2, 3, 4):
        if sparse_mode == 2:
            return (Band(None, 0, 0),)
        if sparse_mode == 3:
            return (Band(None, 0, skv - sq),)
        return (Band(C.band_limit(pre), C.band_limit(nxt), skv - sq),)
    if mask_seg is None:
        if sparse_mode == 1:
            raise ValueError("%s: sparse_mode=1 (allMask) requires the full atten_mask" % op)
        return ()
    if sparse_mode == 1:
        return (Explicit(mask_seg),)
    return (Explicit(mask_seg), Band(C.band_limit(pre), C.band_limit(nxt), 0))


def _kv_sources(op, key, value, n, nkv, b, layout, block_table, block_size, kv_lens_arg,
                allow_bnsd_cache, same_dims_required, dq):
    """Per-batch key/value row sources and lengths, paged or not."""
    if block_table is not None:
        if kv_lens_arg is None:
            raise ValueError("%s: paged attention (block_table) requires the per-batch KV lengths" % op)
        if op == FIA and block_size % FIA_BLOCK_ALIGN:
            raise ValueError("%s: In NO_QUANT situation, block_size should aligned to %d, but got %d"
                             % (op, FIA_BLOCK_ALIGN, block_size))
        kc = C.paged_cache_view(op, key, "key cache", block_size, nkv, allow_bnsd_cache)
        vc = C.paged_cache_view(op, value, "value cache", block_size, nkv, allow_bnsd_cache)
        if kc.shape[0] != vc.shape[0]:
            raise ValueError("%s: key and value caches have different block counts" % op)
        lengths_name = "actual_seq_lengths" if op == IFA else "actual_seq_lengths_kv"
        kv_lens = C.host_ints(kv_lens_arg, op, lengths_name)
        if len(kv_lens) == 1 and b > 1:
            kv_lens = kv_lens * b
        if len(kv_lens) < b:
            raise ValueError("%s: %d KV lengths for %d sequences" % (op, len(kv_lens), b))
        kv_lens = kv_lens[:b]
        C.check_block_table(op, block_table, b, kv_lens, block_size, num_blocks=kc.shape[0],
                            lengths_name=lengths_name)
        ks = [C.PagedRows(kc, block_table[i], block_size, kv_lens[i]) for i in range(b)]
        vs = [C.PagedRows(vc, block_table[i], block_size, kv_lens[i]) for i in range(b)]
        dk, dv = kc.shape[3], vc.shape[3]
    else:
        k = C.to_bsnd(op, key, layout, nkv, "key")
        v = C.to_bsnd(op, value, layout, nkv, "value")
        if k.shape[0] != b or k.shape[2] != nkv or k.shape[:3] != v.shape[:3]:
            raise ValueError("%s: key/value shapes %s / %s do not match B=%d, Nkv=%d"
                             % (op, tuple(key.shape), tuple(value.shape), b, nkv))
        kv_lens = C.per_batch_lengths(op, "actual_seq_lengths_kv", kv_lens_arg, b, k.shape[1])
        ks = [k[i, :kv_lens[i]] for i in range(b)]
        vs = [v[i, :kv_lens[i]] for i in range(b)]
        dk, dv = k.shape[3], v.shape[3]
    if dk != dq:
        raise ValueError("%s: key head dim %d != query head dim %d" % (op, dk, dq))
    if same_dims_required and dv != dk:
        raise C.not_implemented(op, "value", "value head dim must equal key head dim in this layout")
    return ks, vs, kv_lens, dv


def _fia_batched(query, key, value, n, nkv, atten_mask, q_lens_arg, kv_lens_arg, block_table,
                 block_size, scale, pre, nxt, layout, sparse_mode, lse_flag):
    in_layout = "BNSD" if layout == "BNSD_BSND" else layout
    q = C.to_bsnd(FIA, query, in_layout, n, "query")
    b, sq, qn, dq = q.shape
    if qn != n:
        raise ValueError("%s: num_heads=%d but query has %d heads" % (FIA, n, qn))
    ks, vs, kv_lens, dv = _kv_sources(FIA, key, value, n, nkv, b, in_layout, block_table,
                                      block_size, kv_lens_arg, in_layout == "BNSD", True, dq)
    q_lens = C.per_batch_lengths(FIA, "actual_seq_lengths", q_lens_arg, b, sq)
    incremental = sq == 1
    if not incremental and sparse_mode in (2, 3, 4):
        C.check_compressed_mask(FIA, atten_mask, sparse_mode)
    if atten_mask is not None and not incremental and sparse_mode in (0, 1):
        if atten_mask.dim() not in (2, 3, 4) or atten_mask.shape[-2] < sq:
            raise ValueError("%s: atten_mask shape %s does not cover Sq=%d"
                             % (FIA, tuple(atten_mask.shape), sq))
    out, out_bsnd = C.alloc_out_bsnd(layout, b, sq, n, dv, query)
    lse = torch.full((b, n, sq, 1), float("-inf"), dtype=torch.float32, device=query.device)
    for i in range(b):
        ql, kl = q_lens[i], kv_lens[i]
        mask_seg = None if sparse_mode in (2, 3, 4) and not incremental else \
            _mask_for_batch(atten_mask, i, incremental)
        if incremental:
            specs = (Explicit(mask_seg),) if mask_seg is not None else ()
        else:
            specs = _causal_specs(FIA, sparse_mode, pre, nxt, ql, kl, mask_seg)
        attend_segment(q[i, :ql], ks[i], vs[i], out_bsnd[i, :ql], scale=scale, masks=specs,
                       lse_out=lse[i, :, :ql, 0].transpose(0, 1))
        if ql < sq:
            out_bsnd[i, ql:].zero_()
    return out, _lse_result(lse, lse_flag, query)


def _mask_for_batch(mask, i, incremental):
    """(Nm=1, Sq', Skv') view of batch i's mask, or None."""
    if mask is None:
        return None
    if incremental:  # (B, Skv), (B, 1, Skv), (B, 1, 1, Skv)
        row = mask[i if mask.shape[0] > 1 else 0].reshape(1, 1, -1)
        return row
    if mask.dim() == 2:
        return mask.unsqueeze(0)
    seg = mask[i if mask.shape[0] > 1 else 0]
    return seg if seg.dim() == 3 else seg.unsqueeze(0)


def _fia_tnd(query, key, value, n, nkv, atten_mask, q_cum, kv_arg, block_table, block_size,
             scale, sparse_mode, lse_flag):
    if query.dim() != 3:
        raise ValueError("%s: TND query must be (T, N, D), got %s" % (FIA, tuple(query.shape)))
    t, qn, dq = query.shape
    if qn != n:
        raise ValueError("%s: num_heads=%d but query has %d heads" % (FIA, n, qn))
    if sparse_mode == 0 and atten_mask is not None or sparse_mode not in (0, 3):
        raise ValueError("%s: with TND only sparse_mode=0 without atten_mask or sparse_mode=3 "
                         "with the compressed atten_mask are supported" % FIA)
    if sparse_mode == 3:
        C.check_compressed_mask(FIA, atten_mask, 3)
    if q_cum is None:
        raise ValueError("%s: input_layout='TND' requires actual_seq_lengths" % FIA)
    seg_q = _tnd_segments(q_cum, t, "actual_seq_lengths")
    if seg_q and seg_q[-1][1] != t:
        # the real op: "queryT(...) must be equal to the last element of actualSequenceLengthQ"
        # (sglang PR #31867: 0.5.16's per-image lengths for two images or more fail there)
        raise ValueError("%s: TND actual_seq_lengths must end at the query's token count: queryT(%d) must be "
                         "equal to the last element of actualSequenceLengthQ(%d)" % (FIA, t, seg_q[-1][1]))
    b = len(seg_q)
    if block_table is not None:
        ks, vs, kv_lens, dv = _kv_sources(FIA, key, value, n, nkv, b, "TND", block_table,
                                          block_size, kv_arg, True, False, dq)
    else:
        if kv_arg is None:
            raise ValueError("%s: input_layout='TND' requires actual_seq_lengths_kv" % FIA)
        if key.dim() != 3 or key.shape[1] != nkv or value.shape[:2] != key.shape[:2]:
            raise ValueError("%s: TND key/value must be (T, Nkv=%d, D)" % (FIA, nkv))
        seg_kv = _tnd_segments(kv_arg, key.shape[0], "actual_seq_lengths_kv")
        if len(seg_kv) != b:
            raise ValueError("%s: %d query batches but %d KV batches" % (FIA, b, len(seg_kv)))
        if key.shape[2] != dq:
            raise ValueError("%s: key head dim %d != query head dim %d" % (FIA, key.shape[2], dq))
        ks = [key[s:e] for s, e in seg_kv]
        vs = [value[s:e] for s, e in seg_kv]
        kv_lens = [e - s for s, e in seg_kv]
        dv = value.shape[2]
    check_tnd_head_dims(dq, dv)
    out = torch.zeros((t, n, dv), dtype=query.dtype, device=query.device)
    lse = torch.full((t, n, 1), float("-inf"), dtype=torch.float32, device=query.device)
    for (q0, q1), k_rows, v_rows, kl in zip(seg_q, ks, vs, kv_lens):
        sq = q1 - q0
        specs = (Band(None, 0, kl - sq),) if sparse_mode == 3 else ()
        attend_segment(query[q0:q1], k_rows, v_rows, out[q0:q1], scale=scale, masks=specs,
                       lse_out=lse[q0:q1, :, 0])
    return out, _lse_result(lse, lse_flag, query)


def check_tnd_head_dims(dqk, dv):
    """The TND head-dim rule of the emulated CANN release (module docstring); ValueError in
    CANN's words otherwise."""
    version = soc.cann_version()
    if soc.parse_cann(version) >= TND_WIDE_SINCE:
        if dqk == dv and dqk in TND_HEAD_DIMS or (dqk, dv) == (192, 128):
            return
        raise ValueError("%s (emulated CANN %s): When layout is TND, queryD(%d), keyD(%d) and valueD(%d) "
                         "must be same equal 192/128/64, or queryD and keyD equal 192 and valueD equal 128"
                         % (FIA, version, dqk, dqk, dv))
    if dqk == 192 and dv in (192, 128):
        return
    raise ValueError("%s (emulated CANN %s): When layout is TND, queryD(%d) or keyD(%d) must be 192, "
                     "valueD(%d) must be 192/128!" % (FIA, version, dqk, dqk, dv))


def _tnd_segments(cum, total, name):
    """FIA TND lengths: cumulative, non-decreasing, the count is the batch."""
    cum = C.host_ints(cum, FIA, name)
    segments, start = [], 0
    for end in cum:
        if end < start:
            raise ValueError("%s: TND actual_seq_lengths must be non-decreasing, got %r" % (FIA, cum))
        segments.append((start, end))
        start = end
    if start > total:
        raise ValueError("%s: actual_seq_lengths end at %d but the tensor has %d tokens"
                         % (FIA, start, total))
    return segments


def _lse_result(lse, flag, query):
    if flag:
        return lse
    return torch.zeros(1, dtype=torch.float32, device=query.device)


def npu_incre_flash_attention(query, key, value, *, padding_mask=None, pse_shift=None,
                              atten_mask=None, actual_seq_lengths=None, dequant_scale1=None,
                              quant_scale1=None, dequant_scale2=None, quant_scale2=None,
                              quant_offset2=None, antiquant_scale=None, antiquant_offset=None,
                              block_table=None, kv_padding_size=None, num_heads=1,
                              scale_value=1.0, input_layout="BSH", num_key_value_heads=0,
                              block_size=0, inner_precise=1):
    C.reject_set(IFA, padding_mask=padding_mask, pse_shift=pse_shift,
                 dequant_scale1=dequant_scale1, quant_scale1=quant_scale1,
                 dequant_scale2=dequant_scale2, quant_scale2=quant_scale2,
                 quant_offset2=quant_offset2, antiquant_scale=antiquant_scale,
                 antiquant_offset=antiquant_offset, kv_padding_size=kv_padding_size)
    if input_layout not in IFA_LAYOUTS:
        raise ValueError("%s: input_layout=%r; documented: %s" % (IFA, input_layout, ", ".join(IFA_LAYOUTS)))
    if inner_precise not in (0, 1):
        raise ValueError("%s: inner_precise=%r; documented values are 0 and 1" % (IFA, inner_precise))
    C.check_float_inputs(IFA, query=query, key=key, value=value)
    n = C.as_int(IFA, "num_heads", num_heads)
    nkv = C.as_int(IFA, "num_key_value_heads", num_key_value_heads) or n
    C.check_heads(IFA, n, nkv, MAX_GQA_RATIO)
    q = C.to_bsnd(IFA, query, input_layout, n, "query")
    b, sq, qn, dq = q.shape
    if sq != 1:
        raise ValueError("%s: the query sequence length must be 1 (incremental decode), got %d" % (IFA, sq))
    if qn != n:
        raise ValueError("%s: num_heads=%d but query has %d heads" % (IFA, n, qn))
    ks, vs, kv_lens, dv = _kv_sources(IFA, key, value, n, nkv, b, input_layout, block_table,
                                      C.as_int(IFA, "block_size", block_size), actual_seq_lengths,
                                      input_layout == "BNSD", True, dq)
    out, out_bsnd = C.alloc_out_bsnd(input_layout, b, 1, n, dv, query)
    for i in range(b):
        mask_seg = _mask_for_batch(atten_mask, i, True)
        specs = (Explicit(mask_seg),) if mask_seg is not None else ()
        attend_segment(q[i], ks[i], vs[i], out_bsnd[i], scale=float(scale_value), masks=specs)
    return out
