"""Apply / skip / fail / strict / revert on a small module made by the test.

Each case runs in a fresh interpreter: the toy target and its distribution
metadata (``toy-target 1.2``, a real dist-info that importlib.metadata reads)
live in a temporary directory; the patch is registered through the Python API.
"""
import json
import re
import textwrap

import pytest

from npu_shim.patch import Family
from npu_shim.patches import BUILTIN_PATCHES


TOY = '''
def greet():
    return "upstream"

class Widget:
    def size(self):
        return 1

TABLE = {"sdpa": "sdpa-fn"}

class _Locked:
    x = 1
    def __setattr__(self, name, value):
        raise AttributeError("locked")

LOCKED = _Locked()
'''

SLOW = '''
import time
time.sleep(0.3)
def greet():
    return "upstream"
'''


@pytest.fixture
def toy(tmp_path):
    (tmp_path / "toy_target.py").write_text(TOY)
    (tmp_path / "toy_slow.py").write_text(SLOW)
    info = tmp_path / "toy_target-1.2.dist-info"
    info.mkdir()
    (info / "METADATA").write_text("Metadata-Version: 2.1\nName: toy-target\nVersion: 1.2\n")
    return tmp_path


def script(toy_dir, body, *, replaces=("greet", "Widget.size", "TABLE['ascend_fa']"),
           requires='{"toy-target": ">=1.0,<2"}', build="build", check="None", needs_npu=False,
           target="toy_target", register_first=True):
    register = textwrap.dedent(f'''
        npu_shim.register(Patch(name="toy.patch", target={target!r}, replaces={tuple(replaces)!r},
                                requires={requires}, build={build}, check={check}, needs_npu={needs_npu}))
    ''')
    return textwrap.dedent(f'''
        import json, sys
        sys.path.insert(0, {str(toy_dir)!r})
        import npu_shim
        from npu_shim.patch import Patch, NotNeeded, TargetMismatch
        BUILDS = []
        def build(module):
            BUILDS.append(module.__name__)
            return {{"greet": lambda: "patched", "Widget.size": lambda self: 2, "TABLE['ascend_fa']": "fa",
                     "LOCKED.x": 5}}
        def build_subset(module):
            values = build(module)
            return {{k: values[k] for k in {tuple(replaces)!r}}}
        def broken(module):
            raise RuntimeError("kaboom")
        def misshapen(module):
            raise TargetMismatch("greet takes a parameter the replacement does not")
        def fixed_upstream(module):
            raise NotNeeded("fixed upstream")
        def row():
            return next(r for r in npu_shim.status() if r["name"] == "toy.patch")
    ''') + (register if register_first else "") + textwrap.dedent(body)


def test_applies_when_target_imports_and_reports_versions(toy, run_python):
    out = run_python(script(toy, '''
        assert "wrapt" not in sys.modules, "machinery loaded before a watched import"
        assert row()["state"] == "pending", row()
        import toy_target
        assert "wrapt" in sys.modules
        assert toy_target.greet() == "patched"
        assert toy_target.Widget().size() == 2
        assert toy_target.TABLE == {"sdpa": "sdpa-fn", "ascend_fa": "fa"}
        print(json.dumps(row()))
    ''', build="build_subset"))
    r = json.loads(out.stdout)
    assert r["state"] == "applied" and r["versions"] == {"toy-target": "1.2"}
    assert r["requires"] == {"toy-target": ">=1.0,<2"}


def test_uninstall_restores_identical_objects_and_reinstall_reapplies(toy, run_python):
    run_python(script(toy, '''
        import toy_target
        greet, size = toy_target.greet, toy_target.Widget.__dict__["size"]
        npu_shim.register(Patch(name="toy.patch", target="toy_target",
                                replaces=("greet", "Widget.size", "TABLE['ascend_fa']"),
                                requires={"toy-target": ">=1"}, build=build_subset))
        assert toy_target.greet() == "patched" and row()["state"] == "applied"
        npu_shim.uninstall()
        assert toy_target.greet is greet
        assert toy_target.Widget.__dict__["size"] is size
        assert "ascend_fa" not in toy_target.TABLE
        assert row()["state"] == "disabled" and "uninstalled" in row()["reason"]
        npu_shim.install()
        assert toy_target.greet() == "patched" and row()["state"] == "applied"
        assert BUILDS == ["toy_target", "toy_target"]
    ''', register_first=False))


