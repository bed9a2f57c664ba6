"""Varlen (packed, block-diagonal, non-causal) attention for ViT encoders.

One :class:`VarlenAttention` per layer. Everything that does not depend on the
input is decided once, at construction: the scale, the zero-padding of head
dims, and the NPU path, chosen by device capability:

* ``"tnd"`` (A2/A3/A5): one ``torch_npu.npu_fusion_attention`` call per layer
  with ``input_layout="TND"``, cumulative ``actual_seq_qlen`` /
  ``actual_seq_kvlen`` (without the leading 0) as Python ints and no mask: each
  segment attends only to itself, and nothing of size S x S exists anywhere.
  (What vllm-ascend 0.18+ does; the seed's S x S mask needed 85.8 GiB at
  303,548 tokens.)
* ``"unpad"`` (310P): ``torch_npu._npu_flash_attention_unpad`` with the
  per-segment lengths as a host int32 tensor.

Head dims strictly between 64 and 128 are zero-padded to 128 and the output is
sliced back (zero columns change neither q.k nor the output's first Dv
columns); vllm-ascend does the same for kernel efficiency.

Host syncs: the segment boundaries come from :func:`host_cu_seqlens`, cached per
``cu_seqlens`` tensor, so a forward through any number of layers that share one
``cu_seqlens`` costs at most one device->host transfer, and none when the
caller passes host values.
"""
import torch
import torch.nn.functional as F

from npu_shim.kernels import _torch_npu
from npu_shim.kernels.seqlens import host_cu_seqlens

__all__ = ["VarlenAttention", "padded_head_dim"]

PAD_MIN, PAD_TO = 64, 128
TND_MAX_SEGMENTS = 1024   # documented varlen batch limit of npu_fusion_attention
UNPAD_MAX_SEGMENTS = 2000  # documented 310P batch limit of the ATB op
TND_MAX_HEAD_DIM = 768


def padded_head_dim(d):
    """128 for 64 < d < 128 (the NPU kernels' sweet spot), else d unchanged."""
    return PAD_TO if PAD_MIN < d < PAD_TO else d


