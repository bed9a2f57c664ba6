"""The host lengths kept on a device tensor, and their one taking.

:func:`remember` is called where vLLM has just copied a host array to the
device; :func:`take` by the attention's host read
(:func:`npu_shim.patches.vllm_ascend.mm_encoder.common.host_values`).
:func:`keep_at_next_copy` arms a host tensor so that its next ``.to(...)`` remembers it
on the copy. No torch import at module level: the values are whatever the caller hands over.
"""
import weakref

from npu_shim.patches._shared.host_data import is_host
from npu_shim.patches._shared.transient import Transient

ATTR = "_npu_shim_host_lengths"
HOOK = "to"                       # the instance attribute that answers the tensor's next .to

__all__ = ["ATTR", "HOOK", "remember", "remember_lengths", "take", "keep_at_next_copy"]


class _Record(Transient):
    __slots__ = ("host", "data_ptr", "version", "length")

    def __init__(self, host, data_ptr, version, length):
        self.host, self.data_ptr, self.version, self.length = host, data_ptr, version, length


def _version(tensor):
    return None if tensor.is_inference() else tensor._version


def remember(device_tensor, host):
    """Keep ``host`` (a 1-D CPU tensor holding ``device_tensor``'s values) on it."""
    device_tensor.__dict__[ATTR] = _Record(host, device_tensor.data_ptr(), _version(device_tensor),
                                           device_tensor.numel())


def remember_lengths(device_tensor, host_of):
    """Keep ``host_of()`` (int32 lengths built on the host, or None) on ``device_tensor`` where
    that is a 1-D int32 tensor with nothing kept yet and the shapes match; ``host_of`` runs
    only then."""
    import torch

    if not isinstance(device_tensor, torch.Tensor) or device_tensor.dim() != 1 \
            or device_tensor.dtype != torch.int32 or ATTR in device_tensor.__dict__:
        return
    host = host_of()
    if host is not None and host.shape == device_tensor.shape:
        remember(device_tensor, host)


def take(tensor):
    """The host values kept on ``tensor`` by :func:`remember`, once; None if there are
    none, or if the tensor's storage, version or length changed since."""
    record = tensor.__dict__.pop(ATTR, None)
    if (record is None or record.data_ptr != tensor.data_ptr() or record.version != _version(tensor)
            or record.length != tensor.numel()):
        return None
    return record.host


def _to_keeping_host(host_ref):
    import torch

    def to(*args, **kwargs):
        host = host_ref()
        host.__dict__.pop(HOOK, None)
        result = torch.Tensor.to(host, *args, **kwargs)            # upstream's copy, its arguments
        if (isinstance(result, torch.Tensor) and result.dtype == host.dtype and result.shape == host.shape
                and ATTR not in result.__dict__):
            remember(result, host)
        return result
    return to


def keep_at_next_copy(host):
    """``host`` (a 1-D host tensor, :func:`~npu_shim.patches._shared.host_data.is_host`): its next
    ``.to(...)`` keeps it on the tensor returned; a device tensor (a stand-in's ``cpu:0``
    included) gets no hook. Returns whether ``host`` has the hook now."""
    if is_host(host) and host.dim() == 1 and HOOK not in host.__dict__:
        host.__dict__[HOOK] = _to_keeping_host(weakref.ref(host))
    return HOOK in getattr(host, "__dict__", {})
