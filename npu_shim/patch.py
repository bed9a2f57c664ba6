"""How a patch is declared.

A patch is data: a stable name, the module whose import triggers it, the
attributes it replaces, the distributions and versions it needs (PEP 440), and
whether it calls an NPU kernel. Its release families
(:class:`Family`, one per shape of the upstream code) complete it: each says
which releases it serves, its version fence, the op call it keeps, and where
its ``check`` and ``build`` live. The engine (:mod:`npu_shim.engine`) picks the
family whose fence and check accept the installed code, records it (``npu-shim
status`` shows it), sets the values its ``build`` returns all or none, and keeps
the originals so that :func:`npu_shim.uninstall` can put back the very same
objects. This module imports nothing heavy: declarations are read when the
engine loads, implementations only once their target is imported.

Attribute paths are dotted names inside the target module (``Class.method``),
optionally ending in a string key of a dict (``TABLE['key']``), for entries a
patch adds to a registry dict.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Any, Callable, Mapping, Optional, Tuple, Union


class NotNeeded(Exception):
    """The target does not need this patch (fixed or rewritten upstream)."""


class TargetMismatch(Exception):
    """The target does not look like the code this patch was written for."""


class PatchError(RuntimeError):
    """Raised in strict mode when a patch fails or its target mismatches."""


_FAMILY_ID = re.compile(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$")


@dataclass(frozen=True)
class Family:
    """One release family of a patch: one shape of upstream code, as data.

    ``id``        the family's stable name: the shape of upstream code it serves
                  (``"fia-tnd"``, ``"host-grid"``), lower case words joined by
                  ``-``. Default: the implementation's attribute in that spelling
                  (``"...families:HOST_GRID"`` -> ``"host-grid"``), so the object
                  that holds the family's code and the family share one name.
                  Reading one more release of the same shape changes the evidence
                  only; the id stays.
    ``implementation``  where ``check`` and ``build`` live, imported only once
                  the target module is: ``"package.module"`` (module-level
                  functions) or ``"package.module:attribute"`` (an object with
                  ``check``/``build`` methods). Both take the subject and a
                  :class:`FamilyContext` (the patch's name, its counters, and the
                  one way to present a replacement), so a family module never
                  names its patch. ``check(subject, context)`` raises
                  :class:`TargetMismatch` (another shape) or :class:`NotNeeded`
                  (fixed upstream) unless the installed code has the shape the
                  family was written for; it looks at structure only, the fence
                  does versions. What it returns (None, or the objects it looked
                  up) the engine hands ``build`` as ``context.found``, on the same
                  context. ``build(subject, context)`` returns ``{attribute
                  path relative to the subject: replacement}``, a non-empty subset
                  of the patch's ``replaces``, each function made by it presented
                  with ``context.present``.
    ``keeps``     the upstream op call the family keeps (shown in the reference).
    ``fence``     PEP 440 range of ``dist`` the family may apply to
                  (pre-releases count as inside); "" = the patch's own window.
    ``dist``      the distribution ``fence`` reads; default: the patch's first
                  ``requires`` entry.
    ``between_releases``  True for a family that serves only builds between releases
                  (told apart by structure alone): it claims no release, so no lane
                  requires it applied (:func:`npu_shim.engine.guards.admitting_families`).
                  Every other family claims the releases its fence admits.

    The fence is the only version fact a family states. The releases it was read in are
    evidence, recorded by a tool in ``npu_shim/releases_read.json``
    (:mod:`npu_shim.evidence`), which the reference shows beside the releases the lanes
    run (derived from their pin files).

    A family with neither an id nor an implementation attribute is named by its module
    (``"pkg.cp_fia"`` -> ``"cp-fia"``), or ``"unnamed"`` for an object; every built-in family
    has an id or an attribute (tests/test_machinery.py).
    """

    implementation: Any      # "module" / "module:attribute", or the object itself
    keeps: str
    fence: str = ""
    dist: str = ""
    id: str = ""
    between_releases: bool = False

    def __post_init__(self):
        if isinstance(self.implementation, (tuple, list)):
            raise TypeError("Family takes no releases any more: the fence is its only version fact, and "
                            "the releases it was read in are recorded in npu_shim/releases_read.json "
                            "(npu-shim evidence --record); drop the first argument %r" % (self.implementation,))
        if self.id and not _FAMILY_ID.match(self.id):
            raise ValueError("Family id %r: give lower-case words joined by '-', starting with a letter "
                             "(the shape of upstream code, e.g. 'fia-tnd'), not a release" % (self.id,))

    @property
    def open_ended(self) -> bool:
        return bool(self.fence) and "<" not in self.fence and "==" not in self.fence

    @property
    def name(self) -> str:
        """The family's id (see the class docstring)."""
        if self.id:
            return self.id
        if isinstance(self.implementation, str):
            module, _, attribute = self.implementation.partition(":")
            return (attribute or module.rpartition(".")[2]).lower().replace("_", "-")
        return "unnamed"

    def load(self):
        """The object holding ``check`` and ``build`` (imports the implementation)."""
        import importlib

        if not isinstance(self.implementation, str):
            return self.implementation
        module_name, _, attribute = self.implementation.partition(":")
        found = importlib.import_module(module_name)
        return getattr(found, attribute) if attribute else found


