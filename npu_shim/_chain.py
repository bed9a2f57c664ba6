"""Runs the next ``sitecustomize`` on sys.path after the shim's own, so a user's or
another tool's is never shadowed. Loaded only when one exists."""
import os
from _frozen_importlib import module_from_spec

from _frozen_importlib_external import PathFinder

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(BOOTSTRAP_DIR))
OURS = {os.path.join(BOOTSTRAP_DIR, "sitecustomize.py"), os.path.join(PACKAGE_PARENT, "sitecustomize.py")}


def run_next_sitecustomize(later):
    """Execute the first sitecustomize in ``later`` (sys.path entries) that is not ours."""
    while later:
        spec = PathFinder.find_spec("sitecustomize", later)
        if spec is None or spec.origin is None:
            return None
        origin = os.path.abspath(spec.origin)
        if origin not in OURS:
            module = module_from_spec(spec)
            spec.loader.exec_module(module)
            return module
        # One of ours again (checkout and bootstrap both on the path): keep looking.
        absolute = [os.path.abspath(entry or os.curdir) for entry in later]
        later = later[absolute.index(os.path.dirname(origin)) + 1:]
    return None
