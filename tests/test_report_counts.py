"""lanes/report.py counts a lane's tests per patch from the tests' ``patch`` properties
(written by tests/conftest.py from ``pytest.mark.patch``), not from file contents, and
draws its tables with npu_shim/_table.py, loaded without importing npu_shim."""
import importlib.util
import os
import subprocess
import sys
import textwrap

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
REPORT = os.path.join(REPO, "lanes", "report.py")

JUNIT = textwrap.dedent('''\
    <?xml version="1.0" encoding="utf-8"?>
    <testsuites><testsuite name="pytest" errors="1" failures="1" skipped="1" tests="6">
      <testcase classname="tests.lanes.test_sglang_cp_fia_host_lengths" name="test_a">
        <properties><property name="patch" value="sglang.cp_fia_host_lengths"/></properties>
      </testcase>
      <testcase classname="tests.lanes.test_sglang_cp_fia_host_lengths" name="test_b">
        <properties><property name="patch" value="sglang.cp_fia_host_lengths"/></properties>
        <failure message="assert 0">assert 0</failure>
      </testcase>
      <testcase classname="tests.lanes.test_sglang_cp_pad_gather" name="test_c">
        <properties><property name="patch" value="sglang.cp_pad_gather"/>
                    <property name="patch" value="sglang.cp_fia"/>
                    <property name="other" value="sglang.small_page_fia"/></properties>
      </testcase>
      <testcase classname="tests.lanes.test_sglang_cp_pad_gather" name="test_d">
        <properties><property name="patch" value="sglang.cp_pad_gather"/></properties>
        <skipped message="no"/>
      </testcase>
      <testcase classname="tests.lanes.test_sglang_cp_pad_gather" name="test_e">
        <properties><property name="patch" value="sglang.cp_pad_gather"/></properties>
        <error message="fixture"/>
      </testcase>
      <testcase classname="tests.test_machinery" name="test_f"/>
    </testsuite></testsuites>
''')


@pytest.fixture(scope="module")
def report():
    spec = importlib.util.spec_from_file_location("npu_shim_tests_lane_report", REPORT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def rows(*names):
    return [{"name": name} for name in names]


def test_tests_are_counted_for_the_patches_they_name(report, tmp_path):
    junit = tmp_path / "junit.xml"
    junit.write_text(JUNIT)
    cases = report.read_junit(str(junit))
    assert report.totals(cases) == {"passed": 3, "failed": 1, "error": 1, "skipped": 1}
    counts = report.tests_per_patch(
        rows("sglang.cp_fia", "sglang.cp_fia_host_lengths", "sglang.cp_pad_gather", "sglang.small_page_fia"),
        cases)
    assert counts == {
        # not credited with cp_fia_host_lengths' tests, though its name is a prefix of that one
        "sglang.cp_fia": {"passed": 1, "total": 1},
        "sglang.cp_fia_host_lengths": {"passed": 1, "total": 2},
        "sglang.cp_pad_gather": {"passed": 1, "total": 3},
        "sglang.small_page_fia": {"passed": 0, "total": 0},   # a property named otherwise does not count
    }


def test_a_missing_junit_file_counts_nothing(report, tmp_path):
    cases = report.read_junit(str(tmp_path / "none.xml"))
    assert cases == []
    assert report.tests_per_patch(rows("sglang.cp_fia"), cases) == {"sglang.cp_fia": {"passed": 0, "total": 0}}


def test_the_lane_table_is_npu_shims_table(report):
    from npu_shim import _table

    summary = {"patches": [{"name": "sglang.cp_fia", "state": "skipped", "reason": "fixed upstream",
                            "versions": {"sglang": "0.5.13"}}],
               "tests_per_patch": {"sglang.cp_fia": {"passed": 3, "total": 4}}}
    assert report.lane_table(summary) == _table.format_table(
        ("patch", "state", "reason", "versions", "tests passed (marked for it)"),
        [("sglang.cp_fia", "skipped", "fixed upstream", "sglang 0.5.13", "3/4")])
    assert report.format_table.__code__.co_filename == os.path.join(REPO, "npu_shim", "_table.py")


def test_report_runs_without_importing_npu_shim(tmp_path, make_env):
    """``report.py summary`` runs under nox's Python, where npu_shim is not installed."""
    code = ("import importlib.util, sys\n"
            "spec = importlib.util.spec_from_file_location('report', %r)\n"
            "module = importlib.util.module_from_spec(spec); spec.loader.exec_module(module)\n"
            "print(sorted(m for m in sys.modules if m.split('.')[0] == 'npu_shim'))\n"
            "sys.exit(module.main(['summary', %r]))\n" % (REPORT, str(tmp_path)))
    proc = subprocess.run([sys.executable, "-I", "-c", code], env=make_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 1, proc.stderr
    assert proc.stdout.splitlines()[0] == "[]"
    assert "no lane summaries under" in proc.stdout


# The lane gates: each test shows the gate failing on the defect it exists for.

def test_a_lane_whose_tests_all_skip_fails(report, tmp_path):
    """Defect caught: every test of a lane skips (exit 0 from pytest) and the lane stays green."""
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite>'
                     '<testcase classname="t" name="a"><skipped message="vLLM 0.30 is outside"/></testcase>'
                     '<testcase classname="t" name="b"><skipped message="vLLM 0.30 is outside"/></testcase>'
                     '</testsuite></testsuites>')
    summary = _run_gated(report, tmp_path / "out", junit, expected=["vLLM 0.30 is outside"])
    assert summary["tests"]["skipped"] == 2
    assert "no test passed (2 skipped)" in summary["problems"]


def _run_gated(report, out, junit, expected=(), rows=None, stands_for=None):
    """report.cmd_run with pytest and the status command replaced by canned results."""
    import argparse
    import shutil

    def fake_pytest(junit_path, args, env):
        shutil.copy(str(junit), junit_path)
        return 0

    original = report.run_pytest, report.patch_status, report.drop_bytecode, report.venv_size_mib
    report.run_pytest = fake_pytest
    report.patch_status = lambda env, matrix_path=None: (rows or [], None)
    report.drop_bytecode = lambda prefix: 0
    report.venv_size_mib = lambda: (0, 0)
    try:
        code = report.cmd_run(argparse.Namespace(out=str(out), lane="demo", tests_of=None, variant=False, pytest_args=[],
                                                 install_seconds=1.0, stands_for=stands_for,
                                                 expected_skip=list(expected)))
    finally:
        report.run_pytest, report.patch_status, report.drop_bytecode, report.venv_size_mib = original
    import json

    summary = json.loads((out / "summary.json").read_text())
    assert code == (1 if summary["problems"] else 0)
    return summary


def test_an_undeclared_skip_fails_the_lane(report, tmp_path):
    """Defect caught: a test skips on a lane for a reason nobody declared (a claim silently untested)."""
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite>'
                     '<testcase classname="t" name="ok"/>'
                     '<testcase classname="t" name="declared"><skipped message="needs a CUDA device"/></testcase>'
                     '<testcase classname="t" name="other"><skipped message="target failed to import"/></testcase>'
                     '</testsuite></testsuites>')
    summary = _run_gated(report, tmp_path / "out", junit, expected=["needs a CUDA device"])
    assert summary["problems"] == ["a test skipped for a reason the pin file does not declare (# Expected skip:): "
                                   "t::other (target failed to import)"]
    passing = _run_gated(report, tmp_path / "out2", junit,
                         expected=["needs a CUDA device", "target failed to import"])
    assert passing["problems"] == []


