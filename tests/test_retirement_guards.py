"""Retirement guards as data (:class:`npu_shim.patch.Defect`): the declaration, how a measured run
of upstream's code is judged against it, and status's "upstream fixed".

The guards themselves run on the lanes (tests/lanes/test_retirement.py); this is the machinery,
on the base lane, with made-up patches and releases (the version machinery's own tests).
"""
import pytest

from npu_shim.patch import Defect, Patch


def _run(host_syncs=0, expected=0, error=0.0, tolerance=1e-3, raised=None):
    """A result as npu_shim.selftest.run_upstream returns it."""
    return {"raised": raised, "host_syncs": host_syncs, "expected_host_syncs": expected, "error": error,
            "tolerance": tolerance, "error_measure": "max_abs_err", "verdict": "as measured"}


def test_a_defect_is_declared_whole():
    with pytest.raises(ValueError, match="shows must be one of"):
        Defect("upstream reads cu_seqlens back", shows="slow")
    with pytest.raises(ValueError, match="says"):
        Defect("upstream refuses", shows="raises")
    with pytest.raises(ValueError, match="says"):
        Defect("upstream reads back", shows="reads", says="ValueError")
    with pytest.raises(ValueError, match="name the upstream defect"):
        Defect("", shows="reads")
    with pytest.raises(TypeError, match="defect must be a Defect"):
        Patch(name="x", target="m", replaces=("f",), defect="reads")
    with pytest.raises(ValueError, match="fixed_at names 'torch'"):
        Patch(name="x", target="m", replaces=("f",), requires={"vllm": "<1"},
              defect=Defect("upstream reads back", shows="reads", fixed_at="torch"))


def test_upstream_shows_the_defect_the_declared_way():
    reads = Defect("upstream reads cu_seqlens back", shows="reads")
    assert reads.shown_by(_run(host_syncs=3, expected=0)) == ""
    assert reads.shown_by(_run(host_syncs=2, expected=1)) == ""          # more than the patch makes
    assert "made 1 device->host reads" in reads.shown_by(_run(host_syncs=1, expected=1))
    assert "raised ValueError" in reads.shown_by(_run(raised=ValueError("no")))

    error = Defect("upstream drops the sinks", shows="error")
    assert error.shown_by(_run(error=0.5)) == ""
    assert error.shown_by(_run(error=float("nan"))) == ""
    assert "within tolerance" in error.shown_by(_run(error=1e-4))

    raises = Defect("upstream refuses ascend_fa", shows="raises", says="ValueError: ascend_fa")
    assert raises.shown_by(_run(raised=ValueError("ascend_fa is not supported"))) == ""
    assert "not 'ValueError: ascend_fa'" in raises.shown_by(_run(raised=KeyError("x")))
    assert "without raising" in raises.shown_by(_run())

    # a release with a second defect the patch fixes: either way shows it, neither is named
    both = Defect("upstream reads back, or crashes on two images", shows=("reads", "raises"), says="TND")
    assert both.shown_by(_run(host_syncs=7)) == ""
    assert both.shown_by(_run(raised=ValueError("TND lengths must be non-decreasing"))) == ""
    assert "made 0 device->host reads" in both.shown_by(_run()) and "without raising" in both.shown_by(_run())
    alternatives = Defect("upstream picks a backend the platform cannot run", shows="raises",
                          says=("FlashAttention version not detected", "object has no attribute"))
    assert alternatives.shown_by(_run(raised=AttributeError("'M' object has no attribute 'x'"))) == ""
    assert "not 'FlashAttention version not detected' or" in alternatives.shown_by(_run(raised=KeyError("k")))


def test_status_says_upstream_fixed_where_the_window_ends_at_the_fix():
    from npu_shim.engine import guards, registry

    fixed = Patch(name="x", target="m", replaces=("f",), requires={"vllm": ">=0.8.5,<0.14"},
                  defect=Defect("upstream reads cu_seqlens back", shows="reads", fixed_at="vllm"))
    assert guards.guard_failure(fixed, {"vllm": "0.15.0"}) == (
        "upstream fixed upstream reads cu_seqlens back in vllm 0.14: vllm 0.15.0 is outside >=0.8.5,<0.14")
    assert registry._upstream_fixed(fixed, {"vllm": "0.14.0rc1"}) is None          # before the fix
    assert registry._upstream_fixed(fixed, {"vllm": "0.14.0"}) == "vllm 0.14"
    assert guards.guard_failure(fixed, {"vllm": "0.8.4"}) == "vllm 0.8.4 is outside >=0.8.5,<0.14"
    assert registry._upstream_fixed(fixed, {"vllm": "0.8.4"}) is None
    assert guards.guard_failure(fixed, {"vllm": "0.13.0"}) is None
    # a window that ends for another reason says nothing of a fix
    open_defect = Patch(name="y", target="m", replaces=("f",), requires={"vllm": "<0.14"},
                        defect=Defect("upstream reads cu_seqlens back", shows="reads"))
    assert "upstream fixed" not in guards.guard_failure(open_defect, {"vllm": "0.15.0"})
    assert registry._upstream_fixed(open_defect, {"vllm": "0.15.0"}) is None


def test_every_built_in_patch_declares_its_defect():
    """N of N: each built-in patch's retirement guard is declared beside its selftest."""
    import importlib

    from npu_shim.patches import BUILTIN_PATCHES

    declared = {name: importlib.import_module(module).PATCH for name, module in BUILTIN_PATCHES}
    assert [name for name, patch in declared.items() if not isinstance(patch.defect, Defect)] == []
    assert [name for name, patch in declared.items() if patch.selftest is None] == []
