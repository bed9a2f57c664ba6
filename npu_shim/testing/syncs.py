"""Count device->host synchronisations made by the code under test, and, apart
from them, blocking host->device copies.

A host sync is any point where Python needs a value that lives on the device:
``.item()``, ``.tolist()``, ``.numpy()`` / ``np.asarray``, ``.cpu()``,
``.to(<host>)``, ``host.copy_(device)``, ``bool()`` / ``int()`` / ``float()`` /
``operator.index()`` of a tensor, a tensor used as an index or a slice bound
(``x[t0:t1]`` reads both bounds), ``narrow`` with a tensor start, a tensor
where torch wants a number (``torch.arange(t)``, ``x.repeat(t)``, a size), and
ops whose output *shape* depends on device data (``nonzero``,
``masked_select``, ``unique``, boolean-mask indexing, ``repeat_interleave``
with tensor repeats and no ``output_size``).

How it sees them, two layers that cannot both count one read:

* a ``TorchFunctionMode`` (verified on torch 2.13 to receive every operation
  above) names the read (``item``, ``tolist``, ``index`` ...); slice bounds
  arrive inside ``__getitem__`` / ``__setitem__`` and are read from the index.
* a ``TorchDispatchMode`` under it catches every scalar read the first layer
  did not name, at the dispatcher: ``aten._local_scalar_dense`` and, under
  ``torch.inference_mode()`` (where the dispatcher shows the composite op),
  ``aten.item`` (kind ``scalar``), ``aten.equal`` (kind ``equal``: a bool the
  device computes), and the data-dependent-shape aten ops (kind ``shape``). It
  counts only inside a torch call in which the first layer recorded nothing, so
  ``t.item()`` is one ``item``, never also a ``scalar``; every read it counts
  there is one (``t.reshape(t[2], t[6])`` reads two sizes: two).

Ops that run inside another ``__torch_function__`` handler run with the first
mode popped, and the dispatch layer stays silent inside calls of
``torch_npu.X`` / ``torch.ops.npu.X``: that is how the torch_npu emulation's
internals stay invisible (its ops honour ``__torch_function__``, so the modes
see one call and nothing of its body).

Opaque, but not blind at the call: an argument torch_npu reads on the host
(``seq_len`` of ``_npu_flash_attention_unpad``, ``actual_seq_qlen`` /
``actual_seq_kvlen`` of ``npu_fusion_attention``, ``actual_seq_lengths[_kv]``
of ``npu_fused_infer_attention_score`` / ``npu_prompt_flash_attention``,
``actual_seq_lengths`` of ``npu_incre_flash_attention``; the table is
``npu_shim.emulation._registry.HOST_ARGS``, each entry citing the vendor's
documentation) must be host data. A device tensor there, or a device tensor
inside a list there, is a read the op makes before it can launch: one event of
kind ``host_arg`` per such tensor, whose ``detail`` names the op and the
argument. With ``strict=True`` it is a :class:`HostArgumentError` instead,
raised before the op runs. Why at the call and not in the body: the emulation
cannot tell a CPU stand-in from host data, only the counter can.

Which tensors count as "on the device": a tensor whose device is not the CPU;
on CPU-only machines, the tensors passed in ``device_tensors`` and the
parameters and buffers of ``device_modules`` (stand-ins for device tensors)
and, by propagation, every tensor an op computes from at least one device
tensor (``torch.diff(cu_seqlens)`` of a stand-in is a stand-in). The result of
a counted transfer is a host tensor, and ops on host tensors only give host
tensors. ``cpu_is_device=True`` makes every CPU tensor that is not known to be
a host copy count as device, to count every extraction when the inputs are
built inside the code under test.

With ``follow_placement=True`` (implied by ``device_modules``), placement is
followed the way code places tensors: ``.device`` of a device
stand-in answers :data:`DEVICE` (``torch.device("cpu", 0)``, a CPU device
that is not ``"cpu"``), and a tensor created on it (``torch.tensor(data,
device=d)``, ``torch.zeros(n, device=d)``) or moved to it (``.to(d)``,
``.to(device=d, non_blocking=True)``, ``.cuda()``, ``dev.copy_(host)``) is a
device tensor; ``.to("cpu")`` / ``.cpu()`` is a read; tensors made from host
data or by factories without a device (``torch.from_numpy``,
``torch.tensor(list)``, ``torch.arange(n)``) are host tensors, even under
``cpu_is_device``. ``.to(d)`` of a tensor already on the device (same dtype, no
``copy=True``) is that tensor itself, as on a device, so what code attached to it stays. (Off by default: code that keys a cache on the device
would see a second device.) Whatever the setting, a copy of host data to the device
that is not ``non_blocking=True`` (``.to(d)``, ``.cuda()``,
``torch.tensor(data, device=d)``, ``t.new_tensor(data)``, ``dev.copy_(host)``)
is a blocking host->device copy: recorded in ``h2d_events`` (its own count,
``h2d_count``), never in ``events``/``count``. So is a host index tensor into a
device tensor (``dev[torch.arange(3)]``: the index goes to the device first).
A factory (``torch.arange``, ``torch.zeros`` ...) is placed by its ``device=``
alone: a device scalar among its arguments is read, it does not make the output
a device tensor.

Checked against a real device: ``benchmarks/bench_cuda_syncs.py`` counts the
same forwards with CUDA's sync-debug mode (``benchmarks/results/cuda-syncs.txt``);
its single-operation calibration is a test here (tests/test_testing_syncs.py),
with the two places where the counter's rule is not CUDA's: device repeats in
``repeat_interleave`` count one read (CUDA synchronises twice) and
``.to("cpu", non_blocking=True)`` of a device tensor counts one (CUDA reports
none; the host cannot use the values before the copy lands).

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
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

import npu_shim.emulation as _emulation
from npu_shim.emulation._registry import host_arguments

__all__ = ["DEVICE", "HostArgumentError", "HostSyncCounter", "SyncEvent", "count_host_syncs"]

# The stand-in device on CPU-only machines: what ``.device`` of a device stand-in answers.
DEVICE = torch.device("cpu", 0)

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
_DEVICE_GETTER = torch._C.TensorBase.device
# Factories whose data comes from the host: on a device, a blocking copy.
_FROM_HOST_DATA = {torch.tensor, torch.as_tensor, torch.asarray}

_aten = torch.ops.aten
_SCALAR_READS = {_aten._local_scalar_dense.default, _aten.item.default}
_SHAPE_ATEN = {_aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default,
               _aten._unique.default, _aten.unique_dim.default, _aten.unique_consecutive.default,
               _aten.argwhere.default, _aten.nonzero_numpy.default}
_REPEAT_ATEN = {_aten.repeat_interleave.Tensor, _aten.repeat_interleave.self_Tensor}
_INDEX_ATEN = {_aten.index.Tensor, _aten.index_put.default, _aten.index_put_.default}
# Ops that answer a Python value computed on the device (a bool): a read.
_ANSWER_ATEN = {_aten.equal.default}
# Factories: where their output lives is their ``device=`` alone; a device scalar among their
# arguments is read to the host (a size, a bound), it does not place the output.
_FACTORIES = {torch.arange, torch.range, torch.linspace, torch.logspace, torch.zeros, torch.ones,
              torch.empty, torch.full, torch.rand, torch.randn, torch.randint, torch.randperm,
              torch.eye, torch.tril_indices, torch.triu_indices}

# Frames skipped when naming the caller: torch itself, this package, the emulated
# torch_npu's call wrappers (a host_arg read is the caller's), contextlib.
_SKIP_DIRS = tuple(os.path.dirname(os.path.abspath(m.__file__)) + os.sep
                   for m in (torch, sys.modules[__name__], _emulation))
_SKIP_FILES = {os.path.abspath(contextlib.__file__)}


class SyncEvent(NamedTuple):
    kind: str       # item, tolist, numpy, cpu, to, copy_, bool, int, float, index, shape, scalar,
                    # host_arg; h2d for a blocking host->device copy (in h2d_events only)
    location: str   # "dir/file.py:line in function" of the code that caused it
    detail: str = ""  # host_arg: "<argument> of <op>"

    def __str__(self):
        kind = "%s (%s)" % (self.kind, self.detail) if self.detail else self.kind
        return "%s at %s" % (kind, self.location)


class HostArgumentError(RuntimeError):
    """strict mode: a device tensor handed to a torch_npu op where it reads host data."""


class HostSyncCounter:
    """Events seen so far; ``count`` is their number. Blocking host->device
    copies are kept apart: ``h2d_events`` / ``h2d_count``."""

    def __init__(self, device_tensors=(), cpu_is_device=False, device_modules=(),
                 follow_placement=False, strict=False):
        self.events = []
        self.strict = strict
        self.follow_placement = follow_placement or bool(device_modules)
        self.h2d_events = []
        self.cpu_is_device = cpu_is_device
        self._device = {}
        self._host = {}
        self._frames = []        # one [recorded, opaque] per torch call in progress
        for t in device_tensors:
            self.mark_device(t)
        for module in device_modules:
            self.mark_device(*module.parameters(), *module.buffers())

    @property
    def count(self):
        return len(self.events)

    @property
    def h2d_count(self):
        return len(self.h2d_events)

    def kinds(self):
        return Counter(e.kind for e in self.events)

    def summary(self):
        text = "%d host syncs: %s" % (self.count, ", ".join(
            "%s x%d" % kv for kv in sorted(self.kinds().items())))
        if self.h2d_events:
            text += "; %d blocking host->device copies" % self.h2d_count
        return text

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

    def _record(self, kind, detail="", at_dispatch=False):
        self.events.append(SyncEvent(kind, _caller_location(), detail))
        if self._frames and not at_dispatch:
            # The function layer named this call's read: the dispatch layer must not count the
            # same read again. A read the dispatch layer counts leaves the call open to more
            # (``t.reshape(t[2], t[6])`` reads two sizes).
            self._frames[-1][0] = True

    def _record_h2d(self):
        self.h2d_events.append(SyncEvent("h2d", _caller_location()))


def _caller_location():
    frame = sys._getframe(2)
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(_SKIP_DIRS) and path not in _SKIP_FILES:
            short = os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))
            return "%s:%d in %s" % (short, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return "<unknown>"


def _is_device_place(device):
    """Whether a ``device=`` argument names the device (the stand-in or a real one)."""
    if device is None:
        return False
    try:
        device = torch.device(device)
    except (TypeError, RuntimeError):
        return False
    return device.type not in ("cpu", "meta") or device.index is not None


def _npu_op_name(func):
    """The torch_npu op ``func`` calls (either spelling), or None."""
    if isinstance(func, torch._ops.OpOverload):
        return func._schema.name.partition("::")[2] if func.namespace == "npu" else None
    if isinstance(func, torch._ops.OpOverloadPacket):
        namespace, _, name = func._qualified_op_name.partition("::")
        return name if namespace == "npu" else None
    module = getattr(func, "__module__", None) or ""
    if module == "torch_npu" or module.startswith("torch_npu."):
        return getattr(func, "__name__", None)
    return None


def _opaque(func):
    """torch_npu ops (the emulation): one call, nothing of the body is counted."""
    if isinstance(func, torch._ops.OpOverload):
        return func.namespace == "npu"
    if isinstance(func, torch._ops.OpOverloadPacket):
        return func._qualified_op_name.startswith("npu::")
    module = getattr(func, "__module__", None) or ""
    return module.startswith(("torch_npu", "npu_shim."))


def _placing(counter, inputs):
    """The inputs that place a call's output. A 0-d device tensor beside a host tensor with
    dimensions is read as a number (``x.reshape(h // 2, ...)`` with ``h`` from a device grid):
    on a device, a host tensor takes no device tensor as data, so the output stays where the
    host tensor is."""
    if any(counter.is_host(x) and x.dim() > 0 for x in inputs):
        return [x for x in inputs if x.dim() > 0]
    return inputs


class _SyncMode(TorchFunctionMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        this = args[0] if args else None
        if c.follow_placement and getattr(func, "__self__", None) is _DEVICE_GETTER:
            device = func(*args, **kwargs)
            return DEVICE if device.type == "cpu" and c.is_device(this) else device
        was_device = c.is_device(this)
        c._frames.append([False, _opaque(func)])
        try:
            self._host_argument_reads(func, args, kwargs)
            transfer_out = self._classify(func, args, kwargs)
            result = this if transfer_out == "itself" else func(*args, **kwargs)
        finally:
            c._frames.pop()
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
        if transfer_out in ("keep", "itself"):
            return result
        inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
        if any(c.is_device(x) for x in _placing(c, inputs)):
            c.mark_device(*[o for o in outputs if o.device.type == "cpu"])
        elif inputs and c.cpu_is_device and all(c.is_host(x) for x in inputs):
            c.mark_host(*[o for o in outputs if o.device.type == "cpu"])
        elif not inputs and c.follow_placement:
            c.mark_host(*[o for o in outputs if o.device.type == "cpu"])
        return result

    def _host_argument_reads(self, func, args, kwargs):
        """A device tensor where a torch_npu op reads host data: one read each."""
        op = _npu_op_name(func)
        if op is None:
            return
        c = self.counter
        for arg, value in host_arguments(op, args, kwargs):
            items = value if isinstance(value, (list, tuple)) else (value,)
            for item in items:
                if not (isinstance(item, torch.Tensor) and c.is_device(item)):
                    continue
                if c.strict:
                    raise HostArgumentError(
                        "%s: %s is a device tensor; torch_npu reads this argument on the host, "
                        "so the op call would copy it device->host (pass host data: a list of "
                        "ints or a CPU tensor)" % (op, arg))
                c._record("host_arg", "%s of %s" % (arg, op))

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
            # _parse_to knows Tensor.to's placement arguments, not copy= (vLLM 0.31 passes it)
            placement = {key: value for key, value in kwargs.items() if key != "copy"}
            device, _dtype, non_blocking, _format = torch._C._nn._parse_to(*args[1:], **placement)
            other = args[1] if len(args) > 1 else kwargs.get("other")
            if isinstance(other, torch.Tensor) and device is not None \
                    and device.type == "cpu" and c.is_device(other):   # .to(device stand-in)
                device = DEVICE
            if device is None:
                return None
            if not _is_device_place(device):
                if c.is_device(this):
                    c._record("to")
                return "host"
            if c.is_device(this) and this.device.type == "cpu" and kwargs.get("copy") is not True \
                    and (_dtype is None or _dtype == this.dtype) \
                    and (_format is None or _format == torch.preserve_format):
                return "itself"          # on the device already: a device's .to returns the tensor
            if not c.is_device(this) and not non_blocking:
                c._record_h2d()
            return "device"
        if func in _TO_DEVICE:
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            if not c.is_device(this) and not non_blocking:
                c._record_h2d()
            return "device"
        if func is _T.copy_:
            src = args[1] if len(args) > 1 else kwargs.get("src")
            non_blocking = kwargs.get("non_blocking", args[2] if len(args) > 2 else False)
            if c.is_host(this) and c.is_device(src):
                c._record("copy_")
            elif c.is_device(this) and isinstance(src, torch.Tensor) and not c.is_device(src) \
                    and not non_blocking:
                c._record_h2d()
            return "keep"
        if func is _T.new_tensor:
            data = args[1] if len(args) > 1 else kwargs.get("data")
            device = kwargs.get("device")
            if (c.is_device(this) if device is None else _is_device_place(device)):
                if not c.is_device(data):
                    c._record_h2d()
                return "device"
            return None
        if func in _INDEXING:
            self._index_syncs(args[1] if len(args) > 1 else None, indexed_on_device=c.is_device(this))
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
            if (isinstance(repeats, torch.Tensor) and kwargs.get("output_size") is None
                    and c.is_device(repeats)):
                c._record("shape")
            return None
        device = kwargs.get("device")
        if device is not None and _is_device_place(device):
            if func in _FROM_HOST_DATA and not c.is_device(this):
                c._record_h2d()
            return "device"
        if func in _FACTORIES:
            # Placed by ``device=`` alone (above): a device scalar among the arguments is read
            # (a size, a bound), it does not put the output on the device. Unmarked, the output
            # is what any tensor the code builds is: host, or device under cpu_is_device.
            return "host" if c.follow_placement else "keep"
        return None

    def _index_syncs(self, index, indexed_on_device):
        c = self.counter
        items = index if isinstance(index, tuple) else (index,)
        for item in items:
            if isinstance(item, slice):
                for bound in (item.start, item.stop, item.step):
                    if isinstance(bound, torch.Tensor) and c.is_device(bound):
                        c._record("index")
            elif isinstance(item, torch.Tensor) and c.is_device(item):
                if item.dtype in (torch.bool, torch.uint8):
                    c._record("shape")
                elif item.dim() == 0 and not item.dtype.is_floating_point:
                    c._record("index")
            elif isinstance(item, torch.Tensor) and indexed_on_device and item.dim() > 0:
                # A host index tensor into a device tensor is copied to the device first, and
                # that copy is blocking (CUDA reports it: benchmarks/results/cuda-syncs.txt).
                c._record_h2d()


class _ScalarReadMode(TorchDispatchMode):
    """The net under the function mode: scalar reads and data-dependent shapes
    at the dispatcher, inside torch calls where the function mode recorded none."""

    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        c = self.counter
        frames = c._frames
        silent = any(frame[1] for frame in frames) or (frames and frames[-1][0])
        if not silent:
            kind = self._read(func, args, kwargs)
            if kind:
                c._record(kind, at_dispatch=True)
        result = func(*args, **kwargs)
        if not silent and func not in _SCALAR_READS:
            inputs = [x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor)]
            if any(c.is_device(x) for x in inputs):
                c.mark_device(*[o for o in tree_flatten(result)[0]
                                if isinstance(o, torch.Tensor) and o.device.type == "cpu"])
        return result

    def _read(self, func, args, kwargs):
        c = self.counter
        this = args[0] if args else None
        if func in _SCALAR_READS:
            return "scalar" if c.is_device(this) else None
        if func in _ANSWER_ATEN:
            return "equal" if any(c.is_device(x) for x in args[:2]) else None
        if func in _SHAPE_ATEN:
            return "shape" if c.is_device(this) else None
        if func in _REPEAT_ATEN:
            repeats = args[1] if func is _aten.repeat_interleave.self_Tensor else this
            if kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None):
                return "shape" if c.is_device(repeats) else None
            return None
        if func in _INDEX_ATEN:
            indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
            for index in indices or ():
                if (isinstance(index, torch.Tensor) and index.dtype in (torch.bool, torch.uint8)
                        and c.is_device(index)):
                    return "shape"
        return None


@contextlib.contextmanager
def count_host_syncs(device_tensors=(), *, cpu_is_device=False, device_modules=(),
                     follow_placement=False, strict=False):
    """Count host syncs inside the block; yields a :class:`HostSyncCounter`.

    ``device_tensors``: CPU tensors that stand in for device tensors (see the
    module docstring); ``device_modules``: modules whose parameters and buffers
    do (giving them implies ``follow_placement``). Real device tensors always
    count as device tensors. ``follow_placement``: ``.device`` of a device
    stand-in answers :data:`DEVICE`, and tensors made by factories without a
    ``device`` are host tensors (see the module docstring).
    ``cpu_is_device``: treat every CPU tensor not known to be a host copy as a
    device tensor. ``strict``: a device tensor handed to a torch_npu op where it
    reads host data raises :class:`HostArgumentError` (naming the op and the
    argument) instead of counting as a read.
    """
    counter = HostSyncCounter(device_tensors, cpu_is_device, device_modules, follow_placement,
                              strict)
    with _ScalarReadMode(counter), _SyncMode(counter):
        yield counter


def collect_host_syncs(counters):
    """``around(device_tensors)``: a context manager that counts host syncs over its block
    (:func:`count_host_syncs`, those tensors standing in for device tensors) and appends its
    :class:`HostSyncCounter` to ``counters`` -- for helpers that open the block themselves
    around the step they are handed the tensors of (``npu_shim.testing.mimo.ascend_prefill_decode``'s
    ``around_decode``)."""
    @contextlib.contextmanager
    def around(device_tensors):
        with count_host_syncs(device_tensors=device_tensors) as counter:
            counters.append(counter)
            yield counter

    return around