@dataclass(frozen=True)
class Selftest:
    """A patch's selftest (``npu-shim selftest``), as data: what runs and the reads it must see.

    ``run``         ``"package.module"`` (its ``run(device)``) or ``"package.module:function"``;
                    it runs the patched path and returns its error against the float64
                    reference (under the key naming the measure: ``max_abs_err`` or
                    ``max_rel_err``), ``tolerance``, ``host_syncs`` (the device->host reads
                    :mod:`npu_shim.testing.syncs` counted over the patched call),
                    ``seconds`` and ``detail``.
    ``host_syncs``  the device->host reads that run must count: an int, or ``{case: int}``
                    for a selftest that runs one of several cases and names it (``"case"``
                    in its result). "ok" needs the count equal to this *and* the error
                    within tolerance: a fix that still reads back must not pass on its
                    numbers alone.
    ``arguments``   keyword arguments for ``run``, for a callable that serves several patches
                    (one census tower each, say); with arguments, ``run`` also gets
                    ``patch``, the name of the patch whose selftest it runs.
    """

    run: str
    host_syncs: Union[int, Mapping[str, int]]
    arguments: Mapping[str, Any] = field(default_factory=dict)

    def __post_init__(self):
        counts = self.host_syncs.values() if isinstance(self.host_syncs, Mapping) else [self.host_syncs]
        if not counts or any(type(c) is not int or c < 0 for c in counts):
            raise TypeError("Selftest.host_syncs must be a count (int >= 0) or {case: count}, not %r"
                            % (self.host_syncs,))

    def load(self):
        """The callable ``run`` names (imports it)."""
        import importlib

        module_name, _, attribute = self.run.partition(":")
        return getattr(importlib.import_module(module_name), attribute or "run")

    def expected(self, case=None):
        """The declared reads for ``case`` (None for a plain count); None if undeclared."""
        if isinstance(self.host_syncs, Mapping):
            return self.host_syncs.get(case)
        return self.host_syncs if case is None else None

    def describe(self):
        if isinstance(self.host_syncs, Mapping):
            reads = ", ".join("%d (%s)" % (n, case) for case, n in self.host_syncs.items())
        else:
            reads = "%d" % self.host_syncs
        call = self.run + ("(%s)" % ", ".join("%s=%r" % kv for kv in sorted(self.arguments.items()))
                           if self.arguments else "")
        return "`%s`; device→host reads expected: %s" % (call, reads)


_DEFECT_SHOWS = ("reads", "error", "raises")


