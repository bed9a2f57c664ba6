"""An emulated Ascend device: ``npu`` as a real device type, backed by host memory.

For tests and development only; the production path never imports it (only
:func:`npu_shim.emulation.install` at start-up, under ``NPU_SHIM_EMULATE=1`` and
``NPU_SHIM_EMULATE_DEVICE=1``, and tests do).

Switch: ``NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1 <the command run on the NPU box>``.
``NPU_SHIM_EMULATE=1`` alone keeps today's emulation (``torch.npu.is_available()`` False,
no device), which the existing tests rely on. ``NPU_SHIM_EMULATE_DEVICE_MEMORY_MIB`` sets the
device's memory (default 65536, a 64 GiB Atlas A2 card).

Mechanism (why this one)
------------------------
PyTorch's PrivateUse1 key renamed ``npu`` with
``torch.utils.backend_registration._setup_privateuseone_for_python_backend`` (the route of
PyTorch's ``test/test_privateuseone_python_backend.py``), and every device tensor an
:class:`NpuTensor`: a ``__torch_dispatch__`` wrapper subclass whose ``.device`` is
``npu:0`` and which holds a plain CPU tensor (``_raw``). Each aten op that reaches a
wrapper is run on the held CPU tensors and its tensor results are wrapped again, so a
result of an op on the device is always on the device. Factories with ``device="npu"``
reach the PrivateUse1 key; ``empty.memory_format`` / ``empty_strided`` / ``arange``
are registered there (everything else there is built from those by PyTorch's composite
kernels), and a PrivateUse1 fallback refuses any other op by name.

Why not OpenReg: ``torch_openreg`` is a C++ extension (allocator, guard, hooks) that
must be compiled against the exact torch, which a pure-Python shim cannot ship; the older
Python-first ``pytorch_openreg`` runs every op in a second process (a "driver"), paying an
IPC round trip per op. The wrapper keeps data in this process and each op one Python call.
Why not today's counted ``cpu:0`` stand-ins: upstream code that allocates on ``npu``,
asks ``torch.npu`` for memory or opens ``hccl`` cannot run on them.

Counted at dispatch: every device->host transfer (:func:`count_transfers`): a scalar
read (``_local_scalar_dense``: ``.item()``, ``bool()``/``int()``/``float()``, ``.tolist()``),
a copy to the host (``_to_copy``/``copy_`` to ``cpu``: ``.cpu()``, ``.to("cpu")``), a
bool computed on the device (``equal``, ``is_nonzero``), and ops whose output shape depends
on device data (``nonzero``, ``masked_select``, ``unique*``, ``repeat_interleave`` with
tensor repeats and no ``output_size``, boolean-mask indexing). The kind is the Python call
that made it when the wrapper's ``__torch_function__`` saw one (``item``, ``tolist``,
``cpu``, ``to``, ``bool`` ...), else the aten op's. Inside an emulated torch_npu op the
count is silent (the body stands in for a kernel), except for its host-only arguments
(``_registry.HOST_ARGS``): a device tensor there is one ``host_arg`` transfer, as in
:mod:`npu_shim.testing.syncs`.

Parameters: ``nn.Parameter(t)`` of a device tensor ``t`` (and of a Parameter subclass: vLLM's
``BasevLLMParameter`` family) is an instance of :func:`parameter_class` ``(cls)``, ``cls`` mixed with
:class:`NpuTensor` (made once per class, cached, same name), sharing ``t``'s held host tensor:
``isinstance`` with ``cls`` and with ``nn.Parameter`` holds, ``cls.__init__`` runs (weight loaders
stored), its methods write into the device data through ``.data``, and NpuTensor's
``__torch_dispatch__`` / ``__torch_function__`` replace ``cls``'s (every op on a parameter is counted
as any device op; a subclass's own ``__torch_function__`` is not run). PyTorch's own path would
return the device tensor itself, flagged ``_is_param``, losing the subclass. ``NpuTensor`` keeps its
held tensor in ``__dict__`` (``torch.Tensor``'s layout), so code that assigns ``__class__`` between a
plain (meta) tensor and a device parameter works (vLLM's ``to_meta_tensor``); the meta copy then
carries the held tensor in its ``__dict__``, and ``materialize_meta_tensor`` puts that held tensor
back (the reloaded parameter reuses the old host data, of the same shape). ``t.data = x`` moves the
held tensor with the metadata. ``.to("meta")`` is no transfer.

Ops upstream registered for the device: an op outside torch's namespaces with a kernel for
PrivateUse1 (vLLM's ``direct_register_custom_op`` ops on vllm-ascend's platform:
``vllm::unquantized_gemm`` ...) runs that kernel on the device tensors; one with a composite kernel
(the emulated torch_npu and ``_C_ascend`` ops) runs on the held host tensors; one with host kernels
only is refused by name.

Cost per op: ``benchmarks/bench_emulated_device.py`` (one Python ``__torch_dispatch__``
round trip per aten op; see docs/validation.md for the figures).

What it cannot model: time (ops complete before they return; streams and events are
synchronous no-ops, ``Event.elapsed_time`` raises); asynchronous copies (``non_blocking``
is a synchronous copy, and is still counted); Ascend's private formats (every tensor is
ND); graph capture (``NPUGraph`` stays a placeholder that raises: engines run eager);
collectives beyond one rank (``hccl`` is gloo on one process; its ``get_hccl_comm_name`` a name only); a device tensor's storage
(the wrapper has none of its own: ``untyped_storage()`` answers the held host storage's size,
address and device, and refuses anything else, :class:`DeviceStorage`; ``data_ptr()`` is the held host
data's address, unique and shared by views as a device pointer is);
pinned host memory (ordinary host memory, :func:`_pinned_host_memory`; ``is_pinned()`` is False);
the memory a real allocator would reserve or fragment (``memory_reserved`` equals
``memory_allocated``); ``type(p) is cls`` for a device parameter (it is a subclass of ``cls``);
Triton kernels (no Triton here: the ones an engine needs are emulated launches,
:mod:`npu_shim.emulation.triton_kernels`); ops mixing a device tensor with a non-scalar host tensor are refused
as a device refuses them (indexing with a host index and copies excepted).
"""
import contextlib
import os
import threading
import weakref

