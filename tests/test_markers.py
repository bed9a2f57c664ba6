"""tests/conftest.py's markers: ``lanes`` names only lanes nox defines, ``patch`` only
patches ``BUILTIN_PATCHES`` lists, and selected tests' patch names reach the junit xml.

Each case runs pytest in a fresh interpreter on a temporary test file; the
temporary directory's conftest.py takes its hooks from the repository's
tests/conftest.py, so what is checked is that file.
"""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

# the selection's logic is the same on every Python; each variant lane runs it for its own selection
pytestmark = pytest.mark.machinery

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _repo_conftest():
    """tests/conftest.py as a module of its own (test modules are not on sys.path here)."""
    spec = importlib.util.spec_from_file_location("npu_shim_tests_conftest_copy",
                                                  os.path.join(REPO, "tests", "conftest.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


conftest = _repo_conftest()
clean_env = conftest.clean_env

CONFTEST = textwrap.dedent('''
    import importlib.util

    spec = importlib.util.spec_from_file_location("npu_shim_tests_conftest", {path!r})
    real = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(real)
    pytest_configure = real.pytest_configure
    pytest_collection_modifyitems = real.pytest_collection_modifyitems
''')


def run_pytest(tmp_path, test_source, *args, lane=None):
    (tmp_path / "pytest.ini").write_text("[pytest]\n")
    (tmp_path / "conftest.py").write_text(CONFTEST.format(path=os.path.join(REPO, "tests", "conftest.py")))
    (tmp_path / "test_sample.py").write_text(textwrap.dedent(test_source))
    return subprocess.run(
        [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sample.py", *args],
        cwd=str(tmp_path), env=clean_env(NPU_SHIM_LANE=lane), capture_output=True, text=True, timeout=120)


def test_the_lanes_are_the_pin_files_and_base():
    lanes = conftest.defined_lanes()
    assert "base" in lanes and "latest-sglang" in lanes
    assert "latest" not in lanes                          # split into latest-vllm / latest-sglang
    assert not [name for name in lanes if name.startswith("_")]   # _common.txt etc. are includes
    assert all(os.path.exists(os.path.join(REPO, "lanes", name + ".txt")) for name in lanes)


def test_the_patch_names_are_builtin_patches_without_importing_npu_shim():
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('c', %r)\n"
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
            "print(module.builtin_patch_names()); print('npu_shim' in sys.modules)\n"
            % os.path.join(REPO, "tests", "conftest.py"))
    proc = subprocess.run([sys.executable, "-c", code], env=clean_env(), capture_output=True, text=True,
                          timeout=120, check=True)
    names, imported = proc.stdout.splitlines()[-2:]
    assert imported == "False"
    from npu_shim.patches import BUILTIN_PATCHES

    assert eval(names) == conftest.builtin_patch_names() == [name for name, _ in BUILTIN_PATCHES]


def test_an_unknown_lane_fails_collection(tmp_path):
    proc = run_pytest(tmp_path, '''
        import pytest

        pytestmark = pytest.mark.lanes("base", "latest")

        def test_one():
            pass
    ''')
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "test_sample.py::test_one: unknown lane 'latest' in pytest.mark.lanes" in out, out
    assert "1 passed" not in out


def test_an_unknown_lane_fails_collection_in_every_lane(tmp_path):
    """A test of another lane would be deselected, never run: its bad name still fails."""
    proc = run_pytest(tmp_path, '''
        import pytest

        def test_base():
            pass

        @pytest.mark.lanes("vllm-0.99")
        def test_elsewhere():
            pass
    ''')
    assert proc.returncode != 0
    assert "test_sample.py::test_elsewhere: unknown lane 'vllm-0.99'" in proc.stdout + proc.stderr


def test_an_unknown_patch_fails_collection(tmp_path):
    proc = run_pytest(tmp_path, '''
        import pytest

        @pytest.mark.patch("sglang.cp_fia", "sglang.no_such_patch")
        def test_one():
            pass
    ''')
    assert proc.returncode != 0
    out = proc.stdout + proc.stderr
    assert "test_sample.py::test_one: unknown patch 'sglang.no_such_patch' in pytest.mark.patch" in out, out
    assert out.count("unknown patch") == 1    # sglang.cp_fia is a known one


def test_an_empty_patch_marker_fails_collection(tmp_path):
    proc = run_pytest(tmp_path, '''
        import pytest

        pytestmark = pytest.mark.patch()

        def test_one():
            pass
    ''')
    assert proc.returncode != 0
    assert "test_sample.py::test_one: pytest.mark.patch() names no patch" in proc.stdout + proc.stderr


@pytest.mark.parametrize("lane", [None, "sglang-0.5.16"])
def test_selected_tests_record_their_patches_in_the_junit_xml(tmp_path, lane):
    proc = run_pytest(tmp_path, '''
        import pytest

        pytestmark = [pytest.mark.lanes("base", "sglang-0.5.16"), pytest.mark.patch("sglang.cp_pad_gather")]

        def test_module_level():
            pass

        @pytest.mark.patch("sglang.cp_fia")
        def test_two_patches():
            pass

        @pytest.mark.lanes("latest-sglang")
        @pytest.mark.patch("sglang.cp_fia_host_lengths")
        def test_other_lane():
            pass
    ''', "--junitxml", str(tmp_path / "junit.xml"), lane=lane)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    properties = {
        case.get("name"): sorted(p.get("value") for p in case.iter("property") if p.get("name") == "patch")
        for case in ET.parse(str(tmp_path / "junit.xml")).getroot().iter("testcase")
    }
    assert properties == {"test_module_level": ["sglang.cp_pad_gather"],
                          "test_two_patches": ["sglang.cp_fia", "sglang.cp_pad_gather"]}


PER_FAMILY_SOURCE = '''
    import pytest

    @pytest.mark.claimed({patch!r}, per_family=True)
    def test_once_per_family():
        pass

    @pytest.mark.claimed({patch!r})
    def test_every_claimed_lane():
        pass
'''


def per_family_case():
    """A patch with more claimed lanes than families: its per-family lanes and one claimed lane
    that stands for no family."""
    from npu_shim import reference

    per_family = reference.lane_per_family(REPO)
    claimed = reference.claimed_lanes(REPO)
    variants = {lane for lane in conftest.defined_lanes() if reference.lane_header(
        os.path.join(REPO, "lanes", lane + ".txt"), "Tests of")}
    for patch, chosen in sorted(per_family.items()):
        others = sorted(set(claimed[patch]) - set(chosen) - variants)
        if chosen and others:
            return patch, chosen, others[0]
    pytest.fail("no patch has a claimed lane beside its per-family lanes")


def test_per_family_runs_on_one_lane_per_family_and_not_in_variants(tmp_path):
    patch, chosen, other = per_family_case()
    source = PER_FAMILY_SOURCE.format(patch=patch)
    on_chosen = run_pytest(tmp_path, source, lane=chosen[0])
    assert "2 passed" in on_chosen.stdout, on_chosen.stdout + on_chosen.stderr
    on_other = run_pytest(tmp_path, source, "-vv", lane=other)
    assert "1 passed, 1 deselected" in on_other.stdout and "test_every_claimed_lane PASSED" in on_other.stdout, \
        on_other.stdout + on_other.stderr
    env = clean_env(NPU_SHIM_LANE=chosen[0], NPU_SHIM_LANE_VARIANT="1")
    variant = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sample.py", "-vv"],
                             cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert "1 passed, 1 deselected" in variant.stdout and "test_every_claimed_lane PASSED" in variant.stdout, \
        variant.stdout + variant.stderr


ENGINE_SOURCE = """
    import pytest

    pytestmark = pytest.mark.lanes("base")

    @pytest.mark.engine
    def test_starts_an_engine():
        pass

    @pytest.mark.machinery
    def test_of_the_selection():
        pass

    def test_unit():
        pass
"""


def test_engine_and_machinery_tests_run_in_their_lane_and_not_in_its_python_variants(tmp_path):
    in_lane = run_pytest(tmp_path, ENGINE_SOURCE, "-vv", lane="base")
    assert ("3 passed" in in_lane.stdout and "test_starts_an_engine PASSED" in in_lane.stdout
            and "test_of_the_selection PASSED" in in_lane.stdout), in_lane.stdout + in_lane.stderr
    env = clean_env(NPU_SHIM_LANE="base", NPU_SHIM_LANE_VARIANT="1")
    variant = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "test_sample.py", "-vv"],
                             cwd=str(tmp_path), env=env, capture_output=True, text=True, timeout=120)
    assert "1 passed, 2 deselected" in variant.stdout and "test_unit PASSED" in variant.stdout, \
        variant.stdout + variant.stderr


