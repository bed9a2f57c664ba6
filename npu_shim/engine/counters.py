"""Per-process counters of what the applied patches did.

Patches call :func:`count` on their hot paths; it stays a dictionary
increment (under a lock: ``+=`` on a dict entry is not atomic across threads).
Event names (one counter each, per patch):

``calls``                  the replaced function ran
``upstream_calls``         it handed the call to upstream's original code
                           (disabled path, graph capture, a shape it leaves alone)
``host_copies``            device->host copies the shim made
``upstream_host_copies``   device->host copies upstream would have made for the
                           same calls (where the patch can tell; 0 otherwise)

The family that applied is the engine's record (``registry``), not a counter.

Notes: what a patch decided at run time and why, in words (:func:`note`, one line per
key, the last one kept), e.g. the CANN release it read and what that means for its path,
or why a call of some shape stays with upstream. ``npu-shim status`` and
``npu_shim.status()`` show them beside the patch's reason.

Per process: a forked child starts from zero (its parent's counts are the
parent's). ``npu_shim.stats()`` reads them with each patch's state;
``NPU_SHIM_EXIT_SUMMARY=1`` prints one line per applied patch at exit.

The record on disk (``NPU_SHIM_STATS_DIR``): a process killed at shutdown (vLLM
kills its EngineCore and workers) runs no exit hook, so each process that applied
a patch keeps ``npu-shim-<pid>.json`` in that directory (:func:`record_path`):
its pid, its role (the name multiprocessing gave it, e.g. vLLM's ``EngineCore``,
``VllmWorker-0``), each applied patch's family and counters. It is written when a
patch applies, at a patch's first count of an event, then at most every
:data:`RECORD_INTERVAL` seconds while the counters change (a timer writes the last
change), and at exit; written whole to a temporary file and renamed, so a reader
never sees half a record. ``npu-shim stats --processes`` reads them
(:func:`read_records`). :func:`count` itself stays a dictionary increment and a
clock read.

Loaded only by patch modules and the engine (never at interpreter start).
"""
import _thread
import json
import os
import sys
import time
from collections import Counter, defaultdict

from npu_shim import _fork

__all__ = ["count", "snapshot", "reset", "note", "notes", "applied", "process_label", "read_records"]

EVENTS = ("calls", "upstream_calls", "host_copies", "upstream_host_copies")
RECORD_INTERVAL = 0.5            # seconds: how far the record on disk may lag the counters
RECORD_PREFIX, RECORD_SUFFIX = "npu-shim-", ".json"

_counts = defaultdict(Counter)   # patch name -> Counter(event -> n)
_notes = defaultdict(dict)       # patch name -> {key: text}, in the order first noted
_lock = _thread.allocate_lock()


class _Record:
    """This process's record on disk (NPU_SHIM_STATS_DIR)."""
    directory = None             # where to write; None: no record
    applied = {}                 # patch name -> family id ("" for a patch without named families)
    written = 0.0                # time.monotonic() of the last write
    dirty = False                # counted since the last write
    timer = None                 # the pending write of the last change
    write_lock = _thread.allocate_lock()
    failed = None                # why the record could not be written (stops writing)


def count(patch, event, n=1):
    with _lock:
        row = _counts[patch]
        first = event not in row
        row[event] += n
        if _Record.directory is None:
            return
        _Record.dirty = True
        due = first or time.monotonic() - _Record.written >= RECORD_INTERVAL
        if not due and _Record.timer is not None:
            return
    if due:
        write_record()
    else:
        _write_later()


def empty_row():
    return {event: 0 for event in EVENTS}


def snapshot():
    """{patch: {event: n, ...}} for every patch with a count."""
    with _lock:
        counts = {name: dict(events) for name, events in _counts.items()}
    return {name: dict(empty_row(), **counts[name]) for name in sorted(counts)}


def note(patch, key, text):
    """Record ``text`` as what ``patch`` decided about ``key`` (replacing an earlier note of it)."""
    with _lock:
        _notes[patch][key] = text


def notes(patch):
    """The notes of ``patch``, oldest key first."""
    with _lock:
        return list(_notes[patch].values()) if patch in _notes else []


def reset():
    """Zero every counter and drop every note."""
    with _lock:
        _counts.clear()
        _notes.clear()


def _after_fork_in_child():
    # The parent's lock may have been held by a thread the child does not have.
    global _lock
    _lock = _thread.allocate_lock()
    _counts.clear()
    _notes.clear()
    # The child writes a record of its own (its pid); the parent's timer thread is not here.
    _Record.write_lock = _thread.allocate_lock()
    _Record.timer = None
    _Record.dirty = False
    _Record.written = 0.0


_fork.reset_in_child(_after_fork_in_child)


def process_role():
    """The name multiprocessing gave this process (vLLM names its processes ``EngineCore``,
    ``EngineCore_DP0``, ``VllmWorker-0``), or None for a main process. Read only where
    multiprocessing is loaded already: nothing is imported for it."""
    mp = sys.modules.get("multiprocessing")
    try:
        name = mp.current_process().name if mp is not None else None
    except Exception:                   # a half-initialised multiprocessing: no role
        return None
    return name if name and name != "MainProcess" else None


