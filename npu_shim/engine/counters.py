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

Loaded only by patch modules and the engine (never at interpreter start).
"""
import _thread
import os
from collections import Counter, defaultdict

from npu_shim import _fork

__all__ = ["count", "snapshot", "reset", "note", "notes"]

EVENTS = ("calls", "upstream_calls", "host_copies", "upstream_host_copies")

_counts = defaultdict(Counter)   # patch name -> Counter(event -> n)
_notes = defaultdict(dict)       # patch name -> {key: text}, in the order first noted
_lock = _thread.allocate_lock()


def count(patch, event, n=1):
    with _lock:
        _counts[patch][event] += n


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


_fork.reset_in_child(_after_fork_in_child)


def summary_lines(rows):
    """One line per applied patch: ``npu-shim[pid N]: NAME family=F calls=... ...``.

    ``rows`` is what ``npu_shim.stats()`` returns.
    """
    pid = os.getpid()
    return [
        "npu-shim[pid %d]: %s family=%s %s" % (
            pid, name, row["family"] or "-", " ".join("%s=%d" % (e, row[e]) for e in EVENTS))
        for name, row in rows.items()
        if row["state"] == "applied"
    ]