def test_every_engine_test_module_is_marked_engine():
    """The files that start an engine (tests/lanes/test_engine_*.py) carry the marker, so a new one
    left unmarked would not run again in every Python variant unnoticed."""
    import glob
    import re

    unmarked = [path for path in sorted(glob.glob(os.path.join(REPO, "tests", "lanes", "test_engine_*.py")))
                if not re.search(r"^pytestmark = \[.*pytest\.mark\.engine\]$", open(path).read(), re.M)]
    assert glob.glob(os.path.join(REPO, "tests", "lanes", "test_engine_*.py")) and unmarked == [], unmarked


def test_the_lane_selection_is_kept_under_a_name_of_its_inputs(tmp_path, monkeypatch):
    """nox's lanes share one computation of the claimed lanes (NPU_SHIM_TEST_SELECTION_CACHE): the
    kept answer equals a fresh one, and a changed spec or pin file gives another name."""
    import shutil

    from npu_shim import reference

    patch = next(name for name, lanes in sorted(reference.claimed_lanes(REPO).items()) if lanes)
    specs = (json.dumps([patch, {}], sort_keys=True), json.dumps([patch, {"per_family": True}], sort_keys=True))
    monkeypatch.delenv("NPU_SHIM_TEST_SELECTION_CACHE", raising=False)
    assert conftest._selection_cache(specs) is None
    fresh = conftest.declared_lanes.__wrapped__(specs)
    monkeypatch.setenv("NPU_SHIM_TEST_SELECTION_CACHE", str(tmp_path / "cache"))
    name = conftest._selection_cache(specs)
    assert conftest.declared_lanes.__wrapped__(specs) == fresh and os.path.exists(name)
    assert conftest.declared_lanes.__wrapped__(specs) == fresh          # read back from the file
    assert conftest._selection_cache(specs[:1]) != name
    pins = tmp_path / "lanes"
    shutil.copytree(conftest.LANES_DIR, pins)
    monkeypatch.setattr(conftest, "LANES_DIR", str(pins))
    assert conftest._selection_cache(specs) == name
    first = sorted(p for p in os.listdir(pins) if p.endswith(".txt"))[0]
    (pins / first).write_text((pins / first).read_text() + "\n")
    assert conftest._selection_cache(specs) != name