import torch
from torch.utils._pytree import tree_flatten

__all__ = ["MEMORY_ENV", "NpuTensor", "TransferCounter", "UnsupportedOpError", "activate", "count_transfers",
           "is_active", "memory_allocated", "max_memory_allocated", "reset_peak_memory_stats", "total_memory"]

MEMORY_ENV = "NPU_SHIM_EMULATE_DEVICE_MEMORY_MIB"
DEFAULT_MEMORY_MIB = 65536
_aten = torch.ops.aten


class UnsupportedOpError(NotImplementedError):
    """An op the emulated device cannot run; the message names the op."""


# --------------------------------------------------------------------------- memory

_memory = {"allocated": 0, "peak": 0}
_owners = {}  # data_ptr of a held CPU storage -> nbytes


def total_memory():
    """Bytes of the emulated device (``NPU_SHIM_EMULATE_DEVICE_MEMORY_MIB``, default 64 GiB), read
    when first asked."""
    if "total" not in _memory:
        from npu_shim._config import env_positive_number

        _memory["total"] = int(env_positive_number(MEMORY_ENV, DEFAULT_MEMORY_MIB, os.environ) * 1024 * 1024)
    return _memory["total"]


def _release(ptr):
    nbytes = _owners.pop(ptr, 0)
    _memory["allocated"] -= nbytes


def _check_room(nbytes):
    total = total_memory()
    if _memory["allocated"] + nbytes > total:
        raise torch.OutOfMemoryError(
            "NPU out of memory (npu-shim emulated device): tried to allocate %d bytes; %d of %d bytes "
            "allocated (%s)" % (nbytes, _memory["allocated"], total, MEMORY_ENV))


def _account(raw):
    """Count ``raw``'s storage once, while any CPU tensor holding it lives."""
    if raw._base is not None:
        return
    storage = raw.untyped_storage()
    ptr, nbytes = storage.data_ptr(), storage.nbytes()
    if nbytes == 0 or ptr in _owners:
        return
    _check_room(nbytes)
    _owners[ptr] = nbytes
    _memory["allocated"] += nbytes
    _memory["peak"] = max(_memory["peak"], _memory["allocated"])
    weakref.finalize(raw, _release, ptr)


def memory_allocated(device=None):
    return _memory["allocated"]


