"""guards.select_family on development and local builds: the fences are not read, the
structure decides, and exactly one family may accept (synthetic families, no upstream)."""
import types

import pytest

from npu_shim.engine import guards
from npu_shim.patch import Family, Patch, TargetMismatch


class Check:
    def __init__(self, accepts):
        self.accepts = accepts

    def check(self, subject, context):
        if not self.accepts(subject):
            raise TargetMismatch("another shape")

    def build(self, subject, context):
        return {}


OLD = Check(lambda s: s.shape == "old")
NEW = Check(lambda s: s.shape == "new")
ANY = Check(lambda s: True)


def patch(*families):
    return Patch(name="x.y", target="x", replaces=("f",), requires={"dist": ""}, families=families)


FAMILIES = (Family(OLD, keeps="", fence=">=1.0,<2.0", id="old-shape"), Family(NEW, keeps="", fence=">=2.0", id="new-shape"))


def target(shape):
    return types.SimpleNamespace(__name__="x", shape=shape, f=None)


@pytest.mark.parametrize("version", ["1.5.dev3", "1.5+g1a2b3c4", "1.5.dev3+g1a2b3c4"])
def test_a_development_or_local_build_gets_the_family_its_code_has(version):
    family, _, _ = guards.select_family(patch(*FAMILIES), target("new"), {"dist": version})
    assert family.name == "new-shape"
    assert guards.structure_note(patch(*FAMILIES), family, {"dist": version}).startswith(
        "family chosen by structure: dist %s is a " % version)


def test_two_families_accepting_is_no_choice():
    with pytest.raises(TargetMismatch, match="all accept"):
        guards.select_family(patch(FAMILIES[0], Family(ANY, keeps="", fence=">=2.0", id="any-shape")),
                             target("old"), {"dist": "1.5.dev3"})


def test_no_family_accepting_gives_every_reason():
    with pytest.raises(TargetMismatch, match=r"by structure \(dist 1.5.dev3 is a development build\).*old-shape.*new-shape"):
        guards.select_family(patch(*FAMILIES), target("other"), {"dist": "1.5.dev3"})


def test_releases_and_the_switch_keep_the_fences():
    with pytest.raises(TargetMismatch, match="outside"):
        guards.select_family(patch(*FAMILIES), target("new"), {"dist": "1.5"})
    with pytest.raises(TargetMismatch, match="outside"):
        guards.select_family(patch(*FAMILIES), target("new"), {"dist": "1.5.dev3"}, by_structure=False)
    family, _, _ = guards.select_family(patch(*FAMILIES), target("new"), {"dist": "2.1"})
    assert guards.structure_note(patch(*FAMILIES), family, {"dist": "2.1"}) == ""
