"""A patch's window is derived: ``requires`` states no bound a fence states.

Where every family of a patch is fenced on a distribution, the releases the patch may apply to
on it are its families' fences (``Patch.window``, adjacent fences joined), and ``requires`` says
only that the distribution is present (and any bound on a distribution no fence reads). A release
outside every fence is skipped by the guard with the window as its reason, as a ``requires`` bound
was: not a structural complaint, so strict mode does not raise for it.
"""
import json
import textwrap

import pytest

from npu_shim.engine import guards
from npu_shim.patch import Family, Patch, join_fences
from npu_shim.patches import BUILTIN_PATCHES

pytestmark = pytest.mark.lanes("base")


def toy(*fences, requires=None, unfenced=False):
    families = tuple(Family("toy.family:F%d" % i, keeps="", fence=fence) for i, fence in enumerate(fences))
    if unfenced:
        families += (Family("toy.family:OPEN", keeps=""),)
    return Patch(name="toy.window", target="toy", replaces=("f",), families=families,
                 requires=requires if requires is not None else {"dist": ""})


def test_adjacent_fences_join_and_others_stay_apart():
    assert join_fences([">=1.0,<1.5", ">=1.5,<2.0", ">=2.0"]) == [">=1.0"]
    assert join_fences([">=1.0,<1.5", ">=1.6"]) == [">=1.0,<1.5", ">=1.6"]
    assert join_fences([">=1.0rc1,<1.1.0rc1", ">=1.1.0rc1"]) == [">=1.0rc1"]
    assert join_fences(["==1.0", ">=2.0"]) == ["==1.0", ">=2.0"]


def test_the_window_is_the_families_fences():
    """Defect caught: the window read from ``requires`` alone (a fenced patch then applies
    everywhere its distribution is installed, or, with ``requires`` repeating the fences, every
    fence bound is stated twice and an opened fence stays closed by ``requires``)."""
    patch = toy(">=1.0,<2.0", ">=2.0,<3.0", ">=5.0")
    assert patch.window == {"dist": (">=1.0,<3.0", ">=5.0")}
    assert patch.window_text("dist") == ">=1.0,<3.0 or >=5.0"
    for version, inside in (("0.9", False), ("1.0", True), ("2.9", True), ("3.0", False), ("4.0rc1", False),
                            ("5.0rc1", False), ("5.0", True), ("7.0", True)):
        assert guards.in_window(patch, "dist", version) is inside, version
        reason = guards.guard_failure(patch, {"dist": version})
        assert (reason is None) is inside, (version, reason)
        if not inside:
            assert reason == "dist %s is outside >=1.0,<3.0 or >=5.0" % version
    assert guards.guard_failure(patch, {"dist": None}) == "not installed: dist"


def test_a_family_with_no_fence_keeps_the_requires_window():
    patch = toy(">=1.0,<2.0", unfenced=True, requires={"dist": ">=1.0,<4"})
    assert patch.window == {"dist": (">=1.0,<4",)}
    assert guards.guard_failure(patch, {"dist": "4.0"}) == "dist 4.0 is outside >=1.0,<4"


def test_a_bound_on_a_distribution_no_fence_reads_stays_in_requires():
    patch = toy(">=1.0", requires={"dist": "", "other": "<2"})
    assert patch.window == {"dist": (">=1.0",), "other": ("<2",)}
    assert guards.guard_failure(patch, {"dist": "9", "other": "2.0"}) == "other 2.0 is outside <2"


def test_requires_repeating_a_fence_bound_is_refused():
    """Defect caught: a ``requires`` bound beside the fences, which closes the window where a
    fence was opened (e.g. vllm-ascend's ``<0.31.0rc1`` kept in ``requires``)."""
    with pytest.raises(ValueError, match=r"toy.window: requires dist '>=1.0,<2' states a bound, but every "
                                         r"family's fence reads dist"):
        toy(">=1.0,<2", requires={"dist": ">=1.0,<2"})


def test_no_built_in_requires_states_a_fence_bound():
    import importlib

    checked = 0
    for name, module in BUILTIN_PATCHES:
        patch = importlib.import_module(module).PATCH
        for dist, spec in patch.requires.items():
            fences = [f.fence for f in patch.families if f.fence and patch.family_dist(f) == dist]
            if len(fences) == len(patch.families):
                assert spec == "", (name, dist, spec)
                assert patch.window[dist] == tuple(join_fences(fences)), name
                checked += 1
    assert checked >= 30, checked


TOY = textwrap.dedent('''
    import json, sys, types
    sys.path.insert(0, {toy!r})
    import npu_shim
    from npu_shim.patch import Family, Patch
    families = tuple(Family(types.SimpleNamespace(check=lambda module, context: None,
                                                  build=lambda module, context: {{"greet": lambda: "patched"}}),
                            keeps="", id="toy-%d" % i, fence=fence, dist="packaging")
                     for i, fence in enumerate({fences!r}))
    npu_shim.register(Patch(name="toy.window", target="toy_window", replaces=("greet",),
                            requires={{"packaging": ""}}, families=families))
    import toy_window
    row = next(r for r in npu_shim.status() if r["name"] == "toy.window")
    print(json.dumps({{"state": row["state"], "reason": row["reason"], "greet": toy_window.greet()}}))
''')


def test_a_release_outside_every_fence_is_skipped_by_the_guard_even_in_strict_mode(tmp_path, run_python, make_env):
    import importlib.metadata

    (tmp_path / "toy_window.py").write_text("def greet():\n    return 'hi'\n")
    version = importlib.metadata.version("packaging")
    code = TOY.format(toy=str(tmp_path), fences=[">=1.0,<1.5", ">=1.5,<2.0"])
    for env in (None, make_env(NPU_SHIM_STRICT="1")):
        row = json.loads(run_python(code, env=env).stdout.splitlines()[-1])
        assert row == {"state": "skipped", "greet": "hi",
                       "reason": "packaging %s is outside >=1.0,<2.0" % version}, row
    row = json.loads(run_python(TOY.format(toy=str(tmp_path), fences=[">=1.0,<1.5", ">=1.5"])).stdout.splitlines()[-1])
    assert (row["state"], row["greet"]) == ("applied", "patched"), row
    assert row["reason"].endswith("applied by structure; packaging %s not read yet (newest read for family toy-1: "
                                  "none)" % version), row
