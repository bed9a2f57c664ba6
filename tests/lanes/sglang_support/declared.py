"""Which lanes and which family a patch's declaration claims, read from the declarations and the
lanes' pin files (``# Stands for:``), so the tests name neither families nor lanes."""
import os
import re

from packaging.specifiers import SpecifierSet
from packaging.version import Version

LANES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), "lanes")


def stands_for(dist):
    """{lane: [releases of ``dist`` it stands for]} over the pin files."""
    found = {}
    for name in sorted(os.listdir(LANES_DIR)):
        if not name.endswith(".txt") or name.startswith("_"):
            continue
        with open(os.path.join(LANES_DIR, name)) as f:
            header = next((line for line in f if line.startswith("# Stands for:")), "")
        for part in header.split(":", 1)[-1].split(";"):
            words = part.strip().split(None, 1)
            if len(words) == 2 and words[0] == dist:
                found[name[:-4]] = [v.strip() for v in words[1].split(",")]
    return found


def _admits(fence, version):
    return Version(version) in SpecifierSet(fence, prereleases=True)


def family_for(patch, version):
    """The family whose fence admits ``version`` of the patch's first required distribution, or None."""
    return next((f for f in patch.families if _admits(f.fence or patch.requires[patch.family_dist(f)], version)),
                None)


def claimed_lanes(patch):
    """Lanes standing for a release some family of ``patch`` admits."""
    dist = next(iter(patch.requires))
    return sorted(lane for lane, versions in stands_for(dist).items()
                  if any(family_for(patch, v) for v in versions))


def unclaimed_lanes(patch):
    """Lanes of the patch's distribution standing for no release any family admits."""
    dist = next(iter(patch.requires))
    claimed = set(claimed_lanes(patch))
    return sorted(lane for lane in stands_for(dist) if lane not in claimed)
