"""The shim in this process: install and uninstall, the import watch, children.

Standard library only. The start-up hook (``npu_shim/_bootstrap/sitecustomize.py``:
a finder, the bootstrap directory exported for children, the next sitecustomize
run) hands over to this module when a watched framework (``vllm``,
``transformers``, ...) starts importing, or at once when an ``NPU_SHIM*``
variable asks for validation; ``import npu_shim`` and the API come here too.
It owns the process state (lock, generation) and loads the engine
(:mod:`npu_shim.engine`: wrapt post-import hooks, ``packaging``,
``importlib.metadata``, ``logging``) once, handing it that state. The public
functions are :mod:`npu_shim.api`.
"""
import os
import sys
import _thread

from npu_shim import _config, _fork
from npu_shim.patches import WATCHED_PACKAGES

BOOTSTRAP_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")


class _State:
    """The shim in this process."""
    lock = _thread.RLock()
    installed = False
    generation = 0                # bumped by uninstall(); stale hooks compare against it
    finder = None
    engine = None                 # npu_shim.engine.registry once loaded
    unavailable = None            # why the engine cannot load here (a missing dependency)
    watched = set(WATCHED_PACKAGES)
    extra_patches = []            # registered through register() before the engine loaded
    exported_path = None          # what was added to PYTHONPATH, for uninstall()
    booted_by = []                # sitecustomize files of ours that ran in this process


# A fork never splits an install or a patch application: the child gets the
# lock free and sees every patch either applied or not (as logging does).
_fork.hold_across_fork(_State.lock)


class _WatchFinder:
    """Finds nothing itself; the first import of a watched package loads the engine.

    It stays in sys.meta_path after firing: removing an entry while the import
    system iterates over the list would make it skip the next finder.
    """

    def find_spec(self, fullname, path=None, target=None):
        if fullname in _State.watched and _State.engine is None and _State.installed \
                and _State.unavailable is None:
            return on_watched_import(self, fullname, path, target)
        return None


def _activate():
    """Watch imports and export the bootstrap directory for children (lock held)."""
    _State.installed = True
    entries = _pythonpath_entries()
    ours = {BOOTSTRAP_DIR} | {os.path.dirname(f) for f in _State.booted_by}
    if not any(os.path.abspath(e) in ours for e in entries):
        os.environ["PYTHONPATH"] = os.pathsep.join([BOOTSTRAP_DIR] + entries)
        _State.exported_path = BOOTSTRAP_DIR
    if _State.finder is None:
        _State.finder = _WatchFinder()
    if _State.finder not in sys.meta_path:
        sys.meta_path.insert(0, _State.finder)


def _start_finder():
    """The start-up hook's finder, if it is still in sys.meta_path.

    Found by identity: the hook's module keeps it as ``start_finder``. That module is
    ``sitecustomize`` (PYTHONPATH=npu_shim/_bootstrap) or, under the checkout's root
    sitecustomize.py, ``npu_shim._bootstrap.sitecustomize``.
    """
    for module_name in ("npu_shim._bootstrap.sitecustomize", "sitecustomize"):
        finder = getattr(sys.modules.get(module_name), "start_finder", None)
        if finder is not None and any(entry is finder for entry in sys.meta_path):
            return finder
    return None


def _adopt_start_finder():
    """Take over from the start-up hook's finder (installed with default settings)."""
    start = _start_finder()
    if start is None:
        return
    with _State.lock:
        _State.finder = _State.finder or _WatchFinder()
        index = next(i for i, entry in enumerate(sys.meta_path) if entry is start)
        sys.meta_path[index] = _State.finder   # same place, same order of finders
        _State.booted_by.append(start.booted_by)
        _State.exported_path = start.exported
        _State.installed = True
        _config.started_with_defaults()


def take_over(start_finder, fullname, path, target):
    """The start-up finder saw the first watched import."""
    _adopt_start_finder()
    return _State.finder.find_spec(fullname, path, target)


_adopt_start_finder()