def test_per_family_lanes_are_claimed_one_per_family_newest_release_no_variant():
    from packaging.version import Version

    from npu_shim import reference

    table = reference.lane_table(REPO)
    variants = {lane for lane in table if reference.lane_header(
        os.path.join(REPO, "lanes", lane + ".txt"), "Tests of")}
    declared = dict((patch.name, patch) for patch, _ in reference.patches())
    for name, by_family in reference.family_lanes(REPO).items():
        chosen = reference.lane_per_family(REPO)[name]
        assert not set(chosen) & variants, (name, chosen)
        for family_name, lanes in by_family.items():
            family = next(f for f in declared[name].families if f.name == family_name)
            dist = declared[name].family_dist(family)
            mine = [lane for lane in chosen if lane in lanes]
            assert mine, (name, family_name, chosen)
            newest = max(Version(table[lane][dist]) for lane in lanes if lane not in variants)
            assert any(Version(table[lane][dist]) == newest for lane in mine), (name, family_name, mine)
        assert len(chosen) <= len(by_family), (name, chosen)


def test_an_unknown_claimed_keyword_fails_collection(tmp_path):
    from npu_shim import reference

    patch = next(name for name, lanes in sorted(reference.claimed_lanes(REPO).items()) if lanes)
    proc = run_pytest(tmp_path, '''
        import pytest

        @pytest.mark.claimed(%r, once=True)
        def test_one():
            pass
    ''' % patch, lane=reference.claimed_lanes(REPO)[patch][0])
    assert proc.returncode != 0
    assert "test_sample.py::test_one: pytest.mark.claimed takes no once" in proc.stdout + proc.stderr, \
        proc.stdout + proc.stderr


# --------------------------------------------------------------------------- claimed(...) keywords
# The cases are chosen from the declarations (no patch, family or lane is named here), so the
# tests follow the declarations as they grow.


def _declared():
    from npu_shim import reference

    table = reference.lane_table(REPO)
    variants = reference.variant_lanes(REPO)
    patches = {patch.name: patch for patch, _ in reference.patches()}
    return reference, {lane: pins for lane, pins in table.items() if lane not in variants}, patches


def _module(family):
    return family.implementation.partition(":")[0]


def implemented_in_case():
    """A patch with two families in two modules that claim disjoint lanes: (patch, module of the
    first, one of its lanes, one lane of the other)."""
    reference, table, patches = _declared()
    for name, by_family in sorted(reference.family_lanes(REPO).items()):
        families = {f.name: f for f in patches[name].families}
        claimed = {f: [lane for lane in lanes if lane in table] for f, lanes in by_family.items()}
        for first, other in zip(sorted(claimed), sorted(claimed)[1:]):
            if claimed[first] and claimed[other] and _module(families[first]) != _module(families[other]):
                return name, _module(families[first]), claimed[first][0], claimed[other][0]
    pytest.fail("no patch has two families in two modules with lanes")


