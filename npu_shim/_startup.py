"""Install, uninstall, status and register: the shim's Python API.

The start-up path itself is ``npu_shim._boot`` (a finder, the export of the
bootstrap directory for children, the chain to the next sitecustomize); this
module loads when a process configures the shim (an ``NPU_SHIM*`` variable),
imports ``npu_shim`` or calls the API, or when a watched framework
(``vllm``, ``transformers``, ...) starts importing. It then loads the real
machinery (``_machinery``: wrapt post-import hooks, ``packaging``,
``importlib.metadata``, ``logging``) once.
"""
import os
import sys

from npu_shim import _boot, _config

BOOTSTRAP_DIR = _boot.BOOTSTRAP_DIR
PACKAGE_PARENT = _boot.PACKAGE_PARENT
_State = _boot.State


def settings():
    """The validated settings of this process (made once, on first use)."""
    with _State.lock:
        if _State.settings is None:
            # Booted without NPU_SHIM* variables: the defaults, whatever the
            # environment says later (as if validated at start-up).
            _State.settings = _config.Settings({} if _State.defaults else None)
        return _State.settings


def install():
    """Install the shim in this process (idempotent, thread-safe).

    Raises :class:`npu_shim.ConfigError` for malformed ``NPU_SHIM*`` variables.
    """
    with _State.lock:
        if _State.installed:
            return
        current = _config.Settings()
        _State.settings = current
        for line in current.warnings():
            sys.stderr.write("npu-shim: %s\n" % line)
        if not current.enabled:
            return
        _boot.activate()
        if current.emulate:
            from npu_shim import emulation

            emulation.install()
        already = [name for name in _State.watched if name in sys.modules]
    if already and _State.machinery is None:
        _load_machinery()
    elif _State.machinery is not None:
        _State.machinery.arm()


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


def boot_configured():
    """Start-up with NPU_SHIM* variables set: validate and report on stderr, never raise."""
    try:
        install()
    except _config.ConfigError as exc:
        sys.stderr.write("npu-shim: %s; the shim is not installed in this process\n" % exc)


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
    return _machinery().status()


def stats():
    """What each patch did in this process: state, reason, adapter and its counters.

    ``{patch name: {"state", "reason", "adapter", "calls", "upstream_calls",
    "host_copies", "upstream_host_copies"}}``. Counters start at 0 in every
    process (a forked child starts from 0 too).
    """
    machinery = _machinery()
    from npu_shim import _stats

    counted = _stats.snapshot()
    out = {}
    for row in machinery.status():
        entry = {"state": row["state"], "reason": row["reason"]}
        entry.update(counted.get(row["name"]) or _stats.empty_row())
        out[row["name"]] = entry
    return out


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


def _machinery():
    _load_machinery()
    if _State.machinery is None:
        raise ImportError("npu-shim cannot run here: %s" % _State.unavailable)
    return _State.machinery


def on_watched_import(finder, fullname, path, target):
    """The first import of a watched package: load the machinery, then let its
    post-import finder (now in front of ours) see this very import."""
    _load_machinery()
    if _State.machinery is None:
        return None
    for other in list(sys.meta_path):
        if other is finder:
            break
        spec = other.find_spec(fullname, path, target)
        if spec is not None:
            return spec
    return None


def _load_machinery():
    with _State.lock:
        if _State.machinery is not None or _State.unavailable is not None:
            return
        try:
            from npu_shim import _machinery
        except ImportError as exc:
            # A child interpreter that inherited the shim through PYTHONPATH but
            # not its dependencies (another venv, a system Python): say so once,
            # and let every import go on unpatched.
            missing = getattr(exc, "name", None) or str(exc)
            _State.unavailable = "%s is not importable (%s)" % (missing, sys.executable)
            sys.stderr.write("npu-shim: %s; nothing is patched in this process\n" % _State.unavailable)
            return
        settings()
        _machinery.load(_State)
        _State.machinery = _machinery
        if _State.installed:
            _machinery.arm()


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
