"""Host copies of ``cu_seqlens`` with at most one device->host transfer per tensor.

Why: the NPU attention ops take sequence lengths as host integers. Upstream
vllm-ascend 0.13/0.14 copied ``cu_seqlens`` to the CPU in every encoder layer
(27 syncs per MoonViT forward), and 0.15.0rc1 cached the copy in a module
global refreshed when the digits of the layer *prefix* parse to 0 -- a cache
that two encoders (or two models) in one process share and that breaks for any
prefix that does not end in a layer index.

Here the cache is keyed to the tensor object itself, weakly
(``torch.utils.weak.WeakIdKeyDictionary``: by identity, entries vanish with
the tensor, so a dead tensor's id can never be confused with a new tensor;
plain ``weakref.WeakKeyDictionary`` would compare tensors with ``==``), and to
its version counter, so an in-place change is seen. The value belongs to that
one tensor; nothing else is shared.

Inference tensors (created under ``torch.inference_mode()``, as vLLM's are) have
no version counter; for them the cache is keyed to identity and storage
pointer only, so an in-place write into the same inference tensor is NOT
detected. vLLM builds a new ``cu_seqlens`` every forward, which is seen.
"""
import operator

import torch
from torch.utils.weak import WeakIdKeyDictionary

__all__ = ["host_cu_seqlens", "is_cached"]

_cache = WeakIdKeyDictionary()


def host_cu_seqlens(cu_seqlens):
    """Cumulative sequence lengths (with the leading 0) as a tuple of Python ints.

    ``cu_seqlens``: a 1-D integer tensor on any device, or a list/tuple (or
    NumPy array) of ints. A device tensor is copied to the host once; later
    calls with the same, unmodified tensor are free. A host tensor or a
    sequence costs no device transfer at all.

    Raises ValueError unless the values are 1-D, start at 0 and never decrease.
    """
    if isinstance(cu_seqlens, torch.Tensor):
        return _from_tensor(cu_seqlens)
    if hasattr(cu_seqlens, "tolist") and not isinstance(cu_seqlens, (list, tuple)):
        arr = cu_seqlens
        if getattr(arr, "ndim", 1) != 1:
            raise ValueError("cu_seqlens must be 1-D, got %d dimensions" % arr.ndim)
        cu_seqlens = arr.tolist()
    if not isinstance(cu_seqlens, (list, tuple)):
        raise TypeError("cu_seqlens must be a tensor or a sequence of ints, got %s"
                        % type(cu_seqlens).__name__)
    values = []
    for x in cu_seqlens:
        if isinstance(x, (list, tuple)):
            raise ValueError("cu_seqlens must be 1-D (got a nested sequence)")
        if isinstance(x, torch.Tensor):
            raise TypeError("cu_seqlens as a sequence must hold Python ints, not tensors "
                            "(reading each tensor would be a host sync); pass the tensor itself")
        try:
            if isinstance(x, bool):
                raise TypeError
            values.append(operator.index(x))
        except TypeError:
            raise ValueError("cu_seqlens must hold integers, got %r" % (x,)) from None
    return _validated(tuple(values))


def _from_tensor(t):
    if t.dim() != 1:
        raise ValueError("cu_seqlens must be 1-D, got shape %s" % (tuple(t.shape),))
    if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
        raise ValueError("cu_seqlens must be an integer tensor, got %s" % t.dtype)
    key = (None, t.data_ptr()) if t.is_inference() else (t._version, t.data_ptr())
    hit = _cache.get(t)
    if hit is not None and hit[0] == key:
        return hit[1]
    values = _validated(tuple(t.tolist()))  # the one device->host transfer
    _cache[t] = (key, values)
    return values


def is_cached(t):
    """True when :func:`host_cu_seqlens` would answer for tensor ``t`` without reading it."""
    key = (None, t.data_ptr()) if t.is_inference() else (t._version, t.data_ptr())
    hit = _cache.get(t)
    return hit is not None and hit[0] == key


def _validated(values):
    if not values:
        raise ValueError("cu_seqlens is empty; it must start with 0, e.g. [0, len0, len0+len1]")
    if values[0] != 0:
        raise ValueError("cu_seqlens must start at 0, got %d" % values[0])
    for i in range(1, len(values)):
        if values[i] < values[i - 1]:
            raise ValueError(
                "cu_seqlens must be non-decreasing, but %d follows %d at position %d"
                % (values[i], values[i - 1], i))
    return values