@dataclass(frozen=True)
class Defect:
    """The upstream defect a patch fixes, as data: the patch's retirement guard.

    ``what``   the defect in words ("upstream reads cu_seqlens back to the host")
    ``shows``  how upstream's own code shows it when the patch's selftest runs with upstream's
               objects back in the patch's slots (:func:`npu_shim.selftest.run_upstream`):
               ``"reads"``  more device->host reads than the patch declares (measured: upstream's
                            count, whatever it is on that release, against the patch's);
               ``"error"``  an error against the float64 reference over the selftest's tolerance;
               ``"raises"`` an exception, whose ``"TypeName: message"`` contains ``says``
               (upstream's refusal, an op rejecting the call). A tuple of these: any of them
               (a release with a second defect the same patch fixes).
    ``says``   for ``"raises"``: words of upstream's exception (the type's name, a phrase).
    ``fixed_at``  a distribution of the patch's ``requires`` whose window ends at the release where
               upstream fixed the defect (the window's upper bound is that fact; nothing else
               states it): status says "upstream fixed" for a release at or past it. "" while
               upstream has it.
    ``on``     the device class the defect exists on (``"310P"``), emulated while upstream's run
               happens, where the selftest takes the machine's; "" = the machine's.
    ``hidden`` ``{"<patch>:<family>": why}``: where that patch applies with that family, the
               selftest's path does not reach the defect (another patch's shape takes the lengths
               from elsewhere, say); there the guard requires upstream's run clean instead, so a
               declaration the code no longer bears out fails the lane too.
    ``says`` may also be a tuple: upstream shows the defect with any of these words (its message
               differs between releases).

    Every lane runs each applied patch's guard (tests/lanes/test_retirement.py): while the
    defect is there, upstream's run fails the declared way; once upstream fixes it the lane
    fails with "upstream fixed <what> in <release>: close the window (family, fence)".
    """

    what: str
    shows: str
    says: str = ""
    fixed_at: str = ""
    on: str = ""
    hidden: Mapping[str, str] = field(default_factory=dict)

    def __post_init__(self):
        if isinstance(self.says, list):
            object.__setattr__(self, "says", tuple(self.says))
        if not self.ways or any(way not in _DEFECT_SHOWS for way in self.ways):
            raise ValueError("Defect.shows must be one of %s (or a tuple of them), not %r"
                             % (_DEFECT_SHOWS, self.shows))
        if ("raises" in self.ways) != bool(self.says):
            raise ValueError("Defect: give says (words of upstream's exception) exactly when shows is "
                             "'raises', not %r with shows %r" % (self.says, self.shows))
        if self.on not in ("", "310P"):
            raise ValueError("Defect.on: a device class the emulation has (\"310P\"), not %r" % (self.on,))
        if not self.what:
            raise ValueError("Defect.what: name the upstream defect the patch fixes")

    @property
    def ways(self):
        """The ways declared (``shows`` as a tuple)."""
        return tuple(self.shows) if isinstance(self.shows, (tuple, list)) else (self.shows,)

    def shown_by(self, result) -> str:
        """"" when ``result`` (:func:`npu_shim.selftest.run_upstream`'s) shows the defect one of
        the declared ways, else what it showed instead."""
        others = [self._shown_one(way, result) for way in self.ways]
        return "" if "" in others else "; ".join(others)

    def _shown_one(self, way, result) -> str:
        raised = result.get("raised")
        if way == "raises":
            if raised is None:
                return "upstream's code ran without raising (%s)" % result["verdict"]
            text = "%s: %s" % (type(raised).__name__, raised)
            says = self.says if isinstance(self.says, tuple) else (self.says,)
            return "" if any(words in text for words in says) else "upstream raised %s, not %s" % (
                text, " or ".join(repr(words) for words in says))
        if raised is not None:
            return "upstream raised %s: %s" % (type(raised).__name__, raised)
        if way == "reads":
            expected = result["expected_host_syncs"]
            if expected is not None and result["host_syncs"] > expected:
                return ""
            return "upstream made %d device->host reads, the patch %s" % (result["host_syncs"], expected)
        if not result["error"] <= result["tolerance"]:          # NaN shows it too
            return ""
        return "upstream's %s %.3g is within tolerance %.3g" % (result["error_measure"], result["error"],
                                                                result["tolerance"])


