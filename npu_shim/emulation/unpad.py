"""Emulation of ``torch_npu._npu_flash_attention_unpad`` (ATB self-attention,
PA_ENCODER, the op vllm-ascend's ViT encoder uses on every device up to 0.15 and
the only varlen path on 310P).

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
from npu_shim.emulation import soc
from npu_shim.emulation._engine import attend_segment

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
