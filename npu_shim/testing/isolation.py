"""Load a ``vllm_ascend.ops`` submodule without running ``vllm_ascend/ops/__init__.py``.

That ``__init__`` imports vllm-ascend's compiled Ascend ops (and ``torch.npu``),
which exist only on an NPU machine; ``vllm_ascend.ops.mm_encoder_attention``,
the file ``vllm.mm_encoder_attn`` patches, needs none of them. Off the NPU, the
tests, benchmarks and the lane report register an empty package module that
carries the package's real ``__path__`` (so the real submodule file loads),
then import the submodule; the shim's post-import hook patches it as usual.
Never used on the production path: on an NPU machine the package imports normally.
"""
import importlib
import importlib.util
import sys

__all__ = ["import_vllm_ascend_ops_module"]


def import_vllm_ascend_ops_module(name="mm_encoder_attention"):
    """``vllm_ascend.ops.<name>``, imported with the package's ``__init__`` skipped."""
    import vllm_ascend

    if "vllm_ascend.ops" not in sys.modules:
        spec = importlib.util.find_spec("vllm_ascend.ops")
        package = importlib.util.module_from_spec(spec)  # real __path__, __init__ not run
        sys.modules["vllm_ascend.ops"] = package
        vllm_ascend.ops = package
    return importlib.import_module("vllm_ascend.ops." + name)