def test_implemented_in_selects_the_lanes_of_the_families_living_there():
    reference, table, patches = _declared()
    checked = 0
    for name, by_family in reference.family_lanes(REPO).items():
        for family in patches[name].families:
            if not isinstance(family.implementation, str) or not by_family.get(family.name):
                continue
            module = _module(family)
            expected = sorted({lane for other in patches[name].families if _module(other) == module
                               for lane in by_family.get(other.name, ()) if lane in table})
            assert reference.lane_selection(REPO, name, implemented_in=module) == expected, (name, module)
            checked += 1
    assert checked > 10


def test_implemented_in_runs_a_test_on_that_familys_lanes_only(tmp_path):
    patch, module, inside, other = implemented_in_case()
    source = '''
        import pytest

        @pytest.mark.claimed(%r, implemented_in=%r)
        def test_one_family():
            pass
    ''' % (patch, module)
    assert "1 passed" in run_pytest(tmp_path, source, lane=inside).stdout
    elsewhere = run_pytest(tmp_path, source, lane=other)
    assert "1 deselected" in elsewhere.stdout and "passed" not in elsewhere.stdout, elsewhere.stdout


def test_implemented_in_a_module_no_family_lives_in_fails_collection(tmp_path):
    patch, module, inside, _ = implemented_in_case()
    proc = run_pytest(tmp_path, '''
        import pytest

        @pytest.mark.claimed(%r, implemented_in=%r)
        def test_moved():
            pass
    ''' % (patch, module + "_gone"), lane=inside)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "test_sample.py::test_moved: %s: no family is implemented in %s_gone" % (patch, module) in out, out


def test_per_family_with_implemented_in_takes_those_families_newest_lanes():
    reference, table, patches = _declared()
    checked = 0
    for name, chosen in reference.lane_per_family(REPO).items():
        for module in sorted({_module(f) for f in patches[name].families if isinstance(f.implementation, str)}):
            try:
                of_module = reference.lane_selection(REPO, name, implemented_in=module)
            except ValueError:
                continue                                     # its families claim no lane
            mine = reference.lane_selection(REPO, name, implemented_in=module, per_family=True)
            assert mine == sorted(set(chosen) & set(of_module)), (name, module, mine)
            checked += len(mine) < len(of_module)
    assert checked


def _window_admits(patch, pins):
    from npu_shim.engine.guards import within

    return all(dist in pins and any(within(spec, pins[dist]) for spec in patch.window[dist]) for dist in patch.requires)


def test_window_is_every_lane_the_requires_admit():
    reference, table, patches = _declared()
    for name, patch in patches.items():
        inside = sorted(lane for lane, pins in table.items() if _window_admits(patch, pins))
        if inside:
            assert reference.lane_selection(REPO, name, window=True) == inside, name
    assert any(not lanes for lanes in reference.claimed_lanes(REPO).values()), \
        "window=True exists for a patch that claims no lane"


def _outside_dist(patch, pins):
    """The first distribution of ``requires`` whose window (Patch.window) rules the lane's pin out."""
    from npu_shim.engine.guards import within

    return next((dist for dist in patch.requires if not any(within(spec, pins[dist]) for spec in patch.window[dist])),
                None)


def test_outside_lanes_pin_the_window_and_no_family_claims_them():
    reference, table, patches = _declared()
    key = reference.version_key
    claimed = {name: {lane for lane in lanes if lane in table}
               for name, lanes in reference.claimed_lanes(REPO).items()}
    sides_seen = set()
    for name, patch in patches.items():
        every = sorted(lane for lane, pins in table.items() if lane not in claimed[name]
                       and all(dist in pins for dist in patch.requires))
        if not claimed[name] or not every:
            continue
        assert reference.lane_selection(REPO, name, outside="all") == every, name
        for side in ("below", "above", "newest"):
            try:
                lane, = reference.lane_selection(REPO, name, outside=side)
            except ValueError:
                continue
            sides_seen.add(side)
            dist = _outside_dist(patch, table[lane])
            low = min(key(table[other][dist]) for other in claimed[name])
            mine = key(table[lane][dist])
            beside = [key(table[other][dist]) for other in every if _outside_dist(patch, table[other]) == dist
                      and (key(table[other][dist]) < low) == (mine < low)]
            if side == "below":
                assert mine < low and mine == max(beside), (name, lane)
            elif side == "above":
                assert mine > low and mine == min(beside), (name, lane)
            else:
                assert mine == max(beside), (name, lane)
    assert sides_seen == {"below", "above", "newest"}