class FamilyContext:
    """What the engine hands a family's ``check(subject, context)`` and ``build(subject, context)``.

    ``patch``   the name of the patch the family serves (a family module never states it)
    ``family``  the family's id (:attr:`Family.name`)
    ``module``  the module that holds the family's code (named in replacements' docstrings)
    ``found``   what the family's ``check`` returned (None when it returned nothing): the
                engine hands ``build`` the context ``check`` ran with, so what the check looked
                up and proved (the function whose body it read, say) is what ``build`` replaces,
                without a second look-up

    :meth:`count` bumps the patch's counters (:mod:`npu_shim.engine.counters`), :meth:`note`
    records what the patch decided at run time and why (shown by ``npu-shim status``), and
    :meth:`present` is the one way to mark a replacement.
    """

    __slots__ = ("patch", "family", "module", "found")

    # The attribute that names the patch on a replacement made by :meth:`present`.
    MARK = "__npu_shim_patch__"

    def __init__(self, patch: str, family: str = "", module: str = ""):
        self.patch, self.family, self.module = patch, family, module
        self.found = None

    @classmethod
    def of(cls, patch: "Patch", family: "Family") -> "FamilyContext":
        """The context of ``family`` of ``patch``."""
        implementation = family.implementation
        if isinstance(implementation, str):
            module = implementation.partition(":")[0]
        else:
            module = getattr(implementation, "__module__", None) or type(implementation).__module__
        return cls(patch.name, family.name, module)

    def count(self, event: str, n: int = 1) -> None:
        """Add ``n`` to the patch's counter ``event`` (``calls``, ``upstream_calls``,
        ``host_copies``, ``upstream_host_copies``)."""
        from npu_shim.engine import counters

        counters.count(self.patch, event, n)

    def note(self, key: str, text: str) -> None:
        """Record ``text`` as the patch's run-time decision about ``key`` (the CANN release it
        read, why a shape stays with upstream), shown in status beside its reason."""
        from npu_shim.engine import counters

        counters.note(self.patch, key, text)

    def present(self, replacement, original, what: str = "", wrapped: bool = False):
        """Mark ``replacement`` as this patch's stand-in for ``original`` and return it: upstream's
        name, qualified name and signature, a docstring naming the patch, the family's module and
        ``what`` it does beside upstream's code, ``__wrapped_upstream__`` (where tests and readers
        find upstream's) and :attr:`MARK` (the patch's name). ``wrapped``: also ``__wrapped__``
        (functools' convention, which :mod:`inspect` follows to upstream's source), for the
        replacements that always had it. A replacement whose own parameters cannot take every
        call upstream's signature takes is refused here, :class:`TargetMismatch`
        (:func:`signature_refusal`), which the engine reports as a structural mismatch."""
        import inspect

        replacement.__name__ = original.__name__
        replacement.__qualname__ = original.__qualname__
        replacement.__doc__ = "npu-shim (%s) replacement of %s.%s%s%s." % (
            self.patch, original.__module__, original.__qualname__, ": " + what if what else "",
            "; see " + self.module if self.module else "")
        refused = signature_refusal(replacement, original)
        if refused:
            raise TargetMismatch("%s.%s: %s" % (original.__module__, original.__qualname__, refused))
        replacement.__signature__ = inspect.signature(original)
        replacement.__wrapped_upstream__ = original
        if wrapped:
            replacement.__wrapped__ = original
        setattr(replacement, self.MARK, self.patch)
        return replacement

    def __repr__(self):
        return "FamilyContext(%r, %r, %r)" % (self.patch, self.family, self.module)


def signature_refusal(replacement, original) -> str:
    """Why ``replacement`` cannot take every call ``original``'s signature takes ("" when it can).

    A replacement advertises upstream's signature (``__signature__``); one that hand-types
    upstream's parameters must also accept them, or a release that adds a parameter would pass the
    structural check and raise TypeError at the first call. Read from the replacement's own code:
    each of upstream's positional parameters at its position (or ``*args`` from there on), each
    parameter by name (or ``**kwargs``), a default where upstream has one, and no required
    parameter upstream's callers do not pass."""
    import inspect

    try:
        ours = inspect.signature(replacement, follow_wrapped=False)
        theirs = inspect.signature(original)
    except (TypeError, ValueError):
        return ""
    kinds = inspect.Parameter
    mine = list(ours.parameters.values())
    var_positional = any(p.kind is kinds.VAR_POSITIONAL for p in mine)
    var_keyword = any(p.kind is kinds.VAR_KEYWORD for p in mine)
    positional = [p for p in mine if p.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD)]
    by_name = {p.name: p for p in mine if p.kind in (kinds.POSITIONAL_OR_KEYWORD, kinds.KEYWORD_ONLY)}
    taken = set()
    index = 0
    for parameter in theirs.parameters.values():
        if parameter.kind is kinds.VAR_POSITIONAL:
            if not var_positional:
                return "upstream takes *%s, the replacement no *args" % parameter.name
            continue
        if parameter.kind is kinds.VAR_KEYWORD:
            if not var_keyword:
                return "upstream takes **%s, the replacement no **kwargs" % parameter.name
            continue
        if parameter.kind in (kinds.POSITIONAL_ONLY, kinds.POSITIONAL_OR_KEYWORD):
            at = positional[index] if index < len(positional) else None
            index += 1
            if at is None:
                if not var_positional:
                    return ("upstream's parameter %r (position %d) is not a parameter of the replacement"
                            % (parameter.name, index))
                if parameter.kind is kinds.POSITIONAL_OR_KEYWORD and not var_keyword:
                    return "upstream's parameter %r cannot be passed to the replacement by name" % parameter.name
                continue
            if parameter.kind is kinds.POSITIONAL_OR_KEYWORD and at.name != parameter.name \
                    and at.kind is not kinds.POSITIONAL_ONLY and index > 1:
                return ("the replacement takes %r where upstream takes %r (position %d)"
                        % (at.name, parameter.name, index))
            taken.add(at.name)
            if parameter.default is not kinds.empty and at.default is kinds.empty:
                return "upstream's %r has a default, the replacement's %r none" % (parameter.name, at.name)
            continue
        at = by_name.get(parameter.name)           # keyword-only
        if at is None and not var_keyword:
            return "upstream's keyword %r is not a parameter of the replacement" % parameter.name
        if at is not None:
            taken.add(at.name)
            if parameter.default is not kinds.empty and at.default is kinds.empty:
                return "upstream's %r has a default, the replacement's none" % parameter.name
    required = [p.name for p in mine if p.name not in taken and p.default is kinds.empty
                and p.kind not in (kinds.VAR_POSITIONAL, kinds.VAR_KEYWORD)]
    if required:
        return "the replacement requires %s, which upstream's callers do not pass" % ", ".join(required)
    return ""


