"""The shim's start-up hook: PYTHONPATH=<this directory> (exported for children by
``npu-shim run`` and ``import npu_shim``), or the checkout's root sitecustomize.py.

Every start where no bytecode is written (PYTHONDONTWRITEBYTECODE=1 with a
checkout) compiles this file, so it stays this small: a finder that hands over
to npu_shim._startup when a watched framework starts importing, this directory
exported for child interpreters, and the next sitecustomize on sys.path run.
Any NPU_SHIM* variable takes the validating path (npu_shim._startup).
"""
import os
import sys
from _frozen_importlib_external import PathFinder

NPU_SHIM_BOOT = True  # npu_shim/__init__: start-up installs here and never raises
WATCHED = ("transformers", "vllm", "vllm_ascend", "sglang")  # = npu_shim.patches.WATCHED_PACKAGES
_dir = os.path.dirname(os.path.abspath(__file__))
# The file on sys.path that started us: this one, or the checkout's root sitecustomize.py.
_booted_by = os.path.abspath(getattr(sys.modules.get("sitecustomize"), "__file__", None) or __file__)
start_finder = None  # the NpuShimStart in sys.meta_path: npu_shim._startup adopts it by identity
_parent = os.path.dirname(os.path.dirname(_dir))
if _parent not in sys.path:
    sys.path.append(_parent)   # a checkout that is not installed: let `npu_shim` resolve


class NpuShimStart:
    """Finds nothing; the first watched import hands over to npu_shim._startup."""

    def find_spec(self, name, path=None, target=None):
        if name in WATCHED:
            from npu_shim import _startup

            return _startup.take_over(self, name, path, target)


def _start():
    global start_finder
    if any(name.startswith("NPU_SHIM") for name in os.environ):
        from npu_shim import _startup

        return _startup.boot_configured(_booted_by)
    start = NpuShimStart()
    start.booted_by, start.exported = _booted_by, None
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    if not any(os.path.abspath(p) in (_dir, os.path.dirname(_booted_by)) for p in entries):
        os.environ["PYTHONPATH"] = os.pathsep.join([_dir] + entries)
        start.exported = _dir
    sys.meta_path.insert(0, start)
    start_finder = start


try:
    _start()
finally:
    _here = os.path.dirname(_booted_by)
    _paths = [os.path.abspath(p or ".") for p in sys.path]
    _later = sys.path[_paths.index(_here) + 1:] if _here in _paths else []
    if _later and PathFinder.find_spec("sitecustomize", _later):
        from npu_shim._chain import run_next_sitecustomize

        run_next_sitecustomize(_later)