def outside_case(side):
    """A patch with an outside lane on ``side``: (patch, that lane, a claimed lane)."""
    reference, table, patches = _declared()
    for name, lanes in sorted(reference.claimed_lanes(REPO).items()):
        try:
            lane, = reference.lane_selection(REPO, name, outside=side)
        except ValueError:
            continue
        return name, lane, next(lane for lane in lanes if lane in table)
    pytest.fail("no patch has an outside lane %s its claimed lanes" % side)


@pytest.mark.parametrize("side", ["below", "above"])
def test_outside_runs_a_test_beside_the_window_not_inside_it(tmp_path, side):
    patch, outside, inside = outside_case(side)
    source = '''
        import pytest

        @pytest.mark.claimed(%r, outside=%r)
        def test_out():
            pass
    ''' % (patch, side)
    assert "1 passed" in run_pytest(tmp_path, source, lane=outside).stdout
    assert "1 deselected" in run_pytest(tmp_path, source, lane=inside).stdout


def test_pinned_narrows_by_a_lanes_pins():
    reference, table, patches = _declared()
    name, lanes = max(reference.claimed_lanes(REPO).items(), key=lambda kv: len(kv[1]))
    lanes = [lane for lane in lanes if lane in table]
    dist = next(iter(patches[name].requires))
    oldest = min((table[lane][dist] for lane in lanes), key=reference.version_key)
    one = sorted(lane for lane in lanes if table[lane][dist] == oldest)
    assert reference.lane_selection(REPO, name, pinned={dist: [oldest]}) == one
    assert reference.lane_selection(REPO, name, pinned={dist: ">%s" % oldest}) == sorted(set(lanes) - set(one))
    with pytest.raises(ValueError, match="selects no lane"):
        reference.lane_selection(REPO, name, pinned={dist: "<0"})


def test_pinned_none_selects_the_lanes_without_that_distribution():
    reference, table, _ = _declared()
    claimed = {name: [lane for lane in lanes if lane in table] for name, lanes in reference.claimed_lanes(REPO).items()}
    cases = [(name, dist, sorted(lane for lane in lanes if dist not in table[lane]))
             for name, lanes in sorted(claimed.items()) for dist in reference.UPSTREAM
             if any(dist in table[lane] for lane in lanes)]
    cases = [(name, dist, absent) for name, dist, absent in cases if absent]
    assert cases, "no patch claims lanes with and without one distribution"
    for name, dist, absent in cases:
        assert reference.lane_selection(REPO, name, pinned={dist: None}) == absent, (name, dist)


@pytest.mark.parametrize("keywords, message", [
    ("pinned={%(dist)r: '<0'}", "selects no lane"),
    ("window=True, per_family=True", "give one"),
    ("outside='sideways'", "outside='sideways': give 'all', 'below', 'above', 'newest'"),
])
def test_a_claimed_selection_the_declarations_cannot_answer_fails_collection(tmp_path, keywords, message):
    reference, table, patches = _declared()
    patch = next(name for name, lanes in sorted(reference.claimed_lanes(REPO).items()) if lanes)
    proc = run_pytest(tmp_path, '''
        import pytest

        def test_base():
            pass

        @pytest.mark.claimed(%r, %s)
        def test_nowhere():
            pass
    ''' % (patch, keywords % {"dist": next(iter(patches[patch].requires))}))
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "1 passed" not in out
    assert "test_sample.py::test_nowhere: " in out and message in out, out


# --------------------------------------------------------------------------- no hand-kept lanes
MECHANISM = {"conftest.py", "test_markers.py", "test_machinery.py"}


def _string_constants(path):
    import ast

    tree = ast.parse(open(path).read(), path)
    return [(node.lineno, node.value) for node in ast.walk(tree)
            if isinstance(node, ast.Constant) and isinstance(node.value, str)]


def test_no_test_names_a_lane_or_a_family_literally():
    """Lane tests select their lanes from the declarations (pytest.mark.claimed); only the
    mechanism's own tests name lanes (and the base lane, which pins no framework) or family ids."""
    reference, table, patches = _declared()
    lanes = set(conftest.defined_lanes()) - {conftest.BASE_LANE}
    families = {family.name for patch in patches.values() for family in patch.families}
    found = []
    for folder, _, files in os.walk(os.path.join(REPO, "tests")):
        for name in sorted(files):
            if not name.endswith(".py") or name in MECHANISM:
                continue
            path = os.path.join(folder, name)
            found += ["%s:%d: %r" % (os.path.relpath(path, REPO), line, value)
                      for line, value in _string_constants(path) if value in lanes or value in families]
    assert not found, "\n".join(found)
