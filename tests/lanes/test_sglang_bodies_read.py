"""The sglang families whose fence is open above prove the shape by the bodies read: the same
upstream method with one argument of its FIA call changed (what a newer release could ship) is
another shape, on the real wheels' code. Defect caught: a check of names and signatures alone,
which accepts the changed method, so a newer release would get a replacement that calls FIA with
the old argument.

Each case copies upstream's method source (the original the engine keeps, where the shim
replaced it) into a file under tmp_path, as a method of a class of the same name, and checks a
namespace holding it: unchanged, the family accepts it (the copy has the same body); changed,
it refuses it.
"""
import importlib
import importlib.util
import inspect
import textwrap
import types

import pytest

from npu_shim.patch import FamilyContext, TargetMismatch
from npu_shim.patches._shared.structure import upstream_of
from npu_shim.patches.sglang import cp_fia_host_lengths, vision_host_lengths


def upstream(function):
    # under every replacement: sglang.vision_head_pad wraps sglang.vision_host_lengths' forward
    return upstream_of(function)


def copied(tmp_path, name, class_name, function, change=None):
    """``class_name`` with ``function``'s source as its method, loaded from a file (so its source
    can be read), ``change`` = (old, new) applied to the source once (it must occur)."""
    source = textwrap.dedent(inspect.getsource(function))
    if change:
        assert source.count(change[0]) == 1, change
        source = source.replace(*change)
    path = tmp_path / (name + ".py")
    path.write_text("from __future__ import annotations\n\n\nclass %s:\n%s" % (class_name, textwrap.indent(source, "    ")))
    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return getattr(module, class_name)


@pytest.mark.claimed("sglang.cp_fia_host_lengths")
@pytest.mark.patch("sglang.cp_fia_host_lengths")
def test_cp_fia_host_lengths_takes_only_a_body_read(tmp_path):
    module = importlib.import_module(cp_fia_host_lengths.TARGET)
    method = upstream(vars(module.AscendAttnBackend)[cp_fia_host_lengths.METHOD])
    context = FamilyContext(cp_fia_host_lengths.PATCH.name)
    same = types.SimpleNamespace(__name__="same", AscendAttnBackend=copied(tmp_path, "same", "AscendAttnBackend", method))
    assert cp_fia_host_lengths.check(same, context)
    changed = types.SimpleNamespace(__name__="changed", AscendAttnBackend=copied(
        tmp_path, "changed", "AscendAttnBackend", method, ("sparse_mode=3", "sparse_mode=4")))
    with pytest.raises(TargetMismatch, match="is not the body the sglang.cp_fia_host_lengths replacement"):
        cp_fia_host_lengths.check(changed, context)


# the lanes of the newest family (its fence): the family this check guards
@pytest.mark.claimed("sglang.vision_host_lengths", pinned={"sglang": vision_host_lengths.PATCH.families[-1].fence})
@pytest.mark.patch("sglang.vision_host_lengths")
def test_vision_host_lengths_newest_family_takes_only_a_forward_read(tmp_path):
    module = importlib.import_module(vision_host_lengths.TARGET)
    forward = upstream(vars(module.VisionAscendAttention)["forward"])
    prepare = upstream(getattr(module, vision_host_lengths.METADATA))
    context = FamilyContext(vision_host_lengths.PATCH.name)
    family = vision_host_lengths.CU_SEQLENS_PADDED

    def target(cls):
        return types.SimpleNamespace(__name__=vision_host_lengths.TARGET, VisionAscendAttention=cls,
                                     VisionAttentionMetadata=module.VisionAttentionMetadata,
                                     **{vision_host_lengths.METADATA: prepare})

    assert family.check(target(copied(tmp_path, "same", "VisionAscendAttention", forward)), context)
    changed = copied(tmp_path, "changed", "VisionAscendAttention", forward, ("sparse_mode=0", "sparse_mode=1"))
    with pytest.raises(TargetMismatch, match="is not the body the sglang.vision_host_lengths replacement"):
        family.check(target(changed), context)
