"""The patches of this process: post-import hooks, the decision, apply and revert.

A patch goes through these steps when its target module finishes importing
(wrapt post-import hook), each able to stop it with a recorded reason:

1. switched off by the environment            -> ``disabled``
2. no family declared                         -> ``skipped`` (not implemented)
3. a required distribution missing / outside its PEP 440 range -> ``skipped``
4. needs an NPU kernel and ``torch_npu`` is not importable     -> ``skipped``
5. a declared attribute missing -> TargetMismatch; the family whose fence holds
   and whose check accepts the code (``guards.select_family``): every family says
   NotNeeded -> ``skipped``; none accepts -> ``skipped`` with every family's
   reason (strict: raises). A release newer than every release the family was
   read in (npu_shim/releases_read.json) gets the family its code has, and the
   status says so ("applied by structure; sglang 0.5.24 not read yet"); strict
   refuses it (``skipped``, raises)
6. the family's ``build`` (handed the context its check ran with: ``context.found`` is
   what the check returned) + atomic write    -> ``applied`` (family recorded) /
   ``failed`` (strict: raises)

The installed versions are read once per application (step 3) and passed to every later step.
"""
from __future__ import annotations

import time

_IMPORT_STARTED = time.perf_counter()

import contextlib
import importlib
import logging
import os
import sys

import wrapt

from npu_shim import _config, _fork
from npu_shim.engine import counters, guards
from npu_shim.engine.slots import Slot, apply_atomically, revert
from npu_shim.patch import NotNeeded, Patch, PatchError, TargetMismatch
from npu_shim.patches import BUILTIN_PATCHES

logger = logging.getLogger("npu_shim")
_IMPORT_SECONDS = time.perf_counter() - _IMPORT_STARTED

PENDING, APPLIED, SKIPPED, DISABLED, FAILED = "pending", "applied", "skipped", "disabled", "failed"
NOT_IMPLEMENTED = "not implemented"


class Record:
    """What the shim knows about one patch in this process."""

    def __init__(self, patch: Patch):
        self.patch = patch
        self.state = PENDING
        self.reason = "waiting for import of %s" % patch.target
        self.undo = None          # [(slot, original)] while applied
        self.family = None        # the Family whose build is applied
        self.armed_generation = None
        self.seconds = 0.0        # time the shim spent deciding and applying this patch

    def set(self, state, reason):
        self.state, self.reason = state, reason


_startup_state = None
_records: dict = {}
load_seconds = 0.0  # importing the machinery and the patch declarations


def load(startup_state) -> None:
    """Called once by ``npu_shim._startup`` when the engine is first needed, with the
    process state it owns (lock, generation, installed flag, patches registered
    before the engine loaded)."""
    global _startup_state, load_seconds
    started = time.perf_counter()
    _startup_state = startup_state
    _configure_logging(_config.settings())
    for name, module_name in BUILTIN_PATCHES:
        patch = importlib.import_module(module_name).PATCH
        if patch.name != name:
            raise RuntimeError("%s declares %r, the index says %r" % (module_name, patch.name, name))
        _records[name] = Record(patch)
    for patch in startup_state.extra_patches:
        _add(patch)
    startup_state.extra_patches.clear()
    _hold_import_hooks_lock_across_fork()
    load_seconds = time.perf_counter() - started + _IMPORT_SECONDS


def _hold_import_hooks_lock_across_fork() -> None:
    """wrapt's import-hook lock, like the shim's own (held by npu_shim._startup), must
    not be inherited held by a thread the child does not have. Added after the shim's
    lock: the order the shim takes them (shim lock, then wrapt's while arming). The
    hooks are registered again now that logging is loaded, so that they take the
    shim's locks before logging takes its own (the shim logs under its lock)."""
    hooks_lock = getattr(getattr(wrapt, "importer", None), "_post_import_hooks_lock", None)
    if hooks_lock is not None:
        _fork.hold_across_fork(hooks_lock)
    _fork.register_with_interpreter()


