"""Load vllm-ascend modules without running ``vllm_ascend/ops/__init__.py``.

That ``__init__`` imports vllm-ascend's compiled Ascend ops (and ``torch.npu``),
which exist only on an NPU machine; the files the shim patches need none of
them: ``vllm_ascend.ops.mm_encoder_attention`` (``vllm.mm_encoder_attn``) and
``vllm_ascend._310p.ops.mm_encoder_attention`` (``vllm.mm_encoder_attn_310p``;
its package ``__init__`` files are empty, but 0.14.0rc1's 310P class subclasses
the class in ``vllm_ascend.ops.mm_encoder_attention``). Off the NPU, the
tests, benchmarks and the lane report register an empty package module that
carries the ``vllm_ascend.ops`` package's real ``__path__`` (so its real
submodule files load), then import the module they need; the shim's
post-import hook patches it as usual. Any vllm-ascend module whose imports
reach ``vllm_ascend.ops`` only through such submodules loads the same way
(:func:`import_vllm_ascend_module`).
Never used on the production path: on an NPU machine the package imports normally.
"""
import importlib
import importlib.util
import sys

__all__ = ["import_vllm_ascend_module", "import_vllm_ascend_ops_module"]

OPS_PACKAGE = "vllm_ascend.ops"


def _register_ops_package_without_init():
    import vllm_ascend

    if OPS_PACKAGE not in sys.modules:
        spec = importlib.util.find_spec(OPS_PACKAGE)
        package = importlib.util.module_from_spec(spec)  # real __path__, __init__ not run
        sys.modules[OPS_PACKAGE] = package
        vllm_ascend.ops = package


def import_vllm_ascend_module(name):
    """The vllm-ascend module ``name`` (dotted), imported with ``vllm_ascend/ops/__init__.py``
    skipped, e.g. ``"vllm_ascend._310p.ops.mm_encoder_attention"``."""
    if name != "vllm_ascend" and not name.startswith("vllm_ascend."):
        raise ValueError("%r is not a vllm_ascend module" % (name,))
    _register_ops_package_without_init()
    return importlib.import_module(name)


def import_vllm_ascend_ops_module(name="mm_encoder_attention"):
    """``vllm_ascend.ops.<name>``, imported with the package's ``__init__`` skipped."""
    return import_vllm_ascend_module(OPS_PACKAGE + "." + name)
