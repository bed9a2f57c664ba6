"""Release families of ``vllm.mm_encoder_host_lengths`` (on ``MMEncoderAttention``).

Both wrap the classmethod ``maybe_recompute_cu_seqlens(cls, attn_backend,
cu_seqlens, hidden_size, tp_size, device[, fp8_padded_hidden_size])``: the
original runs (its copy to the device included) and, unless the backend is
FlashInfer (offsets rescaled and padded), the host array it was given is kept
on the tensor it returns. Counters: ``calls`` per call of the tower (the nested call
vLLM's method makes through the out-of-tree class is the same call), ``upstream_calls``
where nothing was kept. They differ in the copy upstream makes, which
``check`` looks for: ``torch.from_numpy(cu_seqlens).to(device,
non_blocking=True)`` (0.18.0 .. 0.22.1) or ``async_tensor_h2d(cu_seqlens,
device=device)`` (0.24.0 on).
"""
import inspect
import threading

import numpy as np
import torch

from npu_shim.patch import TargetMismatch
from npu_shim.patches._shared import host_record
from npu_shim.patches._shared.code import names_in_code

METHOD = "maybe_recompute_cu_seqlens"
PARAMS = ("cls", "attn_backend", "cu_seqlens", "hidden_size", "tp_size", "device")
OPTIONAL_TAILS = {(), ("fp8_padded_hidden_size",)}
RESCALED_BY = "FLASHINFER"          # the backend whose tensor is not the host array


def keep_host_copy(result, attn_backend, cu_seqlens):
    """Keep ``cu_seqlens`` (host) on ``result`` (its device copy) where they hold the same values;
    True where ``result`` carries the host values (kept now, or by an inner call)."""
    if getattr(attn_backend, "name", None) == RESCALED_BY or not isinstance(result, torch.Tensor):
        return False
    if host_record.ATTR in result.__dict__:
        return True                              # an inner call (the oot class) kept it already
    if result.dim() != 1:
        return False
    host = np.asarray(cu_seqlens)
    if host.ndim != 1 or host.shape[0] != result.shape[0]:
        return False
    host_record.remember(result, torch.tensor(host, dtype=result.dtype))   # a host copy, no device read
    return True


class _Family:
    def __init__(self, copy_names):
        self.copy_names = copy_names

    def _function(self, cls):
        descriptor = vars(cls).get(METHOD)
        if not isinstance(descriptor, classmethod) or not inspect.isfunction(descriptor.__func__):
            raise TargetMismatch("%s.%s is not a classmethod defined by the class" % (cls.__name__, METHOD))
        return descriptor.__func__

    def check(self, cls, context):
        function = self._function(cls)
        params = tuple(inspect.signature(function).parameters)
        if params[:len(PARAMS)] != PARAMS or params[len(PARAMS):] not in OPTIONAL_TAILS:
            raise TargetMismatch("%s.%s takes %s; the family knows %s" % (cls.__name__, METHOD, params, PARAMS))
        names = names_in_code(function.__code__, nested=False)
        missing = [n for n in self.copy_names + (RESCALED_BY,) if n not in names]
        if missing:
            raise TargetMismatch("%s.%s does not use %s (another copy to the device)"
                                 % (cls.__name__, METHOD, ", ".join(missing)))

    def build(self, cls, context):
        original = self._function(cls)

        depth = threading.local()

        def maybe_recompute_cu_seqlens(cls, attn_backend, cu_seqlens, *args, **kwargs):
            # vLLM's method hands the call to the out-of-tree class (vllm-ascend's), which inherits
            # this one: the tower's one call runs it twice, nested; the outer run counts it.
            outer = not getattr(depth, "inside", False)
            depth.inside = True
            try:
                result = original(cls, attn_backend, cu_seqlens, *args, **kwargs)
            finally:
                depth.inside = not outer
            kept = keep_host_copy(result, attn_backend, cu_seqlens)
            if outer:
                context.count("calls")
                if not kept:
                    context.count("upstream_calls")      # FlashInfer's rescaled offsets: nothing kept
            return result

        context.present(maybe_recompute_cu_seqlens, original,
                        "upstream's, and the host array kept on the tensor it returns")
        return {METHOD: classmethod(maybe_recompute_cu_seqlens)}


FROM_NUMPY = _Family(("from_numpy",))
ASYNC_H2D = _Family(("async_tensor_h2d",))