def _configure_logging(settings) -> None:
    if settings.log_level is None:
        return
    logger.setLevel(settings.log_level)
    if not logger.handlers:
        handler = logging.StreamHandler(sys.stderr)
        handler.setFormatter(logging.Formatter("%(name)s %(levelname)s: %(message)s"))
        logger.addHandler(handler)


def _add(patch: Patch) -> Record:
    if patch.name in _records:
        raise ValueError("a patch named %r is already registered" % patch.name)
    record = _records[patch.name] = Record(patch)
    return record


def patch_named(name: str) -> Patch:
    return _records[name].patch


def register(patch: Patch) -> None:
    record = _add(patch)
    if _startup_state.installed:
        _arm_one(record, _config.settings())


def arm() -> None:
    """Register a post-import hook for every patch the environment allows."""
    settings = _config.settings()
    unknown = settings.unknown_names(_records)
    if unknown:
        message = "; ".join("%s names unknown patch %r" % pair for pair in unknown)
        message += "; valid names: %s" % ", ".join(sorted(_records))
        if settings.strict:
            raise _config.ConfigError(message)
        logger.warning(message)
    for record in list(_records.values()):
        _arm_one(record, settings)


def _arm_one(record: Record, settings) -> None:
    generation = _startup_state.generation
    if record.armed_generation == generation:
        return
    record.armed_generation = generation
    off = settings.disabled_reason(record.patch.name)
    if off:
        record.set(DISABLED, off)
        return
    if record.state == DISABLED:
        record.set(PENDING, "waiting for import of %s" % record.patch.target)

    def hook(module, record=record, generation=generation):
        if _startup_state.generation == generation and _startup_state.installed:
            on_target_imported(record, module)

    wrapt.register_post_import_hook(hook, record.patch.target)


def disarm() -> None:
    with _startup_state.lock:
        # newest first: patches that replace one attribute stack in registration order (each
        # wraps what the one before it left), so each must put back what it found there
        for record in reversed(list(_records.values())):
            if record.undo is not None:
                revert(record.undo)
                record.undo = None
                record.family = None
            record.armed_generation = None
            record.set(DISABLED, "uninstalled by npu_shim.uninstall()")
        counters.reverted()


def _preflight(record: Record, settings, versions: dict):
    """(state, reason) if the patch cannot go on, else None. Order: env, body, versions, NPU.
    ``versions``: the patch's installed versions, read once by the caller (guards.versions_of)."""
    patch = record.patch
    off = settings.disabled_reason(patch.name)
    if off:
        return DISABLED, off
    if not patch.implemented:
        return SKIPPED, NOT_IMPLEMENTED
    why = guards.guard_failure(patch, versions) or guards.npu_failure(patch)
    if why:
        return SKIPPED, why
    return None


def _structural_check(patch: Patch, module, versions: dict, settings):
    """The :class:`guards.Chosen` family that accepts the installed code, or raise."""
    for path in patch.replaces:
        slot = Slot(module, path)   # raises TargetMismatch for a missing owner
        if not slot.is_item and not slot.exists():
            raise TargetMismatch("%s.%s not found" % (module.__name__, path))
    return guards.select_family(patch, module, versions, by_structure=settings.family_by_structure)


def on_target_imported(record: Record, module) -> None:
    """The post-import hook body: decide, apply, record; strict mode raises."""
    started = time.perf_counter()
    try:
        _decide_and_apply(record, module)
    finally:
        record.seconds += time.perf_counter() - started


