"""tests/conftest.py's markers: ``lanes`` names only lanes nox defines, ``patch`` only
patches ``BUILTIN_PATCHES`` lists, and selected tests' patch names reach the junit xml.

Each case runs pytest in a fresh interpreter on a temporary test file; the
temporary directory's conftest.py takes its hooks from the repository's
tests/conftest.py, so what is checked is that file.
"""
import importlib.util
import os
import subprocess
import sys
import textwrap
import xml.etree.ElementTree as ET

import pytest

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
    assert "pytest.mark.claimed takes no once" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
