"""Count device->host synchronisations made by the code under test.

A host sync is any point where Python needs a value that lives on the device:
``.item()``, ``.tolist()``, ``.numpy()`` / ``np.asarray``, ``.cpu()``,
``.to(<host>)``, ``host.copy_(device)``, ``bool()`` / ``int()`` / ``float()`` /
``operator.index()`` of a tensor, a tensor used as an index or a slice bound
(``x[t0:t1]`` reads both bounds), ``narrow`` with a tensor start, and ops whose
output *shape* depends on device data (``nonzero``, ``masked_select``,
``unique``, boolean-mask indexing, ``repeat_interleave`` with tensor repeats and
no ``output_size``).

How it sees them: a ``TorchFunctionMode`` (verified on torch 2.13 to receive
every operation above; slice bounds arrive inside ``__getitem__`` /
``__setitem__`` and are read from the index). Ops that run inside another
``__torch_function__`` handler run with this mode popped, which is how the
torch_npu emulation's internals stay invisible: its ops honour
``__torch_function__``, so the mode sees one call (``torch_npu.X`` or
``torch.ops.npu.X``) and nothing of its body.

Which tensors count as "on the device": a tensor whose device is not the CPU;
on CPU-only machines, the tensors passed in ``device_tensors`` (stand-ins for
device tensors) and, by propagation, every tensor an op computes from at least
one device tensor (``torch.diff(cu_seqlens)`` of a stand-in is a stand-in). The
result of a counted transfer is a host tensor, and ops on host tensors only give
host tensors. ``cpu_is_device=True`` makes every CPU tensor that is not known to
be a host copy count as device, to count every extraction when the inputs are
built inside the code under test.

So "upstream vllm-ascend 0.13 syncs once per layer" is checked on CPU as::

    with count_host_syncs(device_tensors=[cu_seqlens]) as syncs:
        for layer in layers:
            layer(q, k, v, cu_seqlens)  # torch.diff(cu_seqlens).to("cpu") inside
    assert syncs.count == len(layers)
"""
import contextlib
import os
import sys
import weakref
from collections import Counter
from typing import NamedTuple

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

__all__ = ["HostSyncCounter", "SyncEvent", "count_host_syncs"]

_T = torch.Tensor
_VALUE_READS = {
    _T.item: "item", _T.tolist: "tolist", _T.numpy: "numpy", _T.__array__: "numpy",
    _T.__bool__: "bool", _T.__int__: "int", _T.__float__: "float", _T.__index__: "index",
}
_SHAPE_OPS = {torch.nonzero, _T.nonzero, torch.argwhere, _T.argwhere, torch.masked_select,
              _T.masked_select, torch.unique, _T.unique, torch.unique_consecutive,
              _T.unique_consecutive}
_INDEXING = {_T.__getitem__, _T.__setitem__}
_NARROW = {torch.narrow, _T.narrow}
_REPEAT_INTERLEAVE = {torch.repeat_interleave, _T.repeat_interleave}
_TO_DEVICE = {_T.cuda, getattr(_T, "npu", None)} - {None}

# Frames skipped when naming the caller: torch itself, this package, contextlib.
_SKIP_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                   for m in (torch, sys.modules[__name__]))
_SKIP_FILES = {os.path.abspath(contextlib.__file__)}


class SyncEvent(NamedTuple):
    kind: str       # item, tolist, numpy, cpu, to, copy_, bool, int, float, index, shape
    location: str   # "dir/file.py:line in function" of the code that caused it

    def __str__(self):
        return "%s at %s" % (self.kind, self.location)


class HostSyncCounter:
    """Events seen so far; ``count`` is their number."""

    def __init__(self, device_tensors=(), cpu_is_device=False):
        self.events = []
        self.cpu_is_device = cpu_is_device
        self._device = {}
        self._host = {}
        for t in device_tensors:
            self.mark_device(t)

    @property
    def count(self):
        return len(self.events)

    def kinds(self):
        return Counter(e.kind for e in self.events)

    def summary(self):
        return "%d host syncs: %s" % (self.count, ", ".join(
            "%s x%d" % kv for kv in sorted(self.kinds().items())))

    def __repr__(self):
        return "<HostSyncCounter %s>" % self.summary()

    # -- device / host bookkeeping (by identity, weakly) ----------------------
    @staticmethod
    def _remember(table, t):
        key = id(t)
        table[key] = weakref.ref(t, lambda _, key=key, table=table: table.pop(key, None))

    @staticmethod
    def _known(table, t):
        ref = table.get(id(t))
        return ref is not None and ref() is t

    def mark_device(self, *tensors):
        """Treat these CPU tensors as stand-ins for device tensors."""
        for t in tensors:
            self._host.pop(id(t), None)
            self._remember(self._device, t)

    def mark_host(self, *tensors):
        for t in tensors:
            self._device.pop(id(t), None)
            self._remember(self._host, t)

    def is_device(self, t):
        if not isinstance(t, torch.Tensor):
            return False
        if self._known(self._host, t):
            return False
        if t.device.type not in ("cpu", "meta"):
            return True
        return self._known(self._device, t) or self.cpu_is_device

    def is_host(self, t):
        return isinstance(t, torch.Tensor) and not self.is_device(t)

    def _record(self, kind):
        self.events.append(SyncEvent(kind, _caller_location()))