class VarlenAttention:
    """Block-diagonal attention over packed segments, dispatched to torch_npu.

    Args:
        num_heads: query heads N.
        head_dim: query/key head dim D.
        num_kv_heads: key/value heads (GQA); must divide ``num_heads``; default N.
        scale: softmax scale; default ``head_dim ** -0.5`` (of the *unpadded* dim).
        v_head_dim: value head dim Dv (may differ from D); default D.
        backend: ``"tnd"`` or ``"unpad"``; default: chosen from the SoC that
            torch_npu reports (310P -> "unpad", A2/A3/A5 -> "tnd").

    Call with q (T, N, D), k (T, Nkv, D), v (T, Nkv, Dv) and ``cu_seqlens``
    (T's segment boundaries with the leading 0: a tensor on any device, or host
    ints); returns (T, N, Dv).
    """

    def __init__(self, num_heads, head_dim, *, num_kv_heads=None, scale=None,
                 v_head_dim=None, backend=None):
        self.num_heads = _positive_int("num_heads", num_heads)
        self.head_dim = _positive_int("head_dim", head_dim)
        self.num_kv_heads = _positive_int("num_kv_heads", num_kv_heads or num_heads)
        if self.num_heads % self.num_kv_heads:
            raise ValueError("num_kv_heads (%d) must divide num_heads (%d)"
                             % (self.num_kv_heads, self.num_heads))
        self.v_head_dim = _positive_int("v_head_dim", v_head_dim or head_dim)
        self.scale = float(scale) if scale is not None else self.head_dim ** -0.5
        self._torch_npu = _torch_npu.load_torch_npu()
        if backend is None:
            backend = _torch_npu.backend_for_soc(_torch_npu.soc_version(self._torch_npu))
        if backend not in _torch_npu.BACKENDS:
            raise ValueError("backend must be one of %s, got %r" % (_torch_npu.BACKENDS, backend))
        self.backend = backend
        qk_pad = padded_head_dim(self.head_dim)
        v_pad = padded_head_dim(self.v_head_dim)
        if backend == "tnd":
            # npu_fusion_attention requires Dk >= Dv; zero columns of q and k keep q.k.
            qk_pad = max(qk_pad, v_pad)
            if qk_pad > TND_MAX_HEAD_DIM:
                raise ValueError("npu_fusion_attention supports head dims up to %d, got %d"
                                 % (TND_MAX_HEAD_DIM, qk_pad))
        elif self.v_head_dim != self.head_dim:
            raise ValueError(
                "_npu_flash_attention_unpad (the 310P path) requires the value head dim to "
                "equal the key head dim on 310P; got head_dim=%d, v_head_dim=%d"
                % (self.head_dim, self.v_head_dim))
        self.qk_pad_dim = qk_pad
        self.v_pad_dim = v_pad

    def __repr__(self):
        return ("VarlenAttention(num_heads=%d, head_dim=%d, num_kv_heads=%d, v_head_dim=%d, "
                "scale=%g, backend=%r, padded=(%d, %d))"
                % (self.num_heads, self.head_dim, self.num_kv_heads, self.v_head_dim,
                   self.scale, self.backend, self.qk_pad_dim, self.v_pad_dim))

    def __call__(self, q, k, v, cu_seqlens):
        self._check(q, k, v)
        cum = host_cu_seqlens(cu_seqlens)
        total = q.shape[0]
        if cum[-1] != total:
            raise ValueError("cu_seqlens ends at %d but q has %d tokens" % (cum[-1], total))
        if total == 0:
            return q.new_empty((0, self.num_heads, self.v_head_dim))
        q = _pad_last(q, self.qk_pad_dim)
        k = _pad_last(k, self.qk_pad_dim)
        v = _pad_last(v, self.v_pad_dim)
        if self.backend == "tnd":
            out = self._tnd(q, k, v, cum)
        else:
            out = self._unpad(q, k, v, cum)
        if self.v_pad_dim != self.v_head_dim:
            out = out[..., :self.v_head_dim]
        return out

    def _check(self, q, k, v):
        # Runs in every layer of every forward: compare whole shapes, format only on error.
        t = q.shape[0]
        n, nkv = self.num_heads, self.num_kv_heads
        if q.shape != (t, n, self.head_dim):
            raise ValueError("q must be (T, %d, %d), got %s" % (n, self.head_dim, tuple(q.shape)))
        if k.shape != (t, nkv, self.head_dim):
            raise ValueError("k must be (T=%d, %d, %d), got %s"
                             % (t, nkv, self.head_dim, tuple(k.shape)))
        if v.shape != (t, nkv, self.v_head_dim):
            raise ValueError("v must be (T=%d, %d, %d), got %s"
                             % (t, nkv, self.v_head_dim, tuple(v.shape)))

    def _tnd(self, q, k, v, cum):
        if len(cum) - 1 <= TND_MAX_SEGMENTS:  # the usual case: one call, no slicing
            return self._fusion(q, k, v, list(cum[1:]))
        outs = []
        for first, last in _groups(len(cum) - 1, TND_MAX_SEGMENTS):
            t0, t1 = cum[first], cum[last]
            ends = [c - t0 for c in cum[first + 1:last + 1]]
            outs.append(self._fusion(q[t0:t1], k[t0:t1], v[t0:t1], ends))
        return torch.cat(outs, dim=0)

    def _fusion(self, q, k, v, ends):
        """One TND npu_fusion_attention call; ``ends``: cumulative lengths without the 0."""
        return self._torch_npu.npu_fusion_attention(
            q, k, v, head_num=self.num_heads, input_layout="TND", scale=self.scale,
            actual_seq_qlen=ends, actual_seq_kvlen=ends)[0]

    def _unpad(self, q, k, v, cum):
        lengths = [b - a for a, b in zip(cum, cum[1:]) if b > a]  # empty segments: nothing to do
        out = torch.empty((q.shape[0], self.num_heads, self.v_pad_dim), dtype=q.dtype,
                          device=q.device)
        if len(lengths) <= UNPAD_MAX_SEGMENTS:  # the usual case: one call, no slicing
            self._unpad_call(q, k, v, lengths, out)
            return out
        start = 0
        for first, last in _groups(len(lengths), UNPAD_MAX_SEGMENTS):
            part = lengths[first:last]
            end = start + sum(part)
            self._unpad_call(q[start:end], k[start:end], v[start:end], part, out[start:end])
            start = end
        return out

    def _unpad_call(self, q, k, v, lengths, out):
        """One _npu_flash_attention_unpad call writing ``out``; ``lengths`` per segment."""
        self._torch_npu._npu_flash_attention_unpad(
            query=q, key=k, value=v,
            seq_len=torch.tensor(lengths, dtype=torch.int32),  # built on the host: no sync
            scale_value=self.scale, num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads, out=out)


def _groups(count, limit):
    """[first, last) index ranges of at most ``limit`` items (one range if it fits)."""
    if count <= limit:
        return [(0, count)]
    return [(i, min(count, i + limit)) for i in range(0, count, limit)]


def _pad_last(x, width):
    """Zero-pad the head dim to ``width``; always hand the op a contiguous tensor."""
    return x.contiguous() if x.shape[-1] == width else F.pad(x, (0, width - x.shape[-1]))


def _positive_int(name, value):
    if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError("%s must be a positive int, got %r" % (name, value))
    return value
