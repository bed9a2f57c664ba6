"""Retirement guards: on every lane, upstream's own code still has the defect each applied patch fixes.

Each patch declares, beside its selftest, the upstream defect it fixes and how upstream shows it
(``Patch.defect``, :class:`npu_shim.patch.Defect`): more device->host reads than the patch makes,
an error over tolerance against the float64 reference, or an exception (upstream's refusal, an op
rejecting the call). The guard runs the patch's declared selftest with upstream's own objects put
back in the patch's slots (:func:`npu_shim.selftest.run_upstream`: the release's real code, the
same inputs, the same reference) and requires the defect shown the declared way. The counts are
measured from upstream on the lane, never written per release: a "reads" defect holds while
upstream reads more than the patch declares, whatever upstream's count is there.

When upstream fixes it, the selftest passes on upstream's code and this test fails with
"upstream fixed <defect> in <release>: close the window (family <name>, fence <spec>)", not an
unrelated assertion elsewhere. Each case selects the lanes a family of its patch claims
(``pytest.mark.claimed``), as tests/lanes/test_selftests.py does, but names no patch
(``pytest.mark.patch``): it runs upstream's code, not the patch's, so it is not a test of the
patch for the lane's gate "applied on the release its family claims, but no test marked for it
passed" (mutant g: with the mark, this test stood in for a patch's own tests).

``test_the_guard_fires_when_upstream_ships_the_fix``: the guard fails as it must, on each vLLM
and sglang lane, when upstream's slot holds the fixed code (simulated: the patch's own
replacement put where upstream's object is kept), for the lane's first applied patch. The mutant
"retire" of lanes/mutants.py does the same to PaddleOCR-VL's patch on a whole lane, which then
fails with the guard's message.
"""
import pytest

from npu_shim.patches import BUILTIN_PATCHES

pytestmark = pytest.mark.keeps_process_state


def _declaration(name):
    import importlib

    return importlib.import_module(dict(BUILTIN_PATCHES)[name]).PATCH


def _released(name):
    """A family of the patch serves a release (``sglang.cp_fia``'s serves builds between releases
    only; its selftest runs in the build tests/lanes/test_sglang_cp_fia.py makes)."""
    return any(not family.between_releases for family in _declaration(name).families)


def _case(name):
    return pytest.param(name, id=name, marks=[pytest.mark.claimed(name)])


@pytest.fixture(scope="module")
def rows():
    import npu_shim
    from npu_shim import _startup, emulation
    from npu_shim.testing.towers import targets_importable

    emulation.install()
    npu_shim.install()
    with targets_importable():
        return {row["name"]: row for row in _startup.engine().status(import_targets=True)}


@pytest.mark.parametrize("name", [_case(name) for name, _ in BUILTIN_PATCHES if _released(name)])
def test_upstream_still_has_the_defect(rows, name):
    from npu_shim.selftest import retirement

    assert rows[name]["state"] == "applied", rows[name]
    message, result = retirement(name, "cpu")
    if message:
        pytest.fail(message, pytrace=False)
    defect = _declaration(name).defect
    if result["hidden"]:            # Defect.hidden: upstream's run must be clean here
        assert result["ok"], result
        return
    # what upstream showed, measured here, one of the declared ways (Defect.shown_by checked it)
    raised = result["raised"]
    if raised is not None:
        assert "raises" in defect.ways, result
        says = defect.says if isinstance(defect.says, tuple) else (defect.says,)
        assert any(words in "%s: %s" % (type(raised).__name__, raised) for words in says), result
    else:
        assert ("reads" in defect.ways and result["host_syncs"] > result["expected_host_syncs"]) or \
            ("error" in defect.ways and not result["error"] <= result["tolerance"]), result


# one patch per upstream whose fix is simulated: the first applied on the lane, in registry order
def _fired(rows):
    return [name for name, _ in BUILTIN_PATCHES if _released(name) and rows[name]["state"] == "applied"]


@pytest.mark.claimed("vllm.mm_encoder_attn")                 # every vLLM lane
@pytest.mark.claimed("sglang.qwen2_5_vl_host_lengths")       # every sglang lane
def test_the_guard_fires_when_upstream_ships_the_fix(rows, monkeypatch):
    """Upstream's slot made to hold the fixed code (the patch's own replacement, as if upstream had
    shipped the fix): the guard reports "upstream fixed ... close the window" naming the family
    and its fence; put back, it is quiet again."""
    from npu_shim.engine import registry
    from npu_shim.selftest import retirement

    applied = _fired(rows)
    assert applied, rows
    name = applied[0]
    record = registry._records[name]
    fixed = [(slot, slot.read_own()) for slot, _ in record.undo]
    monkeypatch.setattr(record, "undo", fixed)
    message, _ = retirement(name, "cpu")
    family = rows[name]["family"]
    assert message.startswith("upstream fixed %s in " % _declaration(name).defect.what), message
    assert "close the window (family %s, fence " % family in message, message
    monkeypatch.undo()
    assert retirement(name, "cpu")[0] == ""
