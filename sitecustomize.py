"""Start-up hook for ``PYTHONPATH=<this checkout>``: runs the shim's own
(npu_shim/_bootstrap/sitecustomize.py, imported as a module so its bytecode is
cached where bytecode is written), which installs npu-shim and then runs the
next ``sitecustomize`` on ``sys.path``, so none is shadowed."""

NPU_SHIM_BOOT = True  # npu_shim/__init__: start-up installs here and never raises

import npu_shim._bootstrap.sitecustomize  # noqa: E402,F401
