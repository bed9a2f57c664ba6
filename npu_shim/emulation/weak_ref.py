"""Emulated ``torch_npu._C._weak_ref_tensor``: a tensor on the same memory that does not own it.

On the device (torch_npu), ``_weak_ref_tensor(t)`` returns a tensor over ``t``'s memory that does
not count as an owner: once the last owning tensor is gone, the NPU caching allocator takes the
block back and hands it to the next allocation, while the weak tensor still points at it.
vllm-ascend calls it through ``vllm_ascend.utils.weak_ref_tensor(s)`` (every tensor up to
0.28.0rc1; from 0.29.0rc1 only tensors whose device type is ``"npu"``, so on a CPU machine that
helper hands a CPU tensor back itself, a strong reference).

Hardware evidence (vllm-project/vllm-ascend PR #16794): the encoder ACL graph kept its output
buffer and its FIA workspaces only through such weak tensors after capture; the allocator reused
that memory and the graph's replay, which writes at the addresses baked at capture, failed with
error 507011 (invalid address) on Ascend 910_93 (GLM-5.3-Flash, TP16).

What the emulation does: the weak tensor aliases the owner's storage (a second tensor on the same
``UntypedStorage``, not a view, so it keeps no owning tensor alive through ``_base``), and a
ledger counts, per storage, the weak tensors alive. The memory counts as *released* (the device
allocator may reuse it) once the storage has no holder but weak tensors. On this CPU the bytes
stay mapped (the alias holds them, so nothing here reads or writes freed memory); what the
hardware would do with them is reported by :func:`require_alive`, which the emulated replay of a
captured graph calls for every buffer the replay writes into: a released one raises
:class:`DeviceMemoryError` naming 507011. Plain torch ops on a weak tensor are not checked (they
run as on any CPU tensor): only the code that asks :func:`require_alive` sees a release.

Limits: what the real allocator reuses, and when, is not modelled (a released block is treated as
reused at once, the worst case the PR met); a view taken *of* a weak tensor counts as an owner.
"""
import threading
import weakref

import torch

__all__ = ["DeviceMemoryError", "ERROR_CODE", "weak_ref_tensor", "is_weak", "released", "require_alive"]

# ACL's "invalid address" error, what replay raised on the device (vllm-ascend PR #16794).
ERROR_CODE = 507011

_lock = threading.Lock()
_weak_per_storage = {}          # storage key -> number of weak tensors alive on it
_WEAK_MARK = "_npu_shim_weak_ref"


class DeviceMemoryError(RuntimeError):
    """A device access to memory whose owner was released (ACL error 507011 on the device)."""


def _key(tensor):
    return tensor.untyped_storage()._cdata


def _forget(key):
    with _lock:
        left = _weak_per_storage.get(key, 0) - 1
        if left > 0:
            _weak_per_storage[key] = left
        else:
            _weak_per_storage.pop(key, None)


def weak_ref_tensor(tensor):
    """``torch_npu._C._weak_ref_tensor``: a tensor with ``tensor``'s size, strides, offset and
    memory that does not count as its owner (see the module docstring)."""
    if not isinstance(tensor, torch.Tensor):
        raise TypeError("_weak_ref_tensor expects a torch.Tensor, not %s" % type(tensor).__name__)
    weak = torch.empty(0, dtype=tensor.dtype, device=tensor.device).set_(
        tensor.untyped_storage(), tensor.storage_offset(), tensor.size(), tensor.stride())
    key = _key(weak)
    with _lock:
        _weak_per_storage[key] = _weak_per_storage.get(key, 0) + 1
    setattr(weak, _WEAK_MARK, True)
    weakref.finalize(weak, _forget, key)
    return weak


def is_weak(tensor) -> bool:
    """True for a tensor made by :func:`weak_ref_tensor`."""
    return bool(getattr(tensor, _WEAK_MARK, False))


def released(tensor) -> bool:
    """True when ``tensor``'s memory has no owner left but weak tensors: on the device the
    allocator may have handed it to another allocation."""
    storage = tensor.untyped_storage()
    key = storage._cdata
    with _lock:
        weak = _weak_per_storage.get(key, 0)
    # use count: this function's `storage` wrapper, the weak tensors, the owners
    owners = torch._C._storage_Use_Count(key) - 1 - weak
    return owners <= 0


def require_alive(tensor, what: str):
    """``tensor`` unless it is a weak tensor whose memory was released: then the
    :class:`DeviceMemoryError` the device raises when a replay writes there (507011)."""
    if tensor is not None and released(tensor):
        raise DeviceMemoryError(
            "emulated ACL error %d (invalid address): %s at 0x%x was held only by weak tensors "
            "(torch_npu._C._weak_ref_tensor) and its owner was released; on the device the allocator "
            "reuses that memory and the graph replay that writes there fails (vllm-ascend PR #16794)"
            % (ERROR_CODE, what, tensor.data_ptr()))
    return tensor
