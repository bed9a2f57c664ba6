"""The part of the shim that runs at interpreter start.

It must cost next to nothing in a process that never imports a patched
framework, so it imports only ``os`` and ``sys`` (and the shim's own
``_config`` and patch index). It does three things:

* puts a tiny finder at the front of ``sys.meta_path`` that notices the first
  import of a watched top-level package (``vllm``, ``transformers``, ...) and
  only then loads the real machinery (``_machinery``: wrapt post-import hooks,
  ``packaging``, ``importlib.metadata``, ``logging``);
* exports the bootstrap directory on ``PYTHONPATH`` so that child interpreters
  (multiprocessing spawn/forkserver, Ray workers) run the shim's
  ``sitecustomize`` and are patched too;
* chains to the next ``sitecustomize`` on ``sys.path``, so the shim never
  shadows a user's or another tool's.
"""
import os
import sys
import _thread

from npu_shim import _config
from npu_shim.patches import WATCHED_PACKAGES

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class _State:
    lock = _thread.RLock()
    installed = False
    generation = 0           # bumped by uninstall(); stale hooks compare against it
    settings = None
    finder = None
    machinery = None         # the _machinery module once loaded
    watched = set(WATCHED_PACKAGES)
    extra_patches = []       # registered through register() before the machinery loaded
    exported_path = None     # what install() added to PYTHONPATH, for uninstall()
    booted_by = []           # sitecustomize files of ours that ran in this process
    chained_sitecustomize = None


class _WatchFinder:
    """Loads the machinery the first time a watched package starts importing.

    It never finds anything itself: it returns None so the normal finders
    carry on with the import. It stays in ``sys.meta_path`` after firing
    because removing an entry while the import system iterates over the list
    would make it skip the next finder.
    """

    def find_spec(self, fullname, path=None, target=None):
        if _State.machinery is None and fullname in _State.watched and _State.installed:
            _load_machinery()
            # Loading the machinery put wrapt's post-import finder in front of
            # this one, too late for the import already under way: ask it now,
            # so a hook on this very module fires.
            for finder in list(sys.meta_path):
                if finder is self:
                    break
                spec = finder.find_spec(fullname, path, target)
                if spec is not None:
                    return spec
        return None

    def invalidate_caches(self):
        pass


def install():
    """Install the shim in this process (idempotent, thread-safe).

    Raises :class:`npu_shim.ConfigError` for malformed ``NPU_SHIM*`` variables.
    """
    with _State.lock:
        if _State.installed:
            return
        settings = _config.Settings()
        _State.settings = settings
        if not settings.enabled:
            return
        _State.installed = True
        _export_for_children()
        if settings.emulate:
            from npu_shim import emulation

            emulation.install()
        if _State.finder is None:
            _State.finder = _WatchFinder()
        if _State.finder not in sys.meta_path:
            sys.meta_path.insert(0, _State.finder)
        already = [name for name in _State.watched if name in sys.modules]
    if already and _State.machinery is None:
        _load_machinery()
    elif _State.machinery is not None:
        _State.machinery.arm()


def uninstall():
    """Revert every applied patch (restoring the original objects) and stop watching."""
    with _State.lock:
        if _State.finder in sys.meta_path:
            sys.meta_path.remove(_State.finder)
        if _State.machinery is not None:
            _State.machinery.disarm()
        _State.generation += 1
        _State.installed = False
        _unexport_for_children()


def status():
    """One dict per patch: name, target, state, reason, requires, versions.

    Evaluates version guards for patches whose target is not imported yet
    (state ``pending``); a target package that is not installed reads
    ``skipped`` / ``not installed``.
    """
    _load_machinery()
    return _State.machinery.status()


def register(patch):
    """Add a patch of your own (a :class:`npu_shim.patch.Patch`)."""
    with _State.lock:
        top = patch.target.partition(".")[0]
        _State.watched.add(top)
        if _State.machinery is None:
            _State.extra_patches.append(patch)
            loaded = top in sys.modules
        else:
            _State.machinery.register(patch)
            return
    if loaded and _State.installed:
        _load_machinery()


def _load_machinery():
    with _State.lock:
        if _State.machinery is not None:
            return
        from npu_shim import _machinery

        _machinery.load(_State)
        _State.machinery = _machinery
        if _State.installed:
            _machinery.arm()


def _pythonpath_entries():
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _export_for_children():
    """Make child interpreters run a sitecustomize of ours."""
    entries = _pythonpath_entries()
    ours = {BOOTSTRAP_DIR} | {os.path.dirname(f) for f in _State.booted_by}
    if any(os.path.abspath(e) in ours for e in entries):
        return
    os.environ["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR] + entries)
    _State.exported_path = BOOTSTRAP_DIR


def _unexport_for_children():
    if _State.exported_path is None:
        return
    entries = [e for e in _pythonpath_entries() if e != _State.exported_path]
    if entries:
        os.environ["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        os.environ.pop("PYTHONPATH", None)
    _State.exported_path = None


def boot(sitecustomize_file):
    """Entry point of the shim's ``sitecustomize`` files."""
    _State.booted_by.append(os.path.abspath(sitecustomize_file))
    try:
        install()
    except _config.ConfigError as exc:
        sys.stderr.write("npu-shim: %s; the shim is not installed in this process\n" % exc)
    finally:
        _chain_next_sitecustomize(sitecustomize_file)


def _our_sitecustomize_files():
    return {
        os.path.join(BOOTSTRAP_DIR, "sitecustomize.py"),
        os.path.join(PACKAGE_PARENT, "sitecustomize.py"),
    }


def _chain_next_sitecustomize(sitecustomize_file):
    """Run the next ``sitecustomize`` on sys.path after ours, if there is one."""
    from _frozen_importlib import module_from_spec
    from _frozen_importlib_external import PathFinder

    here = os.path.dirname(os.path.abspath(sitecustomize_file))
    later = []
    seen_here = False
    for entry in sys.path:
        if seen_here:
            later.append(entry)
        elif os.path.abspath(entry or os.curdir) == here:
            seen_here = True
    ours = _our_sitecustomize_files()
    while later:
        spec = PathFinder.find_spec("sitecustomize", later)
        if spec is None or spec.origin is None:
            return
        origin_dir = os.path.dirname(os.path.abspath(spec.origin))
        if os.path.abspath(spec.origin) not in ours:
            module = module_from_spec(spec)
            spec.loader.exec_module(module)
            _State.chained_sitecustomize = module
            return
        # One of ours again (checkout and bootstrap both on the path): keep looking.
        later = later[[os.path.abspath(e or os.curdir) for e in later].index(origin_dir) + 1:]
