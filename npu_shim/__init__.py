"""npu-shim: runtime backports of Ascend NPU attention fixes for pinned
vLLM, vllm-ascend, transformers and sglang.

``import npu_shim`` installs the shim in this process and exports what child
interpreters need to install it too. Nothing heavy is imported here: the patch
machinery loads when a patched framework starts importing.
"""
import os
import sys

from npu_shim._config import ConfigError
from npu_shim._startup import install, register, status, uninstall

__version__ = "0.1.0"
__all__ = ["ConfigError", "install", "register", "status", "uninstall", "__version__"]


def _install_on_import():
    # The shim's sitecustomize files (marked NPU_SHIM_BOOT) call boot(), which
    # reports a malformed environment on stderr instead of raising out of
    # interpreter start-up; the CLI reports it as a usage error. Everywhere
    # else a bad NPU_SHIM* variable makes `import npu_shim` raise.
    if getattr(sys.modules.get("sitecustomize"), "NPU_SHIM_BOOT", False):
        return
    try:
        install()
    except ConfigError:
        argv = getattr(sys, "argv", None) or [""]
        running_cli = argv[0] == "-m" or os.path.basename(argv[0]) == "npu-shim"
        if not running_cli:
            raise


_install_on_import()
