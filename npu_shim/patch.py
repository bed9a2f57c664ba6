"""How a patch is declared.

A patch is data: a stable name, the module whose import triggers it, the
attributes it replaces, the distributions and versions it needs (PEP 440), and
whether it calls an NPU kernel. Two functions complete it: ``check(module)``
looks at the imported target and raises :class:`NotNeeded` or
:class:`TargetMismatch` when the patch should not go on; ``build(module)``
returns the new values for exactly the declared attributes, without touching
the module. The machinery sets them all or none and keeps the originals so
that :func:`npu_shim.uninstall` can put back the very same objects.

A patch served by several adapters (one per upstream release family) lets
``build`` return :class:`Adapted`: the adapter's name, which ``npu-shim status``
shows, and the values it replaces, which may be any non-empty subset of the
declared ``replaces`` (each family replaces what its release needs).

Attribute paths are dotted names inside the target module (``Class.method``),
optionally ending in a string key of a dict (``TABLE['key']``), for entries a
patch adds to a registry dict.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping, Optional, Tuple


class NotNeeded(Exception):
    """The target does not need this patch (fixed or rewritten upstream)."""


class TargetMismatch(Exception):
    """The target does not look like the code this patch was written for."""


class PatchError(RuntimeError):
    """Raised in strict mode when a patch fails or its target mismatches."""


@dataclass(frozen=True)
class Adapted:
    """What ``build`` returns when one of several adapters built the replacements."""

    adapter: str                  # shown by ``npu-shim status`` / ``status()`` as "adapter"
    values: Mapping[str, Any]     # a non-empty subset of ``Patch.replaces``


def unpack_build(result):
    """``(values, adapter name or None, exact)`` of what ``build`` returned.

    ``exact``: the values must cover every declared attribute (plain mappings);
    an :class:`Adapted` result may cover a subset.
    """
    if isinstance(result, Adapted):
        return result.values, result.adapter, False
    return result, None, True


@dataclass(frozen=True)
class Patch:
    name: str
    target: str
    replaces: Tuple[str, ...]
    requires: Mapping[str, str] = field(default_factory=dict)
    # Per distribution: what a version outside ``requires`` means, e.g.
    # {"vllm": "0.14+ dispatches MoonViT through MMEncoderAttention"}.
    outside_window: Mapping[str, str] = field(default_factory=dict)
    needs_npu: bool = False
    check: Optional[Callable[[ModuleType], None]] = None
    build: Optional[Callable[[ModuleType], Mapping[str, Any]]] = None
    summary: str = ""
    # Dotted module whose ``run(device)`` checks the patched path against float64
    # (``npu-shim selftest``); "" where the patch has none.
    selftest: str = ""

    def __post_init__(self):
        if isinstance(self.replaces, str):
            raise TypeError("Patch.replaces must be a tuple of attribute paths, not a string")
        for path in self.replaces:
            parse_path(path)
        stray = set(self.outside_window) - set(self.requires)
        if stray:
            raise ValueError("outside_window names %s, which requires does not" % sorted(stray))

    @property
    def implemented(self) -> bool:
        return self.build is not None


_PATH = re.compile(r"^(?P<attrs>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\[(?P<q>['\"])(?P<key>[^'\"]+)(?P=q)\])?$")


def parse_path(path: str) -> Tuple[Tuple[str, ...], Optional[str]]:
    """Split ``"A.b['k']"`` into ``(("A", "b"), "k")``."""
    match = _PATH.match(path)
    if not match:
        raise ValueError("bad attribute path %r: use dotted names, optionally ending in ['key']" % path)
    return tuple(match.group("attrs").split(".")), match.group("key")


_MISSING = object()


class Slot:
    """One place a patch writes to: an attribute of an object or a key of a dict."""

    __slots__ = ("path", "owner", "key", "is_item")

    def __init__(self, module: ModuleType, path: str):
        attrs, key = parse_path(path)
        owner = module
        walked = [module.__name__]
        for name in attrs[:-1] if key is None else attrs:
            walked.append(name)
            try:
                owner = getattr(owner, name)
            except AttributeError:
                raise TargetMismatch("%s not found" % ".".join(walked)) from None
        self.path = path
        self.owner = owner
        self.is_item = key is not None
        self.key = key if self.is_item else attrs[-1]
        if self.is_item and not isinstance(owner, dict):
            raise TargetMismatch("%s.%s is a %s, not a dict" % (module.__name__, ".".join(attrs), type(owner).__name__))

    def exists(self) -> bool:
        if self.is_item:
            return self.key in self.owner
        return hasattr(self.owner, self.key)

    def read_own(self):
        """The value stored here (not inherited), or _MISSING."""
        if self.is_item:
            return self.owner.get(self.key, _MISSING)
        return vars(self.owner).get(self.key, _MISSING) if hasattr(self.owner, "__dict__") else getattr(self.owner, self.key, _MISSING)

    def write(self, value) -> None:
        if value is _MISSING:
            if self.is_item:
                self.owner.pop(self.key, None)
            elif self.key in vars(self.owner):
                delattr(self.owner, self.key)
        elif self.is_item:
            self.owner[self.key] = value
        else:
            setattr(self.owner, self.key, value)


def apply_atomically(module: ModuleType, patch: Patch, values: Mapping[str, Any], exact: bool = True):
    """Write every value or none; return ``[(slot, original), ...]`` for revert.

    ``exact=False`` (an :class:`Adapted` build) accepts a non-empty subset of ``replaces``.
    """
    keys, declared = set(values), set(patch.replaces)
    if (keys != declared) if exact else (not keys or not keys <= declared):
        raise TypeError(
            "%s: build() returned %s but the patch declares %s%s"
            % (patch.name, sorted(values), sorted(patch.replaces), "" if exact else " (a subset is allowed)")
        )
    slots = [Slot(module, path) for path in patch.replaces if path in keys]
    done = []
    try:
        for slot in slots:
            original = slot.read_own()
            slot.write(values[slot.path])
            done.append((slot, original))
    except BaseException:
        revert(done)
        raise
    return done


def revert(done) -> None:
    for slot, original in reversed(done):
        slot.write(original)
