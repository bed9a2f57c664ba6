"""The public API: ``npu_shim.install()``, ``uninstall()``, ``status()``, ``stats()``,
``register()``, ``ConfigError``. A thin layer over the process side
(:mod:`npu_shim._startup`) and the engine (:mod:`npu_shim.engine.registry`)."""
from npu_shim import _config, _startup

__all__ = ["ConfigError", "install", "register", "stats", "status", "uninstall"]

ConfigError = _config.ConfigError


def install():
    """Install the shim in this process (idempotent, thread-safe).

    Raises :class:`ConfigError` for malformed ``NPU_SHIM*`` variables.
    """
    _startup.install()


def uninstall():
    """Revert every applied patch (restoring the original objects) and stop watching."""
    _startup.uninstall()


def register(patch):
    """Add a patch of your own (a :class:`npu_shim.patch.Patch`)."""
    _startup.register(patch)


def status():
    """One dict per patch: ``name``, ``target``, ``state``, ``family`` (the release family
    that applied), ``families``, ``reason``, ``requires``, ``versions``, ...

    Evaluates version guards for patches whose target is not imported yet (state
    ``pending``); a target package that is not installed reads ``skipped`` / ``not
    installed``.
    """
    return _startup.engine().status()


def stats():
    """What each patch did in this process: state, reason, family and its counters.

    ``{patch name: {"state", "reason", "family", "calls", "upstream_calls",
    "host_copies", "upstream_host_copies"}}``. Counters start at 0 in every
    process (a forked child starts from 0 too).
    """
    return _startup.engine().stats()