def test_a_claimed_family_must_apply_and_be_exercised(report, tmp_path):
    """Defect caught: a patch whose family claims the lane's release is skipped ('target failed to
    import') or applied with no passing test marked for it, and the lane stays green."""
    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="t" name="a">'
                     '<properties><property name="patch" value="p.tested"/></properties></testcase>'
                     '</testsuite></testsuites>')
    rows_ = [
        {"name": "p.tested", "state": "applied", "family": "f1", "admitted": ["f1"], "reason": "ok"},
        {"name": "p.untested", "state": "applied", "family": "f2", "admitted": ["f2"], "reason": "ok"},
        {"name": "p.broken", "state": "skipped", "family": None, "admitted": ["f3"],
         "reason": "target failed to import: ModuleNotFoundError: No module named 'compressed_tensors'"},
        {"name": "p.elsewhere", "state": "skipped", "family": None, "admitted": [], "reason": "outside"},
        {"name": "p.off", "state": "disabled", "family": None, "admitted": ["f4"], "reason": "NPU_SHIM_DISABLE"},
    ]
    summary = _run_gated(report, tmp_path / "out", junit, rows=rows_)
    assert summary["problems"] == [
        "p.untested: applied (f2) on the release its family claims, but no test marked for it passed on this lane",
        "p.broken: family f3 claims this release, but the patch is skipped: target failed to import: "
        "ModuleNotFoundError: No module named 'compressed_tensors'",
    ]


def test_a_lane_with_another_release_than_its_header_fails_before_testing(report, tmp_path):
    """Defect caught: a mis-edited pin file installs a release other than the one its
    '# Stands for:' header names, and the lane's results are credited to the wrong release."""
    import json
    from importlib.metadata import version

    pytest_version = version("pytest")
    assert report.release_mismatches("pytest %s; python %d.%d" % ((pytest_version,) + sys.version_info[:2])) == []
    problems = report.release_mismatches("pytest 0.0.1, 0.0.2; python 2.7; no-such-dist 1.0")
    assert problems == [
        "the pin file says the lane stands for pytest 0.0.1, 0.0.2, but pytest %s is installed" % pytest_version,
        "the pin file says the lane stands for python 2.7, but python %d.%d is installed" % sys.version_info[:2],
        "the pin file says the lane stands for no-such-dist 1.0, but no no-such-dist is installed",
    ]
    ran = []
    original = report.run_pytest
    report.run_pytest = lambda *args: ran.append(args) or 0
    try:
        import argparse

        code = report.cmd_run(argparse.Namespace(out=str(tmp_path), lane="demo", tests_of=None, variant=False, pytest_args=[],
                                                 install_seconds=1.0, stands_for="pytest 0.0.1", expected_skip=[]))
    finally:
        report.run_pytest = original
    assert code == 1 and ran == []
    assert json.loads((tmp_path / "summary.json").read_text())["problems"] == [
        "the pin file says the lane stands for pytest 0.0.1, but pytest %s is installed" % pytest_version]