def test_two_patches_on_one_attribute_stack_and_uninstall_puts_back_upstreams(toy, run_python):
    """The second patch wraps what the first left (registration order); uninstall reverts newest
    first, so upstream's object is back whatever the order of registration was. Caught once with
    disarm reverting oldest first: greet was left as the first patch's replacement."""
    run_python(script(toy, '''
        import toy_target
        greet = toy_target.greet
        def outer(module):
            inner = module.greet
            return {"greet": lambda: "outer(" + inner() + ")"}
        npu_shim.register(Patch(name="toy.first", target="toy_target", replaces=("greet",),
                                requires={"toy-target": ">=1"}, build=lambda m: {"greet": lambda: "first"}))
        npu_shim.register(Patch(name="toy.second", target="toy_target", replaces=("greet",),
                                requires={"toy-target": ">=1"}, build=outer))
        assert toy_target.greet() == "outer(first)"
        npu_shim.uninstall()
        assert toy_target.greet is greet, toy_target.greet()
    ''', register_first=False))


def test_a_patch_notes_its_run_time_decisions_in_status(toy, run_python):
    """FamilyContext.note: one line per key (the last kept), in status()'s "notes" and the CLI's reason
    column; caught once with the notes left out of the status row."""
    out = run_python(script(toy, '''
        from npu_shim.patch import FamilyContext
        from npu_shim.cli import _status_table
        import toy_target
        context = FamilyContext("toy.patch")
        context.note("cann", "CANN 1.0 read")
        context.note("page", "page 8 stays upstream")
        context.note("cann", "CANN 8.5.0 read")
        assert row()["notes"] == ["CANN 8.5.0 read", "page 8 stays upstream"], row()["notes"]
        print(_status_table([row()]))
    '''))
    assert "; CANN 8.5.0 read; page 8 stays upstream" in out.stdout, out.stdout


@pytest.mark.parametrize(
    "requires, reason",
    [
        ('{"toy-target": ">=2"}', "toy-target 1.2 is outside >=2"),
        ('{"no-such-dist": ">=1"}', "not installed: no-such-dist"),
    ],
)
def test_version_guard_skips_and_leaves_target_untouched(toy, run_python, requires, reason):
    out = run_python(script(toy, '''
        import toy_target
        assert toy_target.greet() == "upstream" and BUILDS == []
        print(json.dumps(row()))
    ''', requires=requires, build="build_subset"))
    r = json.loads(out.stdout)
    assert (r["state"], r["reason"]) == ("skipped", reason)


def test_structural_mismatch_skips_with_the_symbol_and_strict_raises(toy, run_python, make_env):
    body = '''
        import toy_target
        assert toy_target.greet() == "upstream"
        print(json.dumps(row()))
    '''
    code = script(toy, body, replaces=("greet", "Widget.missing"), build="build")
    r = json.loads(run_python(code).stdout)
    assert r["state"] == "skipped"
    assert r["reason"] == "structural check: toy_target.Widget.missing not found"

    strict = run_python(code, env=make_env(NPU_SHIM_STRICT="1"), check=False)
    assert strict.returncode != 0
    assert "PatchError" in strict.stderr and "toy.patch" in strict.stderr
    assert "Widget.missing not found" in strict.stderr


def test_not_needed_is_a_quiet_skip_even_in_strict_mode(toy, run_python, make_env):
    out = run_python(script(toy, '''
        import toy_target
        print(json.dumps(row()))
    ''', check="fixed_upstream", build="build_subset"), env=make_env(NPU_SHIM_STRICT="1"))
    r = json.loads(out.stdout)
    assert (r["state"], r["reason"]) == ("skipped", "fixed upstream")


def test_failing_build_warns_once_and_leaves_module_importable(toy, run_python, make_env):
    code = script(toy, '''
        import toy_target
        assert toy_target.greet() == "upstream" and "ascend_fa" not in toy_target.TABLE
        print(json.dumps(row()))
    ''', build="broken")
    out = run_python(code)
    r = json.loads(out.stdout)
    assert r["state"] == "failed" and r["reason"] == "RuntimeError: kaboom"
    warnings = [line for line in out.stderr.splitlines() if "toy.patch" in line]
    assert len(warnings) == 1 and "kaboom" in warnings[0] and "left unpatched" in warnings[0]

    strict = run_python(code, env=make_env(NPU_SHIM_STRICT="yes"), check=False)
    assert strict.returncode != 0
    assert "PatchError: patch 'toy.patch' on toy_target: RuntimeError: kaboom" in strict.stderr


def test_a_build_that_finds_another_shape_skips_as_a_structural_mismatch(toy, run_python):
    """TargetMismatch from build (a replacement that cannot take upstream's calls, found when it
    is presented) is "not the shape", as from the check: skipped, upstream untouched, not failed."""
    r = json.loads(run_python(script(toy, '''
        import toy_target
        assert toy_target.greet() == "upstream"
        print(json.dumps(row()))
    ''', build="misshapen")).stdout)
    assert (r["state"], r["reason"]) == ("skipped", "structural check: greet takes a parameter the replacement "
                                                    "does not")


