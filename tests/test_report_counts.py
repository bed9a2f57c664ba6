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