def _caller_location():
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_SKIP_DIRS) and path not in _SKIP_FILES:
            short = os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))
            return "%s:%d in %s" % (short, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return "<unknown>"


class _SyncMode(TorchFunctionMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        this = args[0] if args else None
        was_device = c.is_device(this)
        transfer_out = self._classify(func, args, kwargs)
        result = func(*args, **kwargs)
        if transfer_out == "host" and result is this and was_device:
            # A CPU stand-in "copied" to the host: on a device this is a new
            # tensor and the stand-in stays on the device, so hand back a copy.
            result = result.clone()
        outputs = [x for x in tree_flatten(result)[0] if isinstance(x, torch.Tensor)]
        if not outputs:
            return result
        if transfer_out == "host":
            c.mark_host(*[o for o in outputs if o is not this])
            return result
        if transfer_out == "device":
            c.mark_device(*[o for o in outputs if o.device.type == "cpu"])
            return result
        if transfer_out == "keep":
            return result
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if any(c.is_device(x) for x in inputs):
            c.mark_device(*[o for o in outputs if o.device.type == "cpu"])
        elif c.cpu_is_device and inputs and all(c.is_host(x) for x in inputs):
            c.mark_host(*[o for o in outputs if o.device.type == "cpu"])
        return result

    def _classify(self, func, args, kwargs):
        """Record the sync ``func`` is about to make; say where its output lives."""
        c = self.counter
        this = args[0] if args else None
        if func in _VALUE_READS:
            if c.is_device(this):
                c._record(_VALUE_READS[func])
            return None
        if func is _T.cpu:
            if c.is_device(this):
                c._record("cpu")
            return "host"
        if func is _T.to:
            device = torch._C._nn._parse_to(*args[1:], **kwargs)[0]
            if device is None:
                return None
            if device.type == "cpu":
                if c.is_device(this):
                    c._record("to")
                return "host"
            return "device"
        if func in _TO_DEVICE:
            return "device"
        if func is _T.copy_:
            src = args[1] if len(args) > 1 else kwargs.get("src")
            if c.is_host(this) and c.is_device(src):
                c._record("copy_")
            return "keep"
        if func in _INDEXING:
            self._index_syncs(args[1] if len(args) > 1 else None)
            return None
        if func in _NARROW:
            start = args[2] if len(args) > 2 else kwargs.get("start")
            if isinstance(start, torch.Tensor) and c.is_device(start):
                c._record("index")
            return None
        if func in _SHAPE_OPS or func is torch.where and len(args) + len(kwargs) == 1:
            if c.is_device(this if this is not None else next(iter(kwargs.values()))):
                c._record("shape")
            return None
        if func in _REPEAT_INTERLEAVE:
            repeats = args[1] if len(args) > 1 else kwargs.get("repeats")
            if (isinstance(repeats, torch.Tensor) and repeats.numel() > 1
                    and kwargs.get("output_size") is None and c.is_device(repeats)):
                c._record("shape")
            return None
        return None

    def _index_syncs(self, index):
        c = self.counter
        items = index if isinstance(index, tuple) else (index,)
        for item in items:
            if isinstance(item, slice):
                for bound in (item.start, item.stop, item.step):
                    if isinstance(bound, torch.Tensor) and c.is_device(bound):
                        c._record("index")
            elif isinstance(item, torch.Tensor) and c.is_device(item):
                if item.dtype == torch.bool:
                    c._record("shape")
                elif item.dim() == 0 and not item.dtype.is_floating_point:
                    c._record("index")


@contextlib.contextmanager
def count_host_syncs(device_tensors=(), *, cpu_is_device=False):
    """Count host syncs inside the block; yields a :class:`HostSyncCounter`.

    ``device_tensors``: CPU tensors that stand in for device tensors (see the
    module docstring). Real device tensors always count as device tensors.
    ``cpu_is_device``: treat every CPU tensor not known to be a host copy as a
    device tensor.
    """
    counter = HostSyncCounter(device_tensors, cpu_is_device)
    with _SyncMode(counter):
        yield counter
