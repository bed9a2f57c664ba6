"""Version guards and the choice of a patch's release family.

Pure decisions over installed distribution versions and the declared data of a
:class:`~npu_shim.patch.Patch`; nothing here writes to a target.
"""
from __future__ import annotations

import importlib.metadata
import importlib.util

from packaging.specifiers import InvalidSpecifier, SpecifierSet
from packaging.version import InvalidVersion, Version

from npu_shim.patch import Family, NotNeeded, Patch, TargetMismatch


def installed_version(dist: str):
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def dists_of(patch: Patch) -> list:
    """The distributions the patch's guard and its families' fences read."""
    return list(patch.requires) + [f.dist for f in patch.families if f.dist and f.dist not in patch.requires]


def versions_of(patch: Patch) -> dict:
    return {dist: installed_version(dist) for dist in dists_of(patch)}


def within(spec: str, version: str) -> bool:
    """``version`` inside the PEP 440 range ``spec`` (pre-releases count as inside)."""
    return SpecifierSet(spec).contains(Version(version), prereleases=True)


def guard_failure(patch: Patch, versions: dict):
    """Why the installed versions rule the patch out, or None."""
    for dist, spec in patch.requires.items():
        version = versions[dist]
        if version is None:
            return "not installed: %s" % dist
        try:
            ok = within(spec, version)
        except (InvalidSpecifier, InvalidVersion) as exc:
            return "cannot compare %s %s with %r: %s" % (dist, version, spec, exc)
        if not ok:
            note = patch.outside_window.get(dist)
            return "%s %s is outside %s%s" % (dist, version, spec, " (%s)" % note if note else "")
    return None


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
    require each such patch to be applied and exercised (lanes/report.py). A family that names
    no release (builds between releases, told apart by structure alone) claims none."""
    if not patch.named_families or guard_failure(patch, versions):
        return []
    admitted = []
    for family in patch.families:
        if not family.releases:
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


def select_family(patch: Patch, module, versions: dict = None):
    """``(family, implementation, subject)`` for the installed code, or raise with every
    family's reason: :class:`NotNeeded` when every family in its fence says "fixed
    upstream", else :class:`TargetMismatch`.

    ``versions``: ``{dist: version}``; default: the installed distributions.
    """
    versions = dict(versions or {})
    subject = subject_of(patch, module)
    reasons, fixed = [], None
    for family in patch.families:
        dist = patch.family_dist(family) if family.fence else None
        if dist is not None:
            if dist not in versions:
                versions[dist] = installed_version(dist)
            version = versions[dist]
            if version is None:
                reasons.append("%s: %s not installed" % (family.name, dist))
                continue
            if not within(family.fence, version):
                reasons.append("%s: %s %s outside %s" % (family.name, dist, version, family.fence))
                continue
        implementation = family.load()
        try:
            implementation.check(subject)
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
        return family, implementation, subject
    if fixed and not reasons:
        raise NotNeeded(fixed)
    what = getattr(subject, "__qualname__", None) or getattr(subject, "__name__", "the target")
    raise TargetMismatch("no family accepts %s: %s" % (what, "; ".join(([fixed] if fixed else []) + reasons)))


def build_values(patch: Patch, family: Family, implementation, subject) -> dict:
    """What the family's build returns, keyed by paths relative to the target module."""
    values = implementation.build(subject)
    return {patch.relative_path(path): value for path, value in values.items()}