def process_label():
    """``pid N`` or ``pid N EngineCore``: how the shim's lines name this process."""
    role = process_role()
    return "pid %d%s" % (os.getpid(), " " + role if role else "")


def summary_lines(rows):
    """One line per applied patch: ``npu-shim[pid N ROLE]: NAME family=F calls=... ...``
    (ROLE where multiprocessing names the process).

    ``rows`` is what ``npu_shim.stats()`` returns.
    """
    label = process_label()
    return [
        "npu-shim[%s]: %s family=%s %s" % (
            label, name, row["family"] or "-", " ".join("%s=%d" % (e, row[e]) for e in EVENTS))
        for name, row in rows.items()
        if row["state"] == "applied"
    ]


# The record on disk (NPU_SHIM_STATS_DIR) ----------------------------------------------------

def record_path(directory, pid=None):
    return os.path.join(directory, "%s%d%s" % (RECORD_PREFIX, os.getpid() if pid is None else pid,
                                               RECORD_SUFFIX))


def applied(patch, family, directory):
    """The engine applied ``patch`` (family id ``family``); ``directory``: NPU_SHIM_STATS_DIR
    (None: no record). Writes the record, so a process that applied and never counted has one."""
    with _lock:
        _Record.applied = dict(_Record.applied, **{patch: family or ""})
        _Record.directory = directory if _Record.failed is None else None
    if _Record.directory is not None:
        write_record()


def reverted():
    """Every patch was reverted (``npu_shim.uninstall()``): the record says none is applied."""
    with _lock:
        _Record.applied = {}
    if _Record.directory is not None:
        write_record()


def _record_body():
    with _lock:
        counts = {name: dict(events) for name, events in _counts.items()}
        applied_now = dict(_Record.applied)
        _Record.dirty = False
    patches = {}
    for name in sorted(set(applied_now) | set(counts)):
        patches[name] = dict(empty_row(), family=applied_now.get(name), applied=name in applied_now,
                             **counts.get(name, {}))
    return {"pid": os.getpid(), "role": process_role(), "argv": list(getattr(sys, "argv", None) or []),
            "written": time.time(), "patches": patches}


def write_record():
    """Write this process's record now (temporary file, then rename). A failure is reported
    once on stderr and stops the writing; it never reaches the caller."""
    directory = _Record.directory
    if directory is None:
        return
    with _Record.write_lock:
        body = _record_body()
        path = record_path(directory)
        temporary = "%s.%d.tmp" % (path, _thread.get_ident())
        try:
            os.makedirs(directory, exist_ok=True)
            with open(temporary, "w") as handle:
                json.dump(body, handle, sort_keys=True)
            os.replace(temporary, path)
        except OSError as exc:
            _Record.failed = "%s: %s" % (type(exc).__name__, exc)
            _Record.directory = None
            sys.stderr.write("npu-shim[%s]: cannot write the record in NPU_SHIM_STATS_DIR=%s (%s); "
                             "no record is kept for this process\n" % (process_label(), directory,
                                                                         _Record.failed))
            return
        _Record.written = time.monotonic()


def _write_later():
    """A timer writes the record once RECORD_INTERVAL has passed since the last write."""
    import threading

    with _lock:
        if _Record.timer is not None:
            return
        delay = max(0.0, RECORD_INTERVAL - (time.monotonic() - _Record.written))
        timer = _Record.timer = threading.Timer(delay, _timer_fired)
        timer.daemon = True
    timer.start()


def _timer_fired():
    with _lock:
        _Record.timer = None
        dirty = _Record.dirty
    if dirty:
        write_record()


def flush_record():
    """Write the record if a count is not on disk yet (at exit)."""
    if _Record.directory is not None and _Record.dirty:
        write_record()


def read_records(directory):
    """``(records, problems)``: every process's record in ``directory`` (sorted by pid), each
    with ``alive`` (whether a process with that pid runs now: a pid reused by another process
    reads alive too), and a line for each file that could not be read."""
    records, problems = [], []
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        return [], ["cannot read %s: %s" % (directory, exc)]
    for name in names:
        if not (name.startswith(RECORD_PREFIX) and name.endswith(RECORD_SUFFIX)):
            continue
        path = os.path.join(directory, name)
        try:
            with open(path) as handle:
                record = json.load(handle)
            pid = int(record["pid"])
            patches = dict(record["patches"])
        except (OSError, ValueError, KeyError, TypeError) as exc:
            problems.append("%s: not a record (%s: %s)" % (path, type(exc).__name__, exc))
            continue
        record["alive"] = _alive(pid)
        record["patches"] = patches
        records.append(record)
    records.sort(key=lambda r: r["pid"])
    return records, problems


def _alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except OSError:                     # another user's process
        return True
    return True