def test_the_local_label_is_not_part_of_the_release(report, monkeypatch):
    import importlib.metadata

    monkeypatch.setattr(importlib.metadata, "version", lambda dist: "2.13.0+cpu")
    assert report.release_mismatches("torch 2.13.0") == []


def test_the_lane_records_what_it_applied_and_fails_on_a_contradicted_record(report, tmp_path):
    """Defect caught: npu_shim/releases_read.json records the installed release as read for a
    family other than the one the shim applies here (or for a patch skipped here), and the lane
    stays green. What it applied on a release build goes to evidence.json (npu-shim evidence)."""
    import json

    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="t" name="a">'
                     '<properties><property name="patch" value="p.agrees"/></properties></testcase>'
                     '</testsuite></testsuites>')
    rows_ = [
        {"name": "p.agrees", "state": "applied", "family": "f1", "admitted": [], "reason": "ok",
         "release": "1.0", "read_as": ["f1"]},
        {"name": "p.new", "state": "applied", "family": "f2", "admitted": [], "reason": "ok",
         "release": "1.1", "read_as": []},
        {"name": "p.other", "state": "applied", "family": "f3", "admitted": [], "reason": "ok",
         "release": "1.2", "read_as": ["f0"]},
        {"name": "p.skipped", "state": "skipped", "family": None, "admitted": [], "reason": "structural check: x",
         "release": None, "read_as": ["f4"]},
        {"name": "p.dev", "state": "applied", "family": "f5", "admitted": [], "reason": "ok",
         "release": None, "read_as": []},
        {"name": "p.off", "state": "disabled", "family": None, "admitted": [], "reason": "off",
         "release": None, "read_as": ["f6"]},
    ]
    summary = _run_gated(report, tmp_path / "out", junit, rows=rows_)
    assert summary["problems"] == [
        "p.other: applied with family f3 on 1.2, which npu_shim/releases_read.json records as read for f0",
        "p.skipped: npu_shim/releases_read.json records this release as read for family f4, but the patch is "
        "skipped: structural check: x",
    ]
    found = json.loads((tmp_path / "out" / "evidence.json").read_text())
    assert found == {"source": "lane demo", "found": {"p.agrees": {"f1": "1.0"}, "p.new": {"f2": "1.1"},
                                                      "p.other": {"f3": "1.2"}}}
    assert report.unrecorded(rows_) == ["p.new: family f2 on 1.1"]


def test_upstream_suites_that_fail_fail_the_lane(report, tmp_path, monkeypatch):
    """Defect caught: upstream's own tests of a patched class fail (or a declared difference goes
    stale) on a lane lanes/upstream_tests.py names, and the lane stays green."""
    import argparse
    import json
    import shutil

    junit = tmp_path / "junit.xml"
    junit.write_text('<testsuites><testsuite><testcase classname="t" name="a"/></testsuite></testsuites>')
    seen = {}

    def fake_run(lane, archive, env):
        seen.update(lane=lane, archive=archive)
        return {"dist": "vllm-ascend", "release": "0.18.0", "sha256": "0" * 64, "commit": "e18643f8a", "seconds": 3.0,
                "suites": [{"suite": "s", "passed": 0, "declared": 0, "failed": 1, "tests": []}],
                "problems": ["upstream test x: failed without a declared difference"]}

    monkeypatch.setattr(report, "run_pytest", lambda junit_path, args, env: shutil.copy(str(junit), junit_path) and 0)
    monkeypatch.setattr(report, "patch_status", lambda env, matrix_path=None: ([], None))
    monkeypatch.setattr(report, "drop_bytecode", lambda prefix: 0)
    monkeypatch.setattr(report, "venv_size_mib", lambda: (0, 0))
    monkeypatch.setattr(report.upstream_tests, "run", fake_run)
    out = tmp_path / "out"
    lane = next(iter(report.upstream_tests.LANES))   # a lane that runs upstream's tests
    code = report.cmd_run(argparse.Namespace(out=str(out), lane=lane, tests_of=None, variant=False,
                                             pytest_args=[], install_seconds=1.0, stands_for=None, expected_skip=[],
                                             upstream_archive="archive.tar.gz"))
    summary = json.loads((out / "summary.json").read_text())
    assert seen == {"lane": lane, "archive": "archive.tar.gz"}
    assert code == 1 and summary["problems"] == ["upstream test x: failed without a declared difference"]
    assert report.all_test_seconds(summary) == summary["test_seconds"] + 3.0
    assert "vllm-ascend 0.18.0" in report.upstream_table([summary])
