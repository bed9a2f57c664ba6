"""npu-shim: runtime backports of Ascend NPU attention fixes for pinned
vLLM, vllm-ascend, transformers and sglang.

``import npu_shim`` installs the shim (a malformed NPU_SHIM* variable raises
ConfigError) and exports what child interpreters need. The API below loads on
first use: this file is on every interpreter's start-up path.
"""
import sys

__version__ = "0.1.0"
__all__ = ["ConfigError", "install", "register", "stats", "status", "uninstall", "__version__"]


def __getattr__(name):
    if name not in __all__:
        raise AttributeError("module 'npu_shim' has no attribute %r" % name)
    from npu_shim import api

    return getattr(api, name)


# The shim's sitecustomize files (marked NPU_SHIM_BOOT) install at start-up and
# never raise out of it; the CLI reports a bad variable as a usage error.
# Everywhere else `import npu_shim` installs here.
if not getattr(sys.modules.get("sitecustomize"), "NPU_SHIM_BOOT", False):
    from npu_shim import _startup as _s

    _s.install_on_import()
    del _s
