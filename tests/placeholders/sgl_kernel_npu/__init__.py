"""Import placeholder for ``sgl_kernel_npu`` (tests only).

``sgl_kernel_npu`` is sglang's NPU-only kernel package. It is not published on
the package index and cannot run without an Ascend device, yet sglang's Ascend
attention backend (``sglang.srt.hardware_backend.npu.attention.ascend_backend``)
imports it at module top, e.g.::

    from sgl_kernel_npu.attention.sinks_attention import attention_sinks_triton

The code paths the sglang lanes' patch tests take (context-parallel FIA in
``AscendAttnBackend.do_cp_attn_fia`` and the others) never call those kernels; sglang's
engine on the emulated device (tests/lanes/test_engine_sglang.py) launches one at every
prefill (the NPU token allocator's ``alloc_extend_kernel``), which npu-shim's emulation
provides (below). This package exists only so that such import lines succeed:

* any submodule ``sgl_kernel_npu.<a>.<b>`` imports as an empty placeholder module;
* ``from sgl_kernel_npu.x import name`` yields a :class:`KernelPlaceholder`;
* calling a placeholder, launching it (``kernel[grid]``), or reading any attribute of it, raises
  :class:`PlaceholderKernelError` naming the kernel, so a test that strays onto
  an NPU kernel fails loudly instead of silently doing nothing;
* except the kernels npu-shim's emulation has (``npu_shim.emulation.sgl_kernels.EMULATED``, written
  from the kernels' semantics, each tested against an independent reference): those names yield the
  emulation. Every other kernel keeps refusing by name.

It is put on ``PYTHONPATH`` by the sglang lanes (see ``noxfile.py``); it is never
installed with the shim and never used outside tests.
"""
import importlib.abc
import importlib.machinery
import sys
import types

IS_IMPORT_PLACEHOLDER = True


class PlaceholderKernelError(RuntimeError):
    """Raised when code actually uses a kernel from the placeholder package."""


def _refuse(qualified_name):
    raise PlaceholderKernelError(
        f"{qualified_name} comes from the sgl_kernel_npu import placeholder "
        "(tests/placeholders): the real NPU-only kernel package is not installed, "
        "and this code path was expected never to call it."
    )


class KernelPlaceholder:
    """Stands for one name imported from the placeholder package; unusable on purpose."""

    __slots__ = ("_qualified_name",)

    def __init__(self, qualified_name):
        object.__setattr__(self, "_qualified_name", qualified_name)

    def __call__(self, *args, **kwargs):
        _refuse(self._qualified_name)

    def __getattr__(self, attribute):
        _refuse(f"{self._qualified_name}.{attribute}")

    def __getitem__(self, grid):  # a Triton kernel is launched as kernel[grid](...)
        _refuse(f"{self._qualified_name}[{grid!r}]")

    def __repr__(self):
        return f"<sgl_kernel_npu import placeholder {self._qualified_name}>"


def _emulated(module_name, attribute):
    """npu-shim's emulation of ``module_name.attribute``, or None where it has none."""
    try:
        from npu_shim.emulation.sgl_kernels import EMULATED
    except ImportError:  # the shim is not installed: every kernel refuses
        return None
    return EMULATED.get(module_name, {}).get(attribute)


def _placeholder_getattr(module_name):
    def __getattr__(attribute):
        # Dunder look-ups (introspection, pickling, inspect, import machinery) get the
        # normal answer: the attribute does not exist.
        if attribute.startswith("__") and attribute.endswith("__"):
            raise AttributeError(attribute)
        emulated = _emulated(module_name, attribute)
        if emulated is not None:
            return emulated
        return KernelPlaceholder(f"{module_name}.{attribute}")

    return __getattr__


class _PlaceholderSubmoduleFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Creates any ``sgl_kernel_npu.*`` submodule as an empty placeholder package."""

    def find_spec(self, fullname, path=None, target=None):
        if not fullname.startswith(__name__ + "."):
            return None
        return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

    def create_module(self, spec):
        module = types.ModuleType(spec.name, f"Import placeholder for {spec.name} (see {__name__}).")
        module.__path__ = []
        module.__getattr__ = _placeholder_getattr(spec.name)
        return module

    def exec_module(self, module):
        pass


__getattr__ = _placeholder_getattr(__name__)

if not any(isinstance(finder, _PlaceholderSubmoduleFinder) for finder in sys.meta_path):
    sys.meta_path.append(_PlaceholderSubmoduleFinder())