class _Inline:
    """The family of a patch declared with ``check``/``build`` directly: the shorthand's
    one-argument callables, the context dropped."""

    def __init__(self, check, build):
        self._check, self._build = check, build

    def check(self, module, context=None):
        if self._check is not None:
            return self._check(module)

    def build(self, module, context=None):
        return self._build(module)


@dataclass(frozen=True)
class Patch:
    name: str
    target: str
    replaces: Tuple[str, ...]
    requires: Mapping[str, str] = field(default_factory=dict)
    # Attributes only some families replace, where the installed code has them (a method a later
    # release added): not required to exist before a family is chosen, as ``replaces`` are; the
    # family that replaces one checks for it.
    may_replace: Tuple[str, ...] = ()
    # Per distribution: what a version outside ``requires`` means, e.g.
    # {"vllm": "0.14+ dispatches MoonViT through MMEncoderAttention"}.
    outside_window: Mapping[str, str] = field(default_factory=dict)
    needs_npu: bool = False
    # The release families, oldest first; the engine applies the first whose fence
    # holds and whose check accepts the installed code.
    families: Tuple[Family, ...] = ()
    # Dotted path inside ``target`` of the object the families check and build on
    # (e.g. the class they patch); "" = the target module itself.
    subject: str = ""
    # Shorthand for a patch of your own with one unnamed family and no fence:
    # ``check(module)`` and ``build(module)`` (the built-in patches declare families).
    check: Optional[Callable[[ModuleType], None]] = None
    build: Optional[Callable[[ModuleType], Mapping[str, Any]]] = None
    summary: str = ""
    # The :class:`Selftest` of ``npu-shim selftest`` (what runs, the reads it expects);
    # None where the patch has none.
    selftest: Optional[Selftest] = None
    # The upstream defect the patch fixes (:class:`Defect`): its retirement guard.
    defect: Optional[Defect] = None

    def __post_init__(self):
        for label, paths in (("replaces", self.replaces), ("may_replace", self.may_replace)):
            if isinstance(paths, str):
                raise TypeError("Patch.%s must be a tuple of attribute paths, not a string" % label)
            for path in paths:
                parse_path(path)
        stray = set(self.outside_window) - set(self.requires)
        if stray:
            raise ValueError("outside_window names %s, which requires does not" % sorted(stray))
        if isinstance(self.families, Family):
            raise TypeError("Patch.families must be a tuple of Family, not one Family")
        if self.check is not None or self.build is not None:
            if self.families:
                raise TypeError("%s: declare families or check/build, not both" % self.name)
            object.__setattr__(self, "families", (Family(_Inline(self.check, self.build), keeps=""),))
        names = [family.name for family in self.families]
        if len(set(names)) != len(names):
            raise ValueError("%s: two families share a name: %s" % (self.name, names))
        if self.selftest is not None and not isinstance(self.selftest, Selftest):
            raise TypeError("%s: selftest must be a Selftest (what runs and the device->host reads it "
                            "expects), not %r" % (self.name, self.selftest))
        if self.defect is not None and not isinstance(self.defect, Defect):
            raise TypeError("%s: defect must be a Defect (the upstream defect and how it shows), not %r"
                            % (self.name, self.defect))
        if self.defect is not None and self.defect.fixed_at and self.defect.fixed_at not in self.requires:
            raise ValueError("%s: Defect.fixed_at names %r, which requires does not"
                             % (self.name, self.defect.fixed_at))
        if any(family.fence and not family.dist for family in self.families) and not self.requires:
            raise ValueError("%s: a fenced family without dist needs the patch to require a distribution"
                             % self.name)
        for dist, spec in self.requires.items():
            fenced = [f for f in self.families if f.fence and self.family_dist(f) == dist]
            if spec and self.families and len(fenced) == len(self.families):
                raise ValueError("%s: requires %s %r states a bound, but every family's fence reads %s: the "
                                 "window on it is the fences' (Patch.window); give requires {%r: \"\"} (the "
                                 "distribution present) and let each fence say where its family stops"
                                 % (self.name, dist, spec, dist, dist))

    @property
    def window(self) -> dict:
        """``{dist: (spec, ...)}``: the releases of each distribution of ``requires`` the patch may
        apply to, any one of the specs admitting (PEP 440 ranges, "" = any). Derived: where every
        family is fenced on ``dist``, the window on it is its families' fences (adjacent ones
        joined: ``>=a,<b`` and ``>=b`` make ``>=a``), so ``requires`` states no bound a fence
        states, only the distribution being present and any bound on a distribution no fence
        reads; otherwise (a family with no fence: the patch's own window) ``requires`` alone."""
        out = {}
        for dist, spec in self.requires.items():
            fences = [family.fence for family in self.families
                      if family.fence and self.family_dist(family) == dist]
            if self.families and len(fences) == len(self.families):
                out[dist] = tuple(",".join(part for part in (spec, fence) if part) for fence in join_fences(fences))
            else:
                out[dist] = (spec,)
        return out

    def window_text(self, dist: str) -> str:
        """The window on ``dist`` as the reference and the guard's reason show it."""
        return " or ".join(spec or "any release" for spec in self.window.get(dist, ("",)))

    @property
    def named_families(self) -> bool:
        """False for the check/build shorthand (one unnamed family)."""
        return not any(isinstance(f.implementation, _Inline) for f in self.families)

    @property
    def implemented(self) -> bool:
        if not self.named_families:
            return self.build is not None
        return bool(self.families)

    def family_dist(self, family: Family) -> str:
        return family.dist or next(iter(self.requires))

    def relative_path(self, path: str) -> str:
        """``path`` (relative to the subject) as a path relative to the target module."""
        return "%s.%s" % (self.subject, path) if self.subject else path


