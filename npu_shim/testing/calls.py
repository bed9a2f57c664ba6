"""Record the torch_npu ops a piece of code calls (to check the NPU dispatch path).

Works with the emulation (its ops honour ``__torch_function__``) for both
spellings, ``torch_npu.X(...)`` and ``torch.ops.npu.X(...)``, and for vllm-ascend's own
``torch.ops._C_ascend.X(...)`` (spelling "torch.ops._C_ascend"). The recorded
arguments are the objects passed, so a test can assert e.g. "one
npu_fusion_attention call per layer, input_layout='TND', no atten_mask, lengths
as Python ints".
"""
import contextlib
from typing import Any, NamedTuple

from torch.overrides import TorchFunctionMode

__all__ = ["NpuCall", "record_npu_calls", "recorded_not_run", "unemulated_op"]


class NpuCall(NamedTuple):
    name: str        # op name, e.g. "npu_fusion_attention"
    spelling: str    # "torch_npu" or "torch.ops.npu"
    args: tuple
    kwargs: dict
    result: Any

    def arg(self, name, position=None, default=None):
        """An argument by keyword, falling back to its position."""
        if name in self.kwargs:
            return self.kwargs[name]
        if position is not None and position < len(self.args):
            return self.args[position]
        return default


def _npu_op_name(func):
    if getattr(func, "__module__", None) == "torch_npu" and callable(func):
        return getattr(func, "__name__", None), "torch_npu"
    namespace = getattr(func, "namespace", None)
    if namespace is None:
        qualified = getattr(func, "_qualified_op_name", "")
        namespace, _, name = qualified.partition("::")
    else:
        name = func._opname if hasattr(func, "_opname") else func.__name__.split(".")[0]
    if namespace in ("npu", "_C_ascend"):
        return name, "torch.ops." + namespace
    return None, None


class _CallMode(TorchFunctionMode):
    def __init__(self, calls):
        super().__init__()
        self.calls = calls

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        result = func(*args, **kwargs)
        name, spelling = _npu_op_name(func)
        if name:
            self.calls.append(NpuCall(name, spelling, tuple(args), dict(kwargs), result))
        return result


@contextlib.contextmanager
def record_npu_calls():
    """Yield a list that fills with :class:`NpuCall` entries, in call order."""
    calls = []
    with _CallMode(calls):
        yield calls


@contextlib.contextmanager
def unemulated_op(torch_npu_module, name):
    """``torch_npu.<name>`` as an op that records its call and computes nothing.

    For checking that code *dispatches* to an op the emulation does not provide
    (its semantics are not documented well enough to emulate, e.g.
    ``_npu_flash_attention_qlens``): inside :func:`record_npu_calls` the call
    shows up with its arguments, like an emulated op's. It returns None and
    writes nothing, so outputs the real op would fill stay as allocated: use
    it to test the dispatch, never a result. Refuses to shadow an op that exists.
    """
    import torch
    from torch.overrides import handle_torch_function, has_torch_function
    from torch.utils._pytree import tree_flatten

    if hasattr(torch_npu_module, name):
        raise RuntimeError("torch_npu.%s exists; record it with record_npu_calls directly" % name)

    def op(*args, **kwargs):
        tensors = tuple(x for x in tree_flatten((args, kwargs))[0] if isinstance(x, torch.Tensor))
        if tensors and has_torch_function(tensors):
            return handle_torch_function(op, tensors, *args, **kwargs)
        return None

    op.__name__ = op.__qualname__ = name
    op.__module__ = "torch_npu"
    setattr(torch_npu_module, name, op)
    try:
        yield op
    finally:
        delattr(torch_npu_module, name)


@contextlib.contextmanager
def recorded_not_run(torch_npu_module, name):
    """``torch_npu.<name>`` replaced for the block by an op that records its call and computes nothing,
    whether or not the emulation has it (put back after the block).

    For checking that code *dispatches* to an op with the arguments upstream passes, where the emulated op
    would refuse them as the documented one does (``_npu_flash_attention_qlens`` at block sizes other than
    128): as with :func:`unemulated_op`, test the dispatch with it, never a result.
    """
    missing = object()
    real = torch_npu_module.__dict__.get(name, missing)
    if real is not missing:
        delattr(torch_npu_module, name)
    try:
        with unemulated_op(torch_npu_module, name) as op:
            yield op
    finally:
        if real is not missing:
            setattr(torch_npu_module, name, real)
