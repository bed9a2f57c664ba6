"""Import placeholder for ``torchair`` (tests only).

``torchair`` is Ascend's graph-compile backend for ``torch.compile`` (NPU-only, shipped with
torch_npu's toolchain). On an NPU, sglang's ``get_compiler_backend`` imports it and builds its
backend for decorators such as ``@torch.compile(..., backend=get_compiler_backend(),
disable=_is_npu)`` (sglang.srt.sampling.penaltylib.repetition_penalty): the backend is built at
import time but, with ``disable`` set, never compiles anything. Engines on the emulated device run
eager (graph capture stays refused), so the backend this placeholder returns refuses by name when
a graph is ever handed to it: a path that compiles fails loudly instead of running something else.

Put on ``PYTHONPATH`` by the sglang lanes, beside ``sgl_kernel_npu``; never installed with the shim.
"""
IS_IMPORT_PLACEHOLDER = True


class PlaceholderBackendError(RuntimeError):
    """Raised when a graph reaches the placeholder's compile backend."""


def get_npu_backend(compiler_config=None):
    def npu_backend(graph_module, example_inputs, *args, **kwargs):
        raise PlaceholderBackendError(
            "torchair.get_npu_backend: a graph was compiled with the torchair import placeholder "
            "(tests/placeholders): torch.compile on the emulated NPU is not supported, engines run eager")

    return npu_backend
