"""Where a patch writes: attribute paths resolved to slots, written all or none, reverted."""
from __future__ import annotations

from types import ModuleType
from typing import Any, Mapping

from npu_shim.patch import Patch, TargetMismatch, parse_path

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


def apply_atomically(module: ModuleType, patch: Patch, values: Mapping[str, Any]):
    """Write every value or none; return ``[(slot, original), ...]`` for revert.

    ``values`` (what a family's build returned, keyed by paths relative to the target
    module) must be a non-empty subset of the patch's ``replaces``: each family
    replaces what its release needs.
    """
    declared = tuple(patch.replaces) + tuple(patch.may_replace)
    keys = set(values)
    if not keys or not keys <= set(declared):
        raise TypeError("%s: build() returned %s but the patch declares %s (a non-empty subset is allowed)"
                        % (patch.name, sorted(values), sorted(declared)))
    slots = [Slot(module, path) for path in declared if path in keys]
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