def max_memory_allocated(device=None):
    return _memory["peak"]


def reset_peak_memory_stats(device=None):
    _memory["peak"] = _memory["allocated"]


def mem_get_info(device=None):
    total = total_memory()
    return total - _memory["allocated"], total


# --------------------------------------------------------------------------- transfers

class TransferCounter:
    """Device->host transfers seen at dispatch inside :func:`count_transfers`.

    ``events``: ``(kind, op)`` in order; ``count``; ``by_kind()``: a dict kind -> count."""

    def __init__(self):
        self.events = []

    @property
    def count(self):
        return len(self.events)

    def by_kind(self):
        out = {}
        for kind, _ in self.events:
            out[kind] = out.get(kind, 0) + 1
        return out

    def __repr__(self):
        return "TransferCounter(count=%d, %r)" % (self.count, self.by_kind())


_state = threading.local()


def _stack(name):
    value = getattr(_state, name, None)
    if value is None:
        value = []
        setattr(_state, name, value)
    return value


@contextlib.contextmanager
def count_transfers():
    """Count device->host transfers in the block; yields a :class:`TransferCounter`."""
    counter = TransferCounter()
    counters = _stack("counters")
    counters.append(counter)
    try:
        yield counter
    finally:
        counters.remove(counter)


def _record(kind, op):
    if _stack("silent"):
        return
    named = _stack("named")
    if named and named[-1][1] == 0:
        kind = named[-1][0]
        named[-1][1] = 1
    for counter in _stack("counters"):
        counter.events.append((kind, op))


_T = torch.Tensor
_TENSOR_DATA = torch._C.TensorBase.data  # the C getter/setter of ``Tensor.data``
# Python-level calls that read the device: their name is the transfer's kind.
_NAMED_READS = {
    _T.item: "item", _T.tolist: "tolist", _T.cpu: "cpu", _T.to: "to", _T.__bool__: "bool",
    _T.__int__: "int", _T.__float__: "float", _T.__index__: "index", _T.numpy: "numpy", _T.__array__: "numpy",
    _T.copy_: "copy_", torch.nonzero: "nonzero", _T.nonzero: "nonzero", torch.masked_select: "masked_select",
    _T.masked_select: "masked_select", torch.unique: "unique", _T.unique: "unique",
    torch.unique_consecutive: "unique_consecutive", _T.unique_consecutive: "unique_consecutive",
    torch.repeat_interleave: "repeat_interleave", _T.repeat_interleave: "repeat_interleave",
    _T.__getitem__: "getitem", torch.equal: "equal", _T.equal: "equal",
}
# aten ops whose output shape depends on device data (a read before the output exists).
_SHAPE_OPS = {
    _aten.nonzero.default, _aten.masked_select.default, _aten._unique2.default, _aten._unique.default,
    _aten.unique_dim.default, _aten.unique_consecutive.default, _aten.unique_dim_consecutive.default,
    _aten.argwhere.default,
}
_SCALAR_OPS = {_aten._local_scalar_dense.default, _aten.is_nonzero.default, _aten.equal.default,
               _aten.item.default}


def _target_device(func, args, kwargs):
    """The device a ``_to_copy`` / ``aten.to`` call copies to, or None (it stays)."""
    device = kwargs.get("device")
    if device is None and func.overloadpacket is _aten.to and len(args) > 1:
        if isinstance(args[1], torch.Tensor):
            device = args[1].device
        elif isinstance(args[1], (torch.device, str)):
            device = args[1]
    return None if device is None else torch.device(device)


def _is_read(func, args, kwargs):
    """The aten-level kind of a device->host transfer ``func`` makes, or None."""
    if func in _SCALAR_OPS:
        return "scalar"
    if func in _SHAPE_OPS:
        return "shape"
    if func is _aten.repeat_interleave.Tensor:
        return "shape" if kwargs.get("output_size") is None else None
    if func is _aten.repeat_interleave.self_Tensor:
        out_size = kwargs.get("output_size", args[3] if len(args) > 3 else None)
        return "shape" if out_size is None else None
    if func in (_aten.index.Tensor, _aten.index_put_.default, _aten.index_put.default,
                _aten._index_put_impl_.default):
        indices = args[1] if len(args) > 1 else kwargs.get("indices", ())
        if any(isinstance(i, NpuTensor) and i.dtype in (torch.bool, torch.uint8) for i in indices or ()):
            return "shape" if func is _aten.index.Tensor else None
        return None
    if func is _aten._to_copy.default or func.overloadpacket is _aten.to:
        # under inference_mode the dispatcher shows the composite aten.to itself
        device = _target_device(func, args, kwargs)
        # to ``meta``: shape and dtype only, no data leaves the device
        return "copy" if device is not None and device.type not in ("npu", "meta") else None
    if func is _aten.copy_.default:
        dst, src = args[0], args[1]
        return "copy" if isinstance(src, NpuTensor) and not isinstance(dst, NpuTensor) else None
    return None


