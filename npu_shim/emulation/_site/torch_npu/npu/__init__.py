"""Device API of the emulated torch_npu: the SoC is emulated, a device is not.

``is_available()`` is False and ``device_count()`` 0, so frameworks keep tensors
on CPU/CUDA; ``get_soc_version()`` / ``get_device_name()`` report the emulated
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

__all__ = ["Event", "ExternalEvent", "NPUGraph", "Stream", "streams", "utils", "is_available", "device_count", "get_soc_version",
           "get_device_name", "current_stream", "default_stream", "synchronize", "stream", "config"]

NPUGraph = _placeholder_class("torch.npu.NPUGraph")
ExternalEvent = _placeholder_class("torch.npu.ExternalEvent")


class _Config:
    """``torch.npu.config`` (see the module docstring)."""

    allow_internal_format = False


config = _Config()


def is_available():
    return False


def device_count():
    return 0


def get_soc_version():
    return _soc.soc_version()


def get_device_name(device=None):
    return _soc.soc_name()


def current_stream(device=None):
    return Stream()


def default_stream(device=None):
    return Stream()


def synchronize(device=None):
    """Nothing is ever pending: emulated ops complete before they return."""


@contextlib.contextmanager
def stream(s=None):
    yield s
