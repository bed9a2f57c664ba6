"""Import placeholders: names of torch_npu / ``torch.npu`` that upstream code reads at import
time but that the emulation does not implement.

Why: vllm-ascend's modules read NPU-only names while they are being *defined*, not run.
``vllm_ascend.compilation.acl_graph`` annotates class attributes with ``torch.npu.NPUGraph``,
``torch.npu.ExternalEvent`` and ``torch_npu._C._NPUTaskGroupHandle`` (evaluated at class
creation), and from 0.21.0rc1 ``vllm_ascend.quantization.utils`` builds a tuple of
torch_npu's own dtype ids (``torch_npu.float4_e2m1fn_x2``, ``torch_npu.hifloat8``;
``torch_npu.float8_e8m0fnu`` elsewhere). ``vllm_ascend.attention.attention_v1`` imports
both modules, so without these names it cannot even be imported off an NPU.

A placeholder only lets the *import* succeed. It never computes:

* a placeholder class (:func:`placeholder_class`) is a real class, so ``X | None`` and
  ``isinstance(obj, X)`` (False for every object) work, but instantiating it raises
  :class:`ImportPlaceholderError` naming it;
* a placeholder dtype id (:class:`DtypePlaceholder`) is hashable and equal only to itself
  (so ``dtype in (torch_npu.hifloat8, ...)`` is an honest False for every torch dtype), and
  is not an int or a ``torch.dtype``: handing it to an op, ``Tensor.to`` or ``torch.empty``
  fails in torch's own argument check. (On the NPU these are integer ids of dtypes torch
  does not have; the emulation has none of those dtypes.)

Each placeholder says in its ``repr`` that it is one. Nothing here exists in a process that
uses the real torch_npu.
"""

__all__ = ["DtypePlaceholder", "ImportPlaceholderError", "placeholder_class", "placeholder_function"]


class ImportPlaceholderError(RuntimeError):
    """Code used (not just imported) a torch_npu name the emulation only holds a place for."""


def _refuse(qualified_name):
    raise ImportPlaceholderError(
        "%s is an import placeholder of npu-shim's torch_npu emulation: it exists so that "
        "upstream modules import off an NPU, and the emulation does not implement it"
        % qualified_name)


def placeholder_class(qualified_name):
    """A class named after ``qualified_name`` (``"torch.npu.NPUGraph"``) that refuses to be
    instantiated."""
    module, _, name = qualified_name.rpartition(".")

    def __new__(cls, *args, **kwargs):
        _refuse(qualified_name)

    cls = type(name, (), {
        "__new__": __new__,
        "__module__": module,
        "__doc__": "Import placeholder for %s (npu-shim emulation): not implemented."
                   % qualified_name,
        "npu_shim_import_placeholder": True,
    })
    cls.__qualname__ = name
    return cls


def placeholder_function(qualified_name):
    """A function named after ``qualified_name`` (``"torch_npu.npu_dynamic_quant"``) that refuses
    every call, naming it: for an op upstream imports by name at module top but calls only on a path
    the emulation does not serve (sglang 0.5.11's ``npu_communicator`` imports ``npu_dynamic_quant``
    for its quantized all-reduce, which a one-rank engine never runs)."""
    module, _, name = qualified_name.rpartition(".")

    def placeholder(*args, **kwargs):
        _refuse(qualified_name)

    placeholder.__name__ = placeholder.__qualname__ = name
    placeholder.__module__ = module
    placeholder.__doc__ = "Import placeholder for %s (npu-shim emulation): not implemented." % qualified_name
    placeholder.npu_shim_import_placeholder = True
    return placeholder


class DtypePlaceholder:
    """Stands for one of torch_npu's own dtype ids (e.g. ``torch_npu.hifloat8``)."""

    __slots__ = ("qualified_name",)
    npu_shim_import_placeholder = True

    def __init__(self, qualified_name):
        self.qualified_name = qualified_name

    def __repr__(self):
        return "<import placeholder %s (npu-shim emulation: dtype not implemented)>" % (
            self.qualified_name)

    def __reduce__(self):
        _refuse(self.qualified_name)