def _decide_and_apply(record: Record, module) -> None:
    settings = _config.settings()
    patch = record.patch
    with _startup_state.lock:
        if record.undo is not None:
            return
        # The installed versions, read once for this application: the guard, the fences, the
        # status reason and its notes all take these.
        versions = guards.versions_of(patch)
        stop = _preflight(record, settings, versions)
        if stop:
            record.set(*stop)
            logger.debug("%s %s: %s", patch.name, stop[0], stop[1])
            return
        try:
            chosen = _structural_check(patch, module, versions, settings)
            family, implementation, subject = chosen
        except NotNeeded as exc:
            record.set(SKIPPED, str(exc))
            logger.debug("%s skipped: %s", patch.name, exc)
            return
        except TargetMismatch as exc:
            record.set(SKIPPED, "structural check: %s" % exc)
            _complain(settings, patch, "target does not match: %s" % exc)
            return
        except Exception as exc:
            record.set(FAILED, "check raised %s: %s" % (type(exc).__name__, exc))
            _complain(settings, patch, record.reason, exc)
            return
        unread = guards.unread_release(patch, family, versions)
        if unread and settings.strict:
            # strict: a family applies only up to the newest release it was read in
            record.set(SKIPPED, "family %s accepts the code, but %s; NPU_SHIM_STRICT=1 applies a family only "
                                "to releases it was read in or older" % (family.name, unread))
            _complain(settings, patch, record.reason)
            return
        try:
            values = guards.build_values(patch, family, implementation, subject, chosen.context)
            record.undo = apply_atomically(module, patch, values)
        except TargetMismatch as exc:
            # what build found is not the shape (a replacement that cannot take upstream's calls)
            record.set(SKIPPED, "structural check: %s" % exc)
            _complain(settings, patch, "target does not match: %s" % exc)
            return
        except Exception as exc:
            record.set(FAILED, "%s: %s" % (type(exc).__name__, exc))
            _complain(settings, patch, record.reason, exc)
            return
        record.family = family
        reason = "; ".join("%s %s%s" % (dist, version, " (%s)" % guards.version_source(dist)
                                         if guards.version_source(dist) else "")
                           for dist, version in versions.items()) or "applied"
        notes = [guards.structure_note(patch, family, versions, settings.family_by_structure),
                 "applied by structure; " + unread if unread else ""]
        record.set(APPLIED, "; ".join([reason] + [note for note in notes if note]))
        logger.info("[%s] applied %s to %s (%s%s)", counters.process_label(), patch.name, patch.target,
                    record.reason, ", family %s" % family.name if patch.named_families else "")
        counters.applied(patch.name, family.name if patch.named_families else "", settings.stats_dir)
        if settings.exit_summary or settings.stats_dir:
            _at_exit()


@contextlib.contextmanager
def upstream_in_place(name: str):
    """Upstream's own objects back in the slots of the applied patch ``name`` while the block runs,
    the patch's replacements written back after it (its status stays "applied"): how a retirement
    guard runs the patch's selftest on upstream's code (:func:`npu_shim.selftest.run_upstream`).
    Raises LookupError where the patch is not applied in this process."""
    record = _records.get(name)
    if record is None or record.undo is None:
        raise LookupError("%s is not applied here; upstream's code is already in place" % name)
    with _startup_state.lock:
        ours = [(slot, slot.read_own()) for slot, _ in record.undo]
        revert(record.undo)
    try:
        yield record
    finally:
        with _startup_state.lock:
            revert(ours)


_exit_registered = False


def _at_exit() -> None:
    """What each process that applied a patch does at exit: NPU_SHIM_EXIT_SUMMARY=1 prints its
    lines, NPU_SHIM_STATS_DIR writes its record's last counts (atexit; multiprocessing children
    end with os._exit, so they get a finalizer). A process killed by a signal runs
    neither: its record on disk is the one written as the counters changed."""
    global _exit_registered
    if _exit_registered:
        return
    _exit_registered = True
    import atexit
    import multiprocessing.util as mp_util

    atexit.register(_exit_summary)
    # this process, where it is a multiprocessing child already (vLLM's EngineCore and workers apply
    # their patches themselves), and every child forked from it later
    mp_util.Finalize(None, _exit_summary, exitpriority=0)
    mp_util.register_after_fork(_exit_summary, lambda _: mp_util.Finalize(None, _exit_summary, exitpriority=0))