# --------------------------------------------------------------------------- the tensor

_DEVICE = None  # torch.device("npu", 0) once activated


def _wrap(raw):
    _account(raw)
    return NpuTensor(raw)


def _unwrap(x):
    return x._raw if isinstance(x, NpuTensor) else x


# Ops that may take a non-scalar host tensor alongside a device tensor (as CUDA allows).
_MIXED_OK = {_aten.copy_.default, _aten._to_copy.default, _aten.index.Tensor, _aten.index_put_.default,
             _aten.index_put.default, _aten._index_put_impl_.default, _aten.set_.source_Tensor}


_PRIVATEUSE1 = torch._C.DispatchKeySet(torch._C.DispatchKey.PrivateUse1)
_device_kernels = {}  # an op outside torch's namespaces -> the kernel registered for the device, or None
# torch's own op namespaces: their ops run on the held host tensors (PyTorch's kernels, device-agnostic)
_TORCH_NAMESPACES = {"aten", "prims", "c10d", "_c10d_functional", "_c10d_functional_autograd", "profiler",
                     "quantized", "_quantized", "_dtensor", "higher_order", "rngprims", "debugprims", "inductor"}
_DEVICE_AGNOSTIC = ("CompositeExplicitAutograd", "CompositeExplicitAutogradNonFunctional",
                    "CompositeImplicitAutograd")


def _device_kernel(func):
    """The kernel an upstream library registered for the device's key, for an op outside torch's
    namespaces (vLLM's ``direct_register_custom_op`` registers its custom ops, ``vllm::unquantized_gemm``
    and the like, for ``current_platform.dispatch_key``, ``PrivateUse1`` on vllm-ascend's platform): the
    device runs it as the hardware would, the registered body on the device tensors. Such an op with
    a composite kernel (the emulated torch_npu and ``_C_ascend`` ops) runs on the held host tensors, as
    aten's do; one with kernels for other devices only (a CPU kernel) is refused by name, as a device
    without its kernel refuses it (never the host kernel in its place)."""
    try:
        return _device_kernels[func]
    except KeyError:
        pass
    kernel, name = None, func.name()
    if func.namespace not in _TORCH_NAMESPACES:
        if torch._C._dispatch_has_kernel_for_dispatch_key(name, "PrivateUse1"):
            get_kernel = getattr(torch.library, "get_kernel", None)
            if get_kernel is None:
                raise UnsupportedOpError("npu-shim emulated device: %s has a kernel for the device, and this "
                                         "torch cannot call it (torch.library.get_kernel: torch 2.9 on)" % (func,))
            kernel = get_kernel(func, "PrivateUse1")
        elif not any(torch._C._dispatch_has_kernel_for_dispatch_key(name, key) for key in _DEVICE_AGNOSTIC):
            raise UnsupportedOpError("npu-shim emulated device has no kernel for %s (it has kernels for other "
                                     "devices only; its host kernel is not run in its place)" % (func,))
    _device_kernels[func] = kernel
    return kernel


