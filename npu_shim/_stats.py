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
``adapter:<name>``         not counted: set once with :func:`note_adapter`

Per process: a forked child starts from zero (its parent's counts are the
parent's). ``npu_shim.stats()`` reads them with each patch's state;
``NPU_SHIM_EXIT_SUMMARY=1`` prints one line per applied patch at exit.

Loaded only by patch modules and the API (never at interpreter start).
"""
import _thread
import os
from collections import Counter, defaultdict

__all__ = ["count", "note_adapter", "snapshot", "reset"]

EVENTS = ("calls", "upstream_calls", "host_copies", "upstream_host_copies")

_counts = defaultdict(Counter)   # patch name -> Counter(event -> n)
_adapters = {}                   # patch name -> adapter that applied
_lock = _thread.allocate_lock()


def count(patch, event, n=1):
    with _lock:
        _counts[patch][event] += n


def note_adapter(patch, adapter):
    _adapters[patch] = adapter


def empty_row():
    return dict({"adapter": None}, **{event: 0 for event in EVENTS})


def snapshot():
    """{patch: {"adapter": str|None, event: n, ...}} for every patch with a count or adapter."""
    with _lock:
        counts = {name: dict(events) for name, events in _counts.items()}
    out = {}
    for name in sorted(set(counts) | set(_adapters)):
        row = empty_row()
        row["adapter"] = _adapters.get(name)
        row.update({event: counts.get(name, {}).get(event, 0) for event in EVENTS})
        out[name] = row
    return out


def reset():
    """Zero every counter (the adapters that applied stay: the patches are still in place)."""
    with _lock:
        _counts.clear()


def _after_fork_in_child():
    # The parent's lock may have been held by a thread the child does not have.
    global _lock
    _lock = _thread.allocate_lock()
    _counts.clear()


os.register_at_fork(after_in_child=_after_fork_in_child)


def summary_lines(rows):
    """One line per applied patch: ``npu-shim[pid N]: NAME adapter=A calls=... ...``.

    ``rows`` is what ``npu_shim.stats()`` returns.
    """
    pid = os.getpid()
    return [
        "npu-shim[pid %d]: %s adapter=%s %s" % (
            pid, name, row["adapter"] or "-", " ".join("%s=%d" % (e, row[e]) for e in EVENTS))
        for name, row in rows.items()
        if row["state"] == "applied"
    ]
