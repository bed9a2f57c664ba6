"""Start-up hook put on PYTHONPATH by ``npu-shim run`` and ``import npu_shim``.

Installs the shim in every interpreter that inherits the environment, then
runs the next ``sitecustomize`` on ``sys.path`` so none is shadowed.
"""
import os
import sys

NPU_SHIM_BOOT = True  # tells npu_shim/__init__ that boot() below installs (and never raises)

_package_parent = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if _package_parent not in sys.path:
    # Running from a checkout that is not installed: let `npu_shim` resolve.
    sys.path.append(_package_parent)

from npu_shim._boot import boot  # noqa: E402

boot(__file__)
