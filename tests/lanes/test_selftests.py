"""Every patch's declared selftest, on every lane a family of the patch claims.

A selftest is data (``Patch.selftest``, :class:`npu_shim.patch.Selftest`): the callable that
runs the patched path against the float64 reference and the device->host reads it must
count. This one test runs each of them the way ``npu-shim selftest`` does (emulated torch_npu,
the targets imported, the shim applied) and requires the verdict "ok": error within the
tolerance *and* the reads the declaration names. Each case selects the lanes whose pinned
releases a family of its patch claims (``pytest.mark.claimed``), so a patch that gains a
family or a release gains the run with no edit here.

The selftests set up what a serving process has and keep it (sglang's one-rank process group
and server args, vLLM's layer context), which a lane test of a two-rank context-parallel
topology must not find: they run after the lane's other tests (``keeps_process_state``,
tests/conftest.py). The context-parallel selftests state their simulated rank's groups as
absent (``cp_case.simulated_rank``), so a one-rank group built before them does not matter.
"""
import pytest

from npu_shim.patches import BUILTIN_PATCHES

SAYS = {
    "vllm.moonvit_attn": "72",                                   # Kimi-VL's head size, padded to 128
    "transformers.attn_check": "config asking for ascend_fa",
    "sglang.cp_pad_gather": "7 pad rows in all",
    "sglang.small_page_fia": "-> npu_fused_infer_attention_score;",
}


pytestmark = pytest.mark.keeps_process_state


def _case(name):
    return pytest.param(name, id=name, marks=[pytest.mark.claimed(name), pytest.mark.patch(name)])


@pytest.fixture(scope="module")
def rows():
    """Status rows once every target is imported with the emulation and the shim installed
    (the import isolation of the lane gate: vllm-ascend's ops package without its
    ``__init__``, torchvision's placeholder where vLLM needs one)."""
    import npu_shim
    from npu_shim import _startup, emulation
    from npu_shim.testing.towers import targets_importable

    emulation.install()
    npu_shim.install()
    with targets_importable():
        return {row["name"]: row for row in _startup.engine().status(import_targets=True)}


def _released(name):
    """Whether a family of the patch serves a release. ``sglang.cp_fia``'s serves only builds
    between releases (a broken window no release shipped): no lane claims it, and its selftest
    runs in the broken-window build tests/lanes/test_sglang_cp_fia.py makes."""
    import importlib

    return any(not family.between_releases
               for family in importlib.import_module(dict(BUILTIN_PATCHES)[name]).PATCH.families)


@pytest.mark.parametrize("name", [_case(name) for name, _ in BUILTIN_PATCHES if _released(name)])
def test_the_declared_selftest_passes_with_the_declared_reads(rows, name):
    from npu_shim.selftest import run_one
    from npu_shim.testing.claims import declaration

    assert rows[name]["state"] == "applied", rows[name]
    result = run_one(name, "cpu")
    assert result["ok"], result["verdict"]
    assert result["host_syncs"] == declaration(name).selftest.expected(result["case"]), result
    assert SAYS.get(name, "") in result["detail"] and result["detail"], result["detail"]