_LOWER = re.compile(r"^>=\s*(\S+)$")
_UPPER = re.compile(r"^<\s*(\S+)$")


def join_fences(fences) -> list:
    """``fences`` with adjacent ranges joined, in order: ``[">=a,<b", ">=b,<c"]`` -> ``[">=a,<c"]``.
    A fence of any other form (``!=``, ``~=``, more clauses) stays as it is."""
    out = []
    for fence in fences:
        parts = [part.strip() for part in fence.split(",") if part.strip()]
        if out and parts and _LOWER.match(parts[0]) and all(_UPPER.match(p) for p in parts[1:]) and len(parts) <= 2:
            last = [part.strip() for part in out[-1].split(",")]
            if len(last) == 2 and _LOWER.match(last[0]) and _UPPER.match(last[1]) \
                    and _UPPER.match(last[1]).group(1) == _LOWER.match(parts[0]).group(1):
                out[-1] = ",".join([last[0]] + parts[1:])
                continue
        out.append(fence)
    return out


_PATH = re.compile(r"^(?P<attrs>[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*)(?:\[(?P<q>['\"])(?P<key>[^'\"]+)(?P=q)\])?$")


def parse_path(path: str) -> Tuple[Tuple[str, ...], Optional[str]]:
    """Split ``"A.b['k']"`` into ``(("A", "b"), "k")``."""
    match = _PATH.match(path)
    if not match:
        raise ValueError("bad attribute path %r: use dotted names, optionally ending in ['key']" % path)
    return tuple(match.group("attrs").split(".")), match.group("key")
