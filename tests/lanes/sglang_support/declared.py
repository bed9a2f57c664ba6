"""Which family a patch's declaration claims for a release, read from the declarations, so the
tests name no family (the lanes come from ``pytest.mark.claimed``, tests/conftest.py)."""
from packaging.specifiers import SpecifierSet
from packaging.version import Version


def _admits(fence, version):
    return Version(version) in SpecifierSet(fence, prereleases=True)


def family_for(patch, version):
    """The family whose fence admits ``version`` of the patch's first required distribution, or None."""
    return next((f for f in patch.families if _admits(f.fence or patch.requires[patch.family_dist(f)], version)),
                None)
