"""What every interpreter runs at start-up: a few dozen lines, compiled on each
start where no bytecode is written (PYTHONDONTWRITEBYTECODE=1 with a checkout).

With no NPU_SHIM* variable set it only puts a finder in front of sys.meta_path
(the rest of the shim loads when a watched framework starts importing),
exports the bootstrap directory for child interpreters and chains to the next
sitecustomize. Any NPU_SHIM* variable takes the full, validating path
(npu_shim._startup).
"""
import os
import sys
import _thread

from npu_shim.patches import WATCHED_PACKAGES

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(BOOTSTRAP_DIR))


class State:
    lock = _thread.RLock()
    installed = False
    generation = 0           # bumped by uninstall(); stale hooks compare against it
    settings = None          # _config.Settings, made when first needed
    defaults = False         # booted with no NPU_SHIM* variable: default settings
    finder = None
    machinery = None         # the _machinery module once loaded
    unavailable = None       # why the machinery cannot load here (a missing dependency)
    watched = set(WATCHED_PACKAGES)
    extra_patches = []       # registered through register() before the machinery loaded
    exported_path = None     # what install() added to PYTHONPATH, for uninstall()
    booted_by = []           # sitecustomize files of ours that ran in this process
    chained_sitecustomize = None


# A fork never splits an install or a patch application: the child gets the
# lock free and sees every patch either applied or not (as logging does).
os.register_at_fork(before=State.lock.acquire, after_in_parent=State.lock.release,
                    after_in_child=State.lock.release)


class WatchFinder:
    """Finds nothing itself; the first import of a watched package loads the machinery."""

    def find_spec(self, fullname, path=None, target=None):
        if State.machinery is None and fullname in State.watched and State.installed \
                and State.unavailable is None:
            from npu_shim import _startup

            return _startup.on_watched_import(self, fullname, path, target)
        return None

    def invalidate_caches(self):
        pass


def activate():
    """Watch imports and export the bootstrap directory (callers hold State.lock)."""
    State.installed = True
    entries = [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]
    ours = {BOOTSTRAP_DIR} | {os.path.dirname(f) for f in State.booted_by}
    if not any(os.path.abspath(e) in ours for e in entries):
        os.environ["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR] + entries)
        State.exported_path = BOOTSTRAP_DIR
    if State.finder is None:
        State.finder = WatchFinder()
    if State.finder not in sys.meta_path:
        sys.meta_path.insert(0, State.finder)


def boot(sitecustomize_file):
    """Entry point of the shim's sitecustomize files; never raises out of start-up."""
    State.booted_by.append(os.path.abspath(sitecustomize_file))
    try:
        if any(name.startswith("NPU_SHIM") for name in os.environ):
            from npu_shim import _startup

            _startup.boot_configured()
        else:
            with State.lock:
                State.defaults = True
                activate()
    finally:
        _chain_next_sitecustomize(sitecustomize_file)


def _chain_next_sitecustomize(sitecustomize_file):
    """Run the next ``sitecustomize`` on sys.path after ours, so none is shadowed."""
    from _frozen_importlib import module_from_spec
    from _frozen_importlib_external import PathFinder

    absolute = [os.path.abspath(entry or os.curdir) for entry in sys.path]
    here = os.path.dirname(os.path.abspath(sitecustomize_file))
    later = sys.path[absolute.index(here) + 1:] if here in absolute else []
    ours = {os.path.join(BOOTSTRAP_DIR, "sitecustomize.py"), os.path.join(PACKAGE_PARENT, "sitecustomize.py")}
    while later:
        spec = PathFinder.find_spec("sitecustomize", later)
        if spec is None or spec.origin is None:
            return
        origin = os.path.abspath(spec.origin)
        if origin not in ours:
            module = module_from_spec(spec)
            spec.loader.exec_module(module)
            State.chained_sitecustomize = module
            return
        # One of ours again (checkout and bootstrap both on the path): keep looking.
        absolute = [os.path.abspath(entry or os.curdir) for entry in later]
        later = later[absolute.index(os.path.dirname(origin)) + 1:]