def _exit_summary(printed_by=set()) -> None:
    pid = os.getpid()
    if pid in printed_by:       # atexit and the multiprocessing finalizer of one process
        return
    printed_by.add(pid)
    counters.flush_record()
    if not _config.settings().exit_summary:
        return
    for line in counters.summary_lines(stats()):
        sys.stderr.write(line + "\n")
    sys.stderr.flush()


def _complain(settings, patch: Patch, message: str, cause: BaseException = None) -> None:
    text = "patch %r on %s: %s" % (patch.name, patch.target, message)
    if settings.strict:
        raise PatchError(text + " (NPU_SHIM_STRICT=1)") from cause
    logger.warning("%s; %s left unpatched", text, patch.target)


def status(import_targets: bool = False) -> list:
    """Evaluate every patch for this process; optionally import the targets first."""
    settings = _config.settings()
    if import_targets:
        _import_targets(settings)
    rows = []
    for record in list(_records.values()):
        patch = record.patch
        state, reason = record.state, record.reason
        versions = guards.versions_of(patch)
        if record.undo is None and state == PENDING:
            # Not decided yet: show what the guards already say about it.
            stop = _preflight(record, settings, versions)
            if stop:
                state, reason = stop
        named = record.undo is not None and patch.named_families
        family = record.family.name if named else None
        release = None
        if named and (record.family.dist or patch.requires):
            release = versions.get(patch.family_dist(record.family))
            release = None if guards.development_build(release) else release
        rows.append(
            {
                "name": patch.name,
                "target": patch.target,
                "replaces": list(patch.replaces) + list(patch.may_replace),
                "state": state,
                "family": family,
                "families": [f.name for f in patch.families] if patch.named_families else [],
                "admitted": guards.admitting_families(patch, versions),
                # the installed release of the applied family's distribution (None: not applied,
                # or a development or local build), and the families recorded as read in the
                # installed releases (npu_shim/releases_read.json; inside the window only):
                # lanes/report.py records the one and checks the other
                "release": release,
                "read_as": guards.read_as(patch, versions),
                "reason": reason,
                # the release where upstream fixed the patch's defect, where the installed one is at
                # or past it (Defect.fixed_at: the window ends there), else None
                "upstream_fixed": _upstream_fixed(patch, versions),
                # what the patch decided at run time and why (FamilyContext.note)
                "notes": counters.notes(patch.name),
                "requires": dict(patch.requires),
                "versions": versions,
                "needs_npu": patch.needs_npu,
                "summary": patch.summary,
                "switches": settings.switches(patch.name),
                "seconds": round(record.seconds, 6),
            }
        )
    return rows


def _upstream_fixed(patch: Patch, versions: dict):
    """"<dist> <release>" where upstream fixed the patch's defect and the installed release is at or
    past it (:func:`guards.upstream_fixed`), else None."""
    defect = patch.defect
    if defect is None or not defect.fixed_at or not versions.get(defect.fixed_at):
        return None
    try:
        fixed = next(filter(None, (guards.upstream_fixed(patch, defect.fixed_at, spec, versions[defect.fixed_at])
                                   for spec in patch.window.get(defect.fixed_at, ("",)))), None)
    except Exception:
        return None
    return "%s %s" % (defect.fixed_at, fixed) if fixed else None


def _import_targets(settings) -> None:
    for record in list(_records.values()):
        patch = record.patch
        if _preflight(record, settings, guards.versions_of(patch)) or patch.target in sys.modules:
            continue
        try:
            importlib.import_module(patch.target)
        except PatchError:
            raise
        except Exception as exc:
            record.set(SKIPPED, "target failed to import: %s: %s" % (type(exc).__name__, exc))


def stats() -> dict:
    """``{patch: {state, reason, family, <counter>: n}}`` for this process."""
    counted = counters.snapshot()
    out = {}
    for row in status():
        entry = {"state": row["state"], "reason": row["reason"], "family": row["family"]}
        entry.update(counted.get(row["name"]) or counters.empty_row())
        out[row["name"]] = entry
    return out