class NpuTensor(torch.Tensor):
    """A tensor on the emulated ``npu:0``: metadata of its own, data in a held CPU tensor.

    The held tensor is an instance attribute (``_raw``, in ``__dict__``, not a slot): the class's
    layout is ``torch.Tensor``'s, so code that moves a tensor's class between a plain tensor and a
    device tensor (vLLM's ``to_meta_tensor`` / ``materialize_meta_tensor``) can assign ``__class__``."""

    @staticmethod
    def __new__(cls, raw, requires_grad=None):
        self = torch.Tensor._make_wrapper_subclass(
            cls, raw.shape, strides=raw.stride(), storage_offset=raw.storage_offset(), dtype=raw.dtype,
            layout=raw.layout, device=_DEVICE,
            requires_grad=raw.requires_grad if requires_grad is None else requires_grad)
        self._raw = raw
        return self

    @property
    def data(self):
        return _TENSOR_DATA.__get__(self)

    @data.setter
    def data(self, value):
        """``t.data = other`` (``Module._apply``, weight post-processing): PyTorch moves the
        metadata; the held host tensor moves with it (else the wrapper would describe one tensor
        and hold another)."""
        _TENSOR_DATA.__set__(self, value)
        self._raw = value._raw if isinstance(value, NpuTensor) else value

    def __repr__(self, *, tensor_contents=None):
        return "NpuTensor(%s, device='npu:0')" % (self._raw.detach(),)

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kind = _NAMED_READS.get(func)
        if kind is None:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        named = _stack("named")
        named.append([kind, 0])
        try:
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **(kwargs or {}))
        finally:
            named.pop()

    @classmethod
    def __torch_dispatch__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        kernel = _device_kernel(func)
        if kernel is not None:  # an op upstream registered for the device: its kernel, on device tensors
            return kernel.call_boxed(_PRIVATEUSE1, *args, **kwargs)
        kind = _is_read(func, args, kwargs)
        if kind is not None:
            _record(kind, str(func))
        inputs = {}  # id(held CPU tensor) -> its wrapper: a result that is one (in-place, out=) is that wrapper
        check = func not in _MIXED_OK

        def unwrap(x):
            if isinstance(x, NpuTensor):
                inputs[id(x._raw)] = x
                return x._raw
            if isinstance(x, (list, tuple)):
                return type(x)(unwrap(y) for y in x)
            if check and isinstance(x, torch.Tensor) and x.dim() > 0 and x.device.type != "meta":
                raise RuntimeError(
                    "npu-shim emulated device: %s got a tensor on npu:0 and a tensor on %s "
                    "(expected all tensors to be on the same device)" % (func, x.device))
            return x

        raw_args = unwrap(args)
        raw_kwargs = {key: unwrap(value) for key, value in kwargs.items()}
        device = raw_kwargs.get("device")
        # an op asked for another device (``empty_like(x, device="cpu")``, ``x.new_empty(n, device="cpu")``)
        # makes a host tensor, as on a device: its result is not wrapped
        to_host = device is not None and torch.device(device).type != "npu"
        if device is not None and not to_host:
            raw_kwargs["device"] = "cpu"
        elif func.overloadpacket is _aten.to and len(raw_args) > 1 and isinstance(raw_args[1], (torch.device, str)):
            if torch.device(raw_args[1]).type == "npu":
                raw_args = (raw_args[0], "cpu") + tuple(raw_args[2:])
            else:  # aten.to(x, "meta") under inference mode: a tensor of that device, not wrapped
                to_host = True
        try:
            out = func(*raw_args, **raw_kwargs)
        except NotImplementedError as error:
            raise UnsupportedOpError("npu-shim emulated device cannot run %s: %s" % (func, error)) from error
        if kind == "copy":  # to the host: the host tensor itself (a new one, as a copy from a device is)
            if func is _aten.copy_.default:
                return args[0]
            return out.clone() if any(out is raw for raw in (getattr(a, "_raw", None) for a in args)) else out

        # a view of a normal tensor made in inference mode is a normal tensor (as on any device)
        normal_view = func.is_view and torch.is_inference_mode_enabled() and \
            any(not w.is_inference() for w in inputs.values())

        def rewrap(x):
            if isinstance(x, torch.Tensor):
                held = inputs.get(id(x))
                if held is not None:
                    return held
                if to_host:
                    return x
                if normal_view:
                    with torch.inference_mode(False):
                        return _wrap(x)
                return _wrap(x)
            if isinstance(x, (list, tuple)):
                return type(x)(rewrap(y) for y in x)
            return x

        return rewrap(out)

    def tolist(self):
        """PyTorch refuses ``tolist`` of a subclass: the host copy's list (one read, kind ``tolist``)."""
        named = _stack("named")
        named.append(["tolist", 0])
        try:
            with torch._C.DisableTorchFunctionSubclass():
                return _T.cpu(self).tolist()
        finally:
            named.pop()

    def numpy(self, *, force=False):
        raise TypeError("can't convert npu:0 device type tensor to numpy. Use Tensor.cpu() to copy the "
                        "tensor to host memory first.")

    __array__ = numpy

    def untyped_storage(self):
        """The held host storage's size and address, as the device storage's (:class:`DeviceStorage`)."""
        return DeviceStorage(self._raw.untyped_storage())

    def data_ptr(self):
        """The held host data's address: unique among live tensors, shared by views of one
        storage, as a device pointer is (code keys caches and checks aliasing on it)."""
        return self._raw.data_ptr()


