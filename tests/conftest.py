"""Lane selection.

Every test belongs to one or more *lanes* (pinned upstream stacks, see ``lanes/``).
A test module says which with ``pytestmark = pytest.mark.lanes("kimi-vl-2025", ...)``;
unmarked tests belong to the ``base`` lane (no upstream framework installed).
``NPU_SHIM_LANE`` (set by the nox sessions) names the lane being run; tests of
other lanes are deselected, never skipped, so a lane that silently runs nothing
shows up as "no tests ran" instead of a green run.
"""
import os

import pytest

BASE_LANE = "base"


def pytest_configure(config):
    config.addinivalue_line("markers", "lanes(*names): pinned stacks this test runs in")


def _lanes_of(item):
    marker = item.get_closest_marker("lanes")
    return set(marker.args) if marker else {BASE_LANE}


def pytest_collection_modifyitems(config, items):
    lane = os.environ.get("NPU_SHIM_LANE", BASE_LANE)
    selected, deselected = [], []
    for item in items:
        (selected if lane in _lanes_of(item) else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected


REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_env(**extra):
    """The current environment without PYTHONPATH or NPU_SHIM* switches."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("NPU_SHIM")}
    env.update({k: v for k, v in extra.items() if v is not None})
    return env


@pytest.fixture
def make_env():
    """``make_env(**vars)``: a clean environment plus these variables."""
    return clean_env


@pytest.fixture
def run_python():
    """Run ``python -c code`` in a fresh interpreter; returns CompletedProcess."""
    import subprocess
    import sys

    def run(code, *, env=None, cwd=None, args=(), check=True, timeout=120):
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            env=clean_env() if env is None else env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                "exit %d\n--- stdout\n%s\n--- stderr\n%s" % (proc.returncode, proc.stdout, proc.stderr)
            )
        return proc

    return run