def test_an_attribute_only_some_releases_have_is_declared_may_replace(toy, run_python):
    """``may_replace``: a method a later release added, which only the family for that release
    replaces. Missing in the installed code, the patch still applies (its other paths); declared
    ``replaces`` instead, the patch would be skipped as "not found" (the control)."""
    body = '''
        def build_some(module):
            return {"greet": lambda: "patched"}
        for name, kind in (("toy.may", "may_replace"), ("toy.must", "replaces")):
            paths = {"replaces": ("greet",), "may_replace": ()}
            paths[kind] += ("Widget.added_later",)
            npu_shim.register(Patch(name=name, target="toy_target", requires={"toy-target": ">=1.0"},
                                    build=build_some, **paths))
        import toy_target
        rows = {r["name"]: r for r in npu_shim.status()}
        print(json.dumps([rows["toy.may"]["state"], rows["toy.may"]["replaces"], rows["toy.must"]["state"],
                          rows["toy.must"]["reason"], toy_target.greet()]))
    '''
    may_state, may_paths, must_state, must_reason, greeted = json.loads(
        run_python(script(toy, body, register_first=False)).stdout)
    assert (may_state, may_paths, greeted) == ("applied", ["greet", "Widget.added_later"], "patched")
    assert (must_state, must_reason) == ("skipped", "structural check: toy_target.Widget.added_later not found")


def test_apply_is_atomic(toy, run_python):
    out = run_python(script(toy, '''
        import toy_target
        greet = toy_target.greet
        assert toy_target.greet() == "upstream", "first write was not rolled back"
        assert toy_target.LOCKED.x == 1
        print(json.dumps(row()))
    ''', replaces=("greet", "LOCKED.x"), build="build_subset"))
    r = json.loads(out.stdout)
    assert r["state"] == "failed" and "locked" in r["reason"]


@pytest.mark.parametrize(
    "env, reason",
    [
        ({"NPU_SHIM_DISABLE": "toy.patch"}, "listed in NPU_SHIM_DISABLE"),
        ({"NPU_SHIM_ENABLE": "vllm.moonvit_attn"}, "not listed in NPU_SHIM_ENABLE"),
    ],
)
def test_environment_switches_disable(toy, run_python, env, reason, make_env):
    out = run_python(script(toy, '''
        import toy_target
        assert toy_target.greet() == "upstream" and BUILDS == []
        print(json.dumps(row()))
    ''', build="build_subset"), env=make_env(**env))
    r = json.loads(out.stdout)
    assert (r["state"], r["reason"]) == ("disabled", reason)


def test_npu_shim_0_turns_everything_off(toy, run_python, make_env):
    out = run_python(script(toy, '''
        import toy_target
        assert toy_target.greet() == "upstream" and BUILDS == []
        print(json.dumps(npu_shim.status()))
    ''', build="build_subset"), env=make_env(NPU_SHIM="0"))
    rows = json.loads(out.stdout)
    assert {r["state"] for r in rows} == {"disabled"} and {r["reason"] for r in rows} == {"NPU_SHIM=0"}
    assert {name for name, _ in BUILTIN_PATCHES} | {"toy.patch"} == {r["name"] for r in rows}


def test_unknown_patch_name_warns_with_valid_names_and_strict_raises(toy, run_python, make_env):
    code = script(toy, '''
        import toy_target
        print(row()["state"])
    ''', build="build_subset")
    out = run_python(code, env=make_env(NPU_SHIM_DISABLE="vllm.moonvit"))
    assert out.stdout.strip() == "applied"
    assert "NPU_SHIM_DISABLE names unknown patch 'vllm.moonvit'" in out.stderr
    valid = ", ".join(sorted([name for name, _ in BUILTIN_PATCHES] + ["toy.patch"]))
    assert "valid names: %s" % valid in out.stderr

    strict = run_python(code, env=make_env(NPU_SHIM_DISABLE="vllm.moonvit", NPU_SHIM_STRICT="1"), check=False)
    assert strict.returncode != 0 and "ConfigError" in strict.stderr and "vllm.moonvit" in strict.stderr


def test_needs_npu_without_torch_npu_skips(toy, run_python):
    out = run_python(script(toy, '''
        import toy_target
        assert toy_target.greet() == "upstream"
        print(json.dumps(row()))
    ''', build="build_subset", needs_npu=True))
    r = json.loads(out.stdout)
    assert r["state"] == "skipped" and r["reason"].startswith("no NPU: torch_npu is not importable")