def install():
    """Install the shim in this process (idempotent, thread-safe).

    Raises :class:`npu_shim.ConfigError` for malformed ``NPU_SHIM*`` variables.
    """
    with _State.lock:
        if _State.installed:
            return
        current = _config.read_settings()
        for line in current.warnings():
            sys.stderr.write("npu-shim: %s\n" % line)
        if not current.enabled:
            return
        _activate()
        if current.emulate:
            from npu_shim import emulation

            emulation.install()
        already = [name for name in _State.watched if name in sys.modules]
    if already and _State.engine is None:
        _load_engine()
    elif _State.engine is not None:
        _State.engine.arm()


def install_on_import():
    """``import npu_shim`` outside start-up: install; a bad variable raises, except in our CLI."""
    try:
        install()
    except _config.ConfigError:
        if not _running_our_cli():
            raise


def _running_our_cli():
    """``npu-shim ...`` or ``python -m npu_shim ...``, which report a bad variable themselves."""
    if os.path.basename((getattr(sys, "argv", None) or [""])[0]) == "npu-shim":
        return True
    # While `python -m M` imports M's package, sys.argv[0] is "-m" for any M:
    # read the interpreter's own command line instead.
    args = iter((getattr(sys, "orig_argv", None) or [""])[1:])
    for arg in args:   # interpreter options up to -m MODULE, -c, or a script
        if arg == "-m":
            return next(args, "") in ("npu_shim", "npu_shim.__main__")
        if arg.startswith("-m"):
            return arg[2:] in ("npu_shim", "npu_shim.__main__")
        if arg in ("-X", "-W"):
            next(args, None)
        elif arg == "-c" or not arg.startswith("-"):
            return False
    return False


def boot_configured(sitecustomize_file):
    """Start-up with NPU_SHIM* variables set: validate and report on stderr, never raise."""
    _State.booted_by.append(sitecustomize_file)
    try:
        install()
    except _config.ConfigError as exc:
        sys.stderr.write("npu-shim: %s; the shim is not installed in this process\n" % exc)


def uninstall():
    """Revert every applied patch (restoring the original objects) and stop watching."""
    with _State.lock:
        if _State.finder in sys.meta_path:
            sys.meta_path.remove(_State.finder)
        if _State.engine is not None:
            _State.engine.disarm()
        _State.generation += 1
        _State.installed = False
        _unexport_for_children()


def register(patch):
    """Add a patch of your own (a :class:`npu_shim.patch.Patch`)."""
    with _State.lock:
        top = patch.target.partition(".")[0]
        _State.watched.add(top)
        if _State.engine is None:
            _State.extra_patches.append(patch)
            loaded = top in sys.modules
        else:
            _State.engine.register(patch)
            return
    if loaded and _State.installed:
        _load_engine()


def engine():
    """The engine (``npu_shim.engine.registry``), loaded on first use."""
    _load_engine()
    if _State.engine is None:
        raise ImportError("npu-shim cannot run here: %s" % _State.unavailable)
    return _State.engine


def on_watched_import(finder, fullname, path, target):
    """The first import of a watched package: load the engine, then let its
    post-import finder (now in front of ours) see this very import."""
    if _State.unavailable is not None:
        return None
    _load_engine()
    if _State.engine is None:
        return None
    for other in list(sys.meta_path):
        if other is finder:
            break
        spec = other.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _load_engine():
    with _State.lock:
        if _State.engine is not None or _State.unavailable is not None:
            return
        try:
            from npu_shim.engine import registry
        except ImportError as exc:
            # A child interpreter that inherited the shim through PYTHONPATH but
            # not its dependencies (another venv, a system Python): say so once,
            # and let every import go on unpatched.
            missing = getattr(exc, "name", None) or str(exc)
            _State.unavailable = "%s is not importable (%s)" % (missing, sys.executable)
            sys.stderr.write("npu-shim: %s; nothing is patched in this process\n" % _State.unavailable)
            return
        _config.settings()   # made now: a malformed variable raises before the engine loads
        registry.load(_State)
        _State.engine = registry
        if _State.installed:
            registry.arm()


def _pythonpath_entries():
    return [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p]


def _unexport_for_children():
    if _State.exported_path is None:
        return
    entries = [e for e in _pythonpath_entries() if e != _State.exported_path]
    if entries:
        os.environ["PYTHONPATH"] = os.pathsep.join(entries)
    else:
        os.environ.pop("PYTHONPATH", None)
    _State.exported_path = None