# --------------------------------------------------------------------------- parameters

_PARAMETER_CLASSES = {}  # a Parameter (sub)class -> its device class
_parameter_new = None  # torch.nn.Parameter.__new__ before activate()


def parameter_class(cls):
    """The class of a device parameter made as ``cls(data)``: ``cls`` (``nn.Parameter`` or a subclass
    such as vLLM's ``ModelWeightParameter``) mixed with :class:`NpuTensor`, made once per class and
    cached. Its instances are ``cls`` instances (its methods, properties and ``__init__``: vLLM's weight
    loaders) and device tensors (NpuTensor's held data and its ``__torch_dispatch__`` /
    ``__torch_function__``, which replace any ``cls`` defines: the device's dispatch and transfer
    counting run for every op on them, as for any device tensor)."""
    if issubclass(cls, NpuTensor):
        return cls
    combined = _PARAMETER_CLASSES.get(cls)
    if combined is None:
        combined = type(cls.__name__, (cls, NpuTensor), {
            "__module__": cls.__module__, "__qualname__": cls.__qualname__,
            "__torch_function__": NpuTensor.__dict__["__torch_function__"],
            "__torch_dispatch__": NpuTensor.__dict__["__torch_dispatch__"],
            "__doc__": "%s on the emulated npu:0 (npu_shim.emulation.device.parameter_class)" % cls.__qualname__})
        _PARAMETER_CLASSES[cls] = combined
    return combined


def _parameter_new_on_device(cls, data=None, requires_grad=True):
    """``nn.Parameter.__new__`` with the device active. For a device tensor, PyTorch's path for tensor
    subclasses returns the data's own class with a flag (``_is_param``), so a Parameter subclass is
    lost and its ``__init__`` never runs; here it is an instance of :func:`parameter_class` ``(cls)``
    sharing the data's held host tensor (as ``Parameter(t)`` shares ``t``'s storage). Anything else:
    PyTorch's own path."""
    if isinstance(data, NpuTensor):
        return NpuTensor.__new__(parameter_class(cls), data._raw.detach(), requires_grad=requires_grad)
    return _parameter_new(cls, data, requires_grad)


class DeviceStorage:
    """``untyped_storage()`` of an npu tensor: what code asks a device storage without touching its bytes
    (``nbytes()``, ``size()``, ``data_ptr()``, ``device``), answered from the held host storage. Anything
    else (resizing, copying, sharing it) would act on host memory behind the device's back: refused by
    name (UnsupportedOpError)."""

    def __init__(self, host):
        self._host = host

    @property
    def device(self):
        return _DEVICE

    def nbytes(self):
        return self._host.nbytes()

    def size(self):
        return self._host.size()

    def data_ptr(self):
        return self._host.data_ptr()

    def __len__(self):
        return self._host.size()

    def __getattr__(self, name):
        raise UnsupportedOpError("npu-shim emulated device: untyped_storage().%s of an npu tensor (the "
                                 "emulated device's storage answers nbytes, size, data_ptr and device only)"
                                 % name)


# --------------------------------------------------------------------------- PrivateUse1 kernels

def _cpu_kwargs(kwargs):
    kwargs = dict(kwargs)
    kwargs["device"] = "cpu"
    kwargs.pop("pin_memory", None)
    return kwargs


def _factory(op):
    def kernel(*args, **kwargs):
        if op in (_aten.empty.memory_format, _aten.empty_strided.default):  # refuse before the host allocates
            numel = 1
            for n in args[0]:
                numel *= int(n)
            _check_room(numel * torch.empty((), dtype=kwargs.get("dtype") or torch.get_default_dtype()).element_size())
        return _wrap(op(*args, **_cpu_kwargs(kwargs)))
    return kernel


