"""Start-up hook for ``PYTHONPATH=<this checkout>``: runs the shim's own
(npu_shim/_bootstrap/sitecustomize.py), which installs npu-shim and then runs the
next ``sitecustomize`` on ``sys.path``, so none is shadowed."""
import os

_npu_shim_file = __file__
__file__ = os.path.join(os.path.dirname(os.path.abspath(__file__)), "npu_shim", "_bootstrap", "sitecustomize.py")
with open(__file__, "rb") as _source:
    exec(compile(_source.read(), __file__, "exec"))
