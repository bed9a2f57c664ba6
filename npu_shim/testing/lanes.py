"""Which lanes a patch's tests belong in, derived from its declaration and the pin files.

A test module marks itself ``pytest.mark.lanes(*lanes_admitting(PATCH, root))`` (``root``:
the checkout holding ``lanes/``; the installed package has none) instead of
keeping a lane list by hand: a lane is in when every distribution the patch requires is
pinned there inside the patch's window and some family's fence admits that pin. Lanes
whose ``# Tests of:`` header names another lane run that lane's tests and are left out.
"""
import os

from npu_shim.engine.guards import within

__all__ = ["lane_pins", "lanes_admitting"]


def lane_pins(root):
    """``{lane: {dist: version}}`` of every lane under ``root/lanes`` that runs its own tests (``==`` pins and
    ``# Sdist:`` entries)."""
    from npu_shim.reference import lane_files, lane_header, pins

    out = {}
    for path in lane_files(root):
        name = os.path.basename(path)[:-len(".txt")]
        if lane_header(path, "Tests of") not in ("", name):
            continue
        pinned = pins(path)
        for line in open(path):
            if not line.startswith("#"):
                break
            if line.startswith("# Sdist:") and "==" in line:
                dist, version = line.split(":", 1)[1].strip().split("==", 1)
                pinned[dist.strip().lower()] = version.strip()
        out[name] = pinned
    return out


def lanes_admitting(patch, root):
    """Sorted lanes whose pins the patch's window and at least one family's fence admit."""
    found = []
    for lane, pinned in lane_pins(root).items():
        if any(pinned.get(dist) is None or not within(spec, pinned[dist]) for dist, spec in patch.requires.items()):
            continue
        if any(not family.fence or (pinned.get(patch.family_dist(family)) is not None
                                    and within(family.fence, pinned[patch.family_dist(family)]))
               for family in patch.families):
            found.append(lane)
    return sorted(found)
