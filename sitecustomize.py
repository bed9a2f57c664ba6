"""Start-up hook for ``PYTHONPATH=<this checkout>``.

Installs npu-shim in this interpreter, then runs the next ``sitecustomize`` on
``sys.path`` so a user's or another tool's is never shadowed.
"""

NPU_SHIM_BOOT = True  # tells npu_shim/__init__ that boot() below installs (and never raises)

from npu_shim._boot import boot

boot(__file__)