def test_target_imported_from_two_threads_is_patched_exactly_once(toy, run_python):
    run_python(script(toy, '''
        import threading
        results = []
        def worker():
            import toy_slow
            results.append(toy_slow.greet())
        threads = [threading.Thread(target=worker) for _ in range(4)]
        for t in threads: t.start()
        for t in threads: t.join()
        assert results == ["patched"] * 4, results
        assert BUILDS == ["toy_slow"], BUILDS
        assert row()["state"] == "applied"
    ''', target="toy_slow", replaces=("greet",), requires="{}", build="build_subset"))


def test_info_line_per_applied_patch_on_stderr_never_stdout(toy, run_python, make_env):
    out = run_python(script(toy, '''
        import toy_target
    ''', build="build_subset"), env=make_env(NPU_SHIM_LOG_LEVEL="INFO"))
    assert out.stdout == ""
    applied = [line for line in out.stderr.splitlines() if "applied toy.patch" in line]
    assert len(applied) == 1 and applied[0].startswith("npu_shim INFO")


def test_bad_attribute_path_is_rejected_at_declaration():
    from npu_shim.patch import Patch

    with pytest.raises(ValueError, match="bad attribute path 'a..b'"):
        Patch(name="x", target="m", replaces=("a..b",))
    with pytest.raises(TypeError, match="tuple of attribute paths"):
        Patch(name="x", target="m", replaces="greet")


def test_version_guard_reason_carries_the_patch_note():
    from npu_shim.engine import guards
    from npu_shim.patch import Patch

    patch = Patch(name="x", target="m", replaces=("f",), requires={"vllm": ">=0.8.5,<0.14"},
                  outside_window={"vllm": "0.14+ uses MMEncoderAttention"})
    assert guards.guard_failure(patch, {"vllm": "0.15.0"}) == (
        "vllm 0.15.0 is outside >=0.8.5,<0.14 (0.14+ uses MMEncoderAttention)")
    assert guards.guard_failure(patch, {"vllm": "0.13.0"}) is None
    with pytest.raises(ValueError, match="outside_window names \\['torch'\\]"):
        Patch(name="x", target="m", replaces=("f",), outside_window={"torch": "no"})


def test_admitting_families_are_the_fences_that_hold_inside_the_window():
    """The status row's ``admitted`` (what the lanes require to be applied and tested) follows
    the fences and the patch's window, by versions alone."""
    from npu_shim.engine import guards
    from npu_shim.patch import Family, Patch

    patch = Patch(name="demo.p", target="demo", replaces=("f",), requires={"demo": ">=1.0,<3"},
                  families=(Family("x", keeps="", fence="<1.5", id="old"),
                            Family("x", keeps="", fence=">=1.5", id="new"),
                            Family("x", keeps="", fence=">=1.2,<2", id="middle"),
                            Family("x", keeps="", id="between", between_releases=True)))   # by structure alone
    assert guards.admitting_families(patch, {"demo": "1.0"}) == ["old"]
    assert guards.admitting_families(patch, {"demo": "1.3"}) == ["old", "middle"]
    assert guards.admitting_families(patch, {"demo": "2.0rc1"}) == ["new"]
    assert guards.admitting_families(patch, {"demo": "3.0"}) == []        # outside the window
    assert guards.admitting_families(patch, {"demo": None}) == []         # not installed


def test_every_builtin_family_has_a_stable_id_that_names_a_shape():
    """A family's id names the shape of upstream code, not the releases read (those are evidence,
    npu_shim/releases_read.json). Where the family's code is an object of a module
    (``module:ATTRIBUTE``), the id is that object's name, so each family has one name; a family
    whose code is a whole module declares its id."""
    from npu_shim import reference

    for patch, _ in reference.patches():
        for family in patch.families:
            assert re.match(r"^[a-z][a-z0-9]*(-[a-z0-9]+)*$", family.name), (patch.name, family.name)
            if isinstance(family.implementation, str) and ":" in family.implementation:
                attribute = family.implementation.rpartition(":")[2]
                assert family.name == attribute.lower().replace("_", "-"), (patch.name, family.name, attribute)
            else:
                assert family.id, (patch.name, family.name)


def test_a_family_id_that_is_a_release_is_refused():
    with pytest.raises(ValueError, match="lower-case words joined by '-'"):
        Family("x", keeps="", id="0.1.0+")
    assert Family("pkg.cp_fia", keeps="").name == "cp-fia"      # no id, no attribute: its module
    assert Family(object(), keeps="").name == "unnamed"


def test_a_family_given_releases_says_they_moved():
    """The old declaration (releases first) fails with where the releases went."""
    with pytest.raises(TypeError, match="npu_shim/releases_read.json"):
        Family(("0.1.0",), "pkg.mod:HOST_GRID")
    assert Family("pkg.mod:HOST_GRID", keeps="").name == "host-grid"
    assert Family("pkg.mod:HOST_GRID", keeps="", id="other-shape").name == "other-shape"
