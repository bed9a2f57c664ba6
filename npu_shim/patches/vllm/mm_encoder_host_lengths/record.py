"""The host lengths kept on a device tensor, and their one taking.

:func:`remember` is called where vLLM has just copied a host array to the
device; :func:`take` by the attention's host read
(:func:`npu_shim.patches.vllm_ascend.mm_encoder.common.host_values`). No
torch import: the values are whatever the caller hands over.
"""
from npu_shim.patches._transient import Transient

ATTR = "_npu_shim_host_lengths"

__all__ = ["ATTR", "remember", "take"]


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


def take(tensor):
    """The host values kept on ``tensor`` by :func:`remember`, once; None if there are
    none, or if the tensor's storage, version or length changed since."""
    record = tensor.__dict__.pop(ATTR, None)
    if (record is None or record.data_ptr != tensor.data_ptr() or record.version != _version(tensor)
            or record.length != tensor.numel()):
        return None
    return record.host
