"""The subprocesses the tests start import the npu_shim under test, not the checkout's.

``python -c`` and ``python -m`` put their working directory first on ``sys.path``: started from
the checkout, a subprocess would import the checkout's files and a file missing from the built
package would go unseen (tests/conftest.py, neutral_working_directory). In a lane
(``NPU_SHIM_LANE`` set by lanes/report.py) the package under test is the one installed in the
lane's venv, never the checkout.
"""
import importlib.util
import json
import os
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
WHERE = ("import importlib.util, json, os, sys; "
         "print(json.dumps([os.getcwd(), os.path.dirname(importlib.util.find_spec('npu_shim').origin)]))")


def _package_dir():
    return os.path.dirname(importlib.util.find_spec("npu_shim").origin)


def _inside(path, root):
    return os.path.commonpath([os.path.realpath(path), os.path.realpath(root)]) == os.path.realpath(root)


def test_a_python_dash_c_subprocess_imports_the_package_under_test(make_env):
    proc = subprocess.run([sys.executable, "-c", WHERE], env=make_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stderr
    cwd, package = json.loads(proc.stdout)
    assert not _inside(cwd, REPO), "a subprocess started in the checkout: %s" % cwd
    assert os.path.realpath(package) == os.path.realpath(_package_dir()), (
        "the subprocess imported %s, the tests %s (run pytest with -P, or its script: lanes/report.py)"
        % (package, _package_dir()))


def test_run_python_starts_outside_the_checkout(run_python):
    cwd, package = json.loads(run_python(WHERE).stdout)
    assert not _inside(cwd, REPO)
    assert os.path.realpath(package) == os.path.realpath(_package_dir())


@pytest.mark.skipif(not os.environ.get("NPU_SHIM_LANE"), reason="only in a lane, where npu_shim is installed")
def test_a_lane_tests_the_installed_package_not_the_checkout():
    assert os.path.realpath(_package_dir()) != os.path.realpath(os.path.join(REPO, "npu_shim")), \
        "the lane imports npu_shim from the checkout"
