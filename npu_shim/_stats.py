"""Per-process counters of what the applied patches did.

Patches call :func:`count` on their hot paths; it must stay a dictionary
increment. Event names (one counter each, per patch):

``calls``                  the replaced function ran
``upstream_calls``         it handed the call to upstream's original code
                           (disabled path, graph capture, a shape it leaves alone)
``host_copies``            device->host copies the shim made
``upstream_host_copies``   device->host copies upstream would have made for the
                           same calls (where the patch can tell)
``adapter:<name>``         not counted: set once with :func:`note_adapter`

Loaded only by patch modules (never at interpreter start).
"""
from collections import Counter, defaultdict

__all__ = ["count", "note_adapter", "snapshot", "reset"]

EVENTS = ("calls", "upstream_calls", "host_copies", "upstream_host_copies")

_counts = defaultdict(Counter)   # patch name -> Counter(event -> n)
_adapters = {}                   # patch name -> adapter that applied


def count(patch, event, n=1):
    _counts[patch][event] += n


def note_adapter(patch, adapter):
    _adapters[patch] = adapter


def snapshot():
    """{patch: {"adapter": str|None, event: n, ...}} for every patch with a count or adapter."""
    names = set(_counts) | set(_adapters)
    out = {}
    for name in sorted(names):
        row = {"adapter": _adapters.get(name)}
        row.update({event: _counts[name].get(event, 0) for event in EVENTS})
        out[name] = row
    return out


def reset():
    _counts.clear()
