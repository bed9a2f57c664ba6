"""The 310P aicpu IndexPut defect, emulated for the tests: a boolean-mask ``index_put_``
on a device tensor fails.

Hardware evidence (not reproduced here; this machine has no NPU):

* vllm-ascend issue #12086 (open): on a 310P (image ``v0.23.0rc1-310p``, CANN
  9.1.0-beta.1, torch_npu 2.10.0.post2) every image request kills the engine with
  aicpu error 507018; the minimal case is ``x[mask] = vals`` on an NPU float16
  tensor, which torch_npu dispatches to the aicpu IndexPut kernel. Reported again
  in #13050 (0.23.0) and #4419.
* vllm-ascend PR #12914 (open), one subprocess per case on 310P: mask on the NPU
  fails (507018), mask on the CPU fails (507018), ``index_copy_`` with integer
  indices works. PR #11435 reports the same kernel failure and the same way round it.

On the hardware the kernel runs asynchronously and the error surfaces at a later
op or at the next synchronisation (#12086 saw it at a ViT RMSNorm); here it is
raised at the ``index_put_`` itself, as a ``RuntimeError`` naming the code.

Kept apart from the emulated ``torch_npu`` package (which only adds ops) and from
every patch: torch's own indexing cannot be told apart per device on CPU stand-ins,
so a test enters :func:`aicpu_index_put_defect` with the predicate that says which
tensors stand for device tensors (``HostSyncCounter.is_device``). Only boolean or
uint8 masks are refused: what the evidence covers. The SoC is read on every call
(``NPU_SHIM_EMULATE_SOC``), so an A2 runs everything.
"""
import contextlib

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten

from npu_shim.emulation import soc

__all__ = ["AICPU_ERROR", "EVIDENCE", "aicpu_index_put_defect"]

AICPU_ERROR = 507018
EVIDENCE = "vllm-ascend #12086; PR #12914's 310P table"

_T = torch.Tensor
_SETITEM = {_T.__setitem__}
_INDEX_PUT = {_T.index_put_, _T.index_put, torch.index_put, torch.index_put_}


def _has_mask(index):
    return any(isinstance(item, torch.Tensor) and item.dtype in (torch.bool, torch.uint8)
               for item in tree_flatten(index)[0])


class _Defect(TorchFunctionMode):
    def __init__(self, is_device):
        super().__init__()
        self.is_device = is_device

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func in _SETITEM or func in _INDEX_PUT:
            target = args[0] if args else kwargs.get("input", kwargs.get("self"))
            index = args[1] if len(args) > 1 else kwargs.get("indices")
            if soc.is_310p() and self.is_device(target) and _has_mask(index):
                raise RuntimeError(
                    "emulated %s: boolean-mask index_put_ on a device tensor runs the aicpu IndexPut "
                    "kernel, which fails on 310P: error code is %d (%s)"
                    % (soc.soc_name(), AICPU_ERROR, EVIDENCE))
        return func(*args, **kwargs)


@contextlib.contextmanager
def aicpu_index_put_defect(is_device=None):
    """Inside the block, on an emulated 310P, a boolean-mask ``index_put_`` (``x[mask] = v``,
    ``x.index_put_((mask,), v)``) on a tensor ``is_device`` accepts raises RuntimeError with
    the hardware's error code. ``is_device`` default: a tensor whose device is not the CPU."""
    predicate = is_device or (lambda t: isinstance(t, torch.Tensor) and t.device.type not in ("cpu", "meta"))
    with _Defect(predicate):
        yield