def _below_python(op):
    """A kernel for calls that reach PrivateUse1 with the Python key excluded (PyTorch's own
    C++, e.g. ``torch.tensor(data, device=...)``): the wrapper's dispatch."""
    def kernel(*args, **kwargs):
        return NpuTensor.__torch_dispatch__(op, (), args, kwargs)
    return kernel


def _fallback(op, *args, **kwargs):
    if any(isinstance(x, NpuTensor) for x in tree_flatten((args, kwargs))[0]):
        return NpuTensor.__torch_dispatch__(op, (), args, kwargs)
    raise UnsupportedOpError("npu-shim emulated device has no kernel for %s with these arguments "
                             "(no npu tensor to run it on; a device-only factory?)" % (op,))


# --------------------------------------------------------------------------- pinned host memory

def _pinned_host_memory(lib):
    """Pinned (page-locked) host memory for the emulated device: ordinary host memory.

    Engines allocate their host staging buffers with ``pin_memory=True`` and call
    ``Tensor.pin_memory()`` (vLLM's and vllm-ascend's model runners, unconditionally in places).
    PyTorch takes the pinned allocator of the current accelerator from its C++ hooks
    (``PrivateUse1HooksInterface::getPinnedMemoryAllocator``), which a Python backend cannot
    provide: every such call failed. Here the CPU kernels of ``empty.memory_format``,
    ``empty_strided`` and ``_pin_memory`` are wrapped (in this process, with the device active)
    to allocate plain host memory: page-locking only makes real host->device copies faster and
    asynchronous, and this device's copies are synchronous host copies anyway. ``is_pinned()``
    stays False (nothing is page-locked). Needs ``torch.library.get_kernel`` (torch 2.9 on);
    without it pinned requests keep failing in PyTorch, naming the hook.
    """
    get_kernel = getattr(torch.library, "get_kernel", None)
    if get_kernel is None:
        return False
    keys = torch._C.DispatchKeySet(torch._C.DispatchKey.CPU)
    empty = get_kernel("aten::empty.memory_format", "CPU")
    empty_strided = get_kernel("aten::empty_strided", "CPU")

    def empty_kernel(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
        return empty.call_boxed(keys, size, dtype=dtype, layout=layout, device=device, pin_memory=False,
                                memory_format=memory_format)

    def empty_strided_kernel(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
        return empty_strided.call_boxed(keys, size, stride, dtype=dtype, layout=layout, device=device,
                                        pin_memory=False)

    def pin_memory_kernel(self, device=None):
        return self.clone()

    import warnings

    with warnings.catch_warnings():  # "Overriding a previously registered kernel": that is the point
        warnings.simplefilter("ignore")
        lib.impl("empty.memory_format", empty_kernel, "CPU")
        lib.impl("empty_strided", empty_strided_kernel, "CPU")
        lib.impl("_pin_memory", pin_memory_kernel, "CPU")
    return True


# --------------------------------------------------------------------------- torch.npu

class _Hook(torch._C._acc.PrivateUse1Hooks):
    def is_available(self):
        return True

    def has_primary_context(self, dev_id):
        return True

    def is_built(self):
        return True


class _Guard(torch._C._acc.DeviceGuard):
    """One device, index 0 (the method names are those PyTorch's Python device guard calls)."""

    def type_(self):
        return torch._C._autograd.DeviceType.PrivateUse1

    def exchangeDevice(self, index):  # noqa: N802 (PyTorch's names)
        return 0

    def getDevice(self):  # noqa: N802
        return 0

    def setDevice(self, index):  # noqa: N802
        return None

    def uncheckedSetDevice(self, index):  # noqa: N802
        return None

    def deviceCount(self):  # noqa: N802
        return 1


_libraries = []
_active = False


def is_active():
    return _active


_hccl_backends = []  # every emulated hccl backend, kept alive: torch hands back this Python object


def _hccl_to_gloo(store, rank, size, timeout):
    """An ``hccl`` backend: gloo on one process, with torch_npu's ``get_hccl_comm_name``."""
    backend = _OneRankHccl(store, rank, size, timeout)
    _hccl_backends.append(backend)
    return backend


class _OneRankHccl(torch.distributed.ProcessGroupGloo):
    """One-rank gloo in the role of torch_npu's HCCL backend. torch_npu's page for
    ``_get_backend(torch.device("npu")).get_hccl_comm_name(rankid, init_comm=True) -> str``: the name
    of the group's communicator, which is initialised on the call (``init_comm=False`` on a
    communicator not yet initialised: an empty string, nothing initialised). vllm-ascend's MoE
    all-to-all token dispatchers, its MC2 paths and its linear ops read it at build. Emulated: a
    non-empty name of this group (no communicator exists: nothing is ever sent through it)."""

    def get_hccl_comm_name(self, rankid, init_comm=True):
        if not isinstance(rankid, int) or isinstance(rankid, bool) or rankid < 0:
            raise TypeError("get_hccl_comm_name: rankid must be a global rank (int >= 0), got %r" % (rankid,))
        if not init_comm and not getattr(self, "_npu_shim_comm_initialised", False):
            return ""
        self._npu_shim_comm_initialised = True
        return "npu_shim_hccl_%d" % _hccl_backends.index(self)


def _is_hccl_available():
    """``torch.distributed.is_hccl_available``, which torch_npu adds: hccl is registered (one-rank gloo)."""
    return "hccl" in torch.distributed.Backend.backend_list


def activate():
    """Make ``npu`` a device in this process (idempotent; cannot be undone: PyTorch renames
    PrivateUse1 once per process). Installs the emulated torch_npu first. Returns ``torch.npu``."""
    global _active, _DEVICE
    if _active:
        return torch.npu
    import npu_shim.emulation as emulation

    if not emulation.install():
        raise RuntimeError("npu_shim.emulation.device.activate: torch_npu is not the emulation "
                           "(a real torch_npu brings a real device)")
    import torch_npu
    from torch.utils.backend_registration import _setup_privateuseone_for_python_backend

    from npu_shim.emulation import _registry

    npu = torch_npu.npu
    npu._set_device_mode(True)
    _setup_privateuseone_for_python_backend(rename="npu", backend_module=npu, hook=_Hook(), device_guard=_Guard())
    _DEVICE = torch.device("npu", 0)
    lib = torch.library.Library("aten", "IMPL")
    for name, op in (("empty.memory_format", _aten.empty.memory_format), ("empty_strided", _aten.empty_strided.default),
                     ("arange", _aten.arange.default), ("arange.start", _aten.arange.start),
                     ("arange.start_step", _aten.arange.start_step)):
        lib.impl(name, _factory(op), "PrivateUse1")
    for name, op in (("copy_", _aten.copy_.default), ("_copy_from", _aten._copy_from.default),
                     ("_to_copy", _aten._to_copy.default)):
        lib.impl(name, _below_python(op), "PrivateUse1")
    host = torch.library.Library("aten", "IMPL")
    _pinned_host_memory(host)
    _libraries.append(host)
    fallback = torch.library.Library("_", "IMPL")
    fallback.fallback(_fallback, "PrivateUse1")
    _libraries.extend([lib, fallback])
    _registry.set_body_hook(_op_body)
    global _parameter_new
    _parameter_new = torch.nn.Parameter.__new__
    torch.nn.Parameter.__new__ = staticmethod(_parameter_new_on_device)
    import torch.distributed as dist

    if dist.is_available() and "hccl" not in dist.Backend.backend_list:
        dist.Backend.register_backend("hccl", _hccl_to_gloo, devices=["npu", "cpu"])
    if dist.is_available() and not hasattr(dist, "is_hccl_available"):
        dist.is_hccl_available = _is_hccl_available  # torch_npu sets it on torch.distributed
    _active = True
    return torch.npu


@contextlib.contextmanager
def _op_body(name, args, kwargs):
    """Around each emulated torch_npu op body: its host-only arguments that are device
    tensors are transfers (kind ``host_arg``); reads inside the body are not."""
    from npu_shim.emulation._registry import host_arguments

    for arg, value in host_arguments(name, args, kwargs):
        values = value if isinstance(value, (list, tuple)) else [value]
        for item in values:
            if isinstance(item, NpuTensor):
                _record("host_arg", "%s(%s=)" % (name, arg))
    silent = _stack("silent")
    silent.append(name)
    try:
        yield
    finally:
        silent.pop()
