"""Device API of the emulated torch_npu: the SoC is emulated, a device only on request.

``is_available()`` is False and ``device_count()`` 0, so frameworks keep tensors
on CPU/CUDA; with the emulated device (``npu_shim.emulation.device``, switched on by
``NPU_SHIM_EMULATE_DEVICE=1``) it is a one-device machine: ``is_available()`` True,
``device_count()`` 1, ``set_device``/``current_device``, and the memory answers
(``mem_get_info``, ``memory_allocated`` ...) of its host-backed memory. Without the
device those memory answers raise, naming the switch; ``get_soc_version()`` / ``get_device_name()`` report the emulated
SoC (``NPU_SHIM_EMULATE_SOC``, default Ascend910B1) so kernels can choose their
path by device capability; ``utils.get_cann_version()`` the emulated CANN release
(``NPU_SHIM_EMULATE_CANN``). Streams and events are synchronous no-ops (see
``streams``).

Import placeholders (npu_shim.emulation.placeholders) for graph capture, which
vllm-ascend's ``compilation.acl_graph`` names in class annotations: ``NPUGraph``,
``ExternalEvent``. Instantiating one raises.

``config``: the ``torch.npu.config`` flags vllm-ascend's model runner module sets at import
(``allow_internal_format``: whether ops may keep tensors in Ascend's private formats, e.g. NZ).
The emulation keeps every tensor in the plain ND format whatever the flag says; the flag is
kept as set, nothing reads it.
"""
import contextlib

from npu_shim.emulation import soc as _soc
from npu_shim.emulation.placeholders import placeholder_class as _placeholder_class
from torch_npu.npu import streams, utils
from torch_npu.npu.streams import Event, Stream

__all__ = ["current_device", "set_device", "mem_get_info", "memory_allocated", "max_memory_allocated",
           "memory_reserved", "max_memory_reserved", "memory_stats", "reset_peak_memory_stats", "empty_cache", "get_device_properties",
           "is_initialized", "manual_seed", "manual_seed_all", "Event", "ExternalEvent", "NPUGraph", "Stream", "streams", "utils", "is_available", "device_count", "get_soc_version",
           "get_device_name", "current_stream", "default_stream", "synchronize", "stream", "config",
           "is_current_stream_capturing", "memory", "set_compile_mode", "is_jit_compile_false", "StreamContext"]

NPUGraph = _placeholder_class("torch.npu.NPUGraph")
ExternalEvent = _placeholder_class("torch.npu.ExternalEvent")


class _Config:
    """``torch.npu.config`` (see the module docstring)."""

    allow_internal_format = False


config = _Config()


_device_mode = False


def _set_device_mode(on):
    global _device_mode
    _device_mode = bool(on)


def is_available():
    return _device_mode


def device_count():
    return 1 if _device_mode else 0


def _device():
    if not _device_mode:
        raise RuntimeError("torch_npu emulation: no emulated device (set NPU_SHIM_EMULATE_DEVICE=1 "
                           "with NPU_SHIM_EMULATE=1, or call npu_shim.emulation.device.activate())")
    from npu_shim.emulation import device

    return device


def _index(device):
    if device is None:
        return 0
    if isinstance(device, int):
        return device
    import torch

    device = torch.device(device)
    if device.type != "npu":
        raise ValueError("torch_npu emulation: expected an npu device, got %r" % (device,))
    return 0 if device.index is None else device.index


def set_device(device):
    if _index(device) != 0:
        raise RuntimeError("torch_npu emulation: invalid device %r (the emulated machine has one NPU, 0)" % (device,))
    _device()


def current_device():
    _device()
    return 0


def is_initialized():
    return _device_mode


def _is_in_bad_fork():
    return False


def manual_seed(seed):
    """Seed the device's generator: the held host tensors draw from the CPU default generator.

    Not ``torch.manual_seed``: with the device active that seeds every custom device too
    (``torch.random._seed_custom_device`` calls this function), which recursed without end.
    """
    import torch

    torch.default_generator.manual_seed(int(seed))


manual_seed_all = manual_seed


def mem_get_info(device=None):
    return _device().mem_get_info(device)


def memory_allocated(device=None):
    return _device().memory_allocated(device)


def max_memory_allocated(device=None):
    return _device().max_memory_allocated(device)


memory_reserved = memory_allocated
max_memory_reserved = max_memory_allocated


def memory_stats(device=None):
    """``torch.npu.memory_stats``: torch_npu's caching-allocator statistics, as ``torch.cuda``'s
    (``allocated_bytes.all.current`` / ``.peak``, ``reserved_bytes.all.*``, ``active_bytes.all.*``,
    ``num_alloc_retries``, ``num_ooms``). No cache: reserved and active equal allocated."""
    device_module = _device()
    current, peak = device_module.memory_allocated(device), device_module.max_memory_allocated(device)
    stats = {"num_alloc_retries": 0, "num_ooms": 0}
    for kind in ("allocated_bytes", "reserved_bytes", "active_bytes"):
        stats[kind + ".all.current"] = current
        stats[kind + ".all.peak"] = peak
    return stats


def reset_peak_memory_stats(device=None):
    _device().reset_peak_memory_stats(device)


def empty_cache():
    """Nothing is cached: freed device tensors return their host memory at once."""
    _device()


class _Properties:
    def __init__(self, name, total_memory):
        self.name = name
        self.total_memory = total_memory

    def __repr__(self):
        return "_NPUDeviceProperties(name=%r, total_memory=%dMB)" % (self.name, self.total_memory >> 20)


def get_device_properties(device=None):
    return _Properties(get_device_name(device), _device().total_memory())


def get_soc_version():
    return _soc.soc_version()


def get_device_name(device=None):
    return _soc.soc_name()


def current_stream(device=None):
    return Stream()


def default_stream(device=None):
    return Stream()


def is_current_stream_capturing():
    """False: the emulation never captures a graph (``NPUGraph`` refuses; engines run eager)."""
    return False


def synchronize(device=None):
    """Nothing is ever pending: emulated ops complete before they return."""


_compile_mode = {"jit_compile": None}


def set_compile_mode(jit_compile=True):
    """Whether kernels are compiled online (True) or taken from CANN's prebuilt binaries (False).
    The emulated ops are PyTorch code either way: the choice is kept (``is_jit_compile_false``)."""
    _compile_mode["jit_compile"] = bool(jit_compile)


def is_jit_compile_false():
    return _compile_mode["jit_compile"] is False


def stream(s=None):
    """``torch.npu.stream(s)``: a :class:`StreamContext`, reusable as torch.cuda's is (sglang's scheduler
    makes one and enters it for every batch)."""
    return StreamContext(s)


class StreamContext:
    """``torch.npu.StreamContext(stream)``: makes ``stream`` current inside the block, as
    :func:`stream` does; every emulated stream is the same synchronous one."""

    def __init__(self, stream):
        self.stream = stream

    def __enter__(self):
        return self.stream

    def __exit__(self, *exc):
        return False


from torch_npu.npu import memory  # noqa: E402  (it re-exports the answers above)
