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
