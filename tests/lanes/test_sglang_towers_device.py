"""The read counter at dispatch agrees with today's counter on sglang's vision towers (issue 38, item 1).

:mod:`npu_shim.testing.sglang_device_census`, in a child process with the emulated device, runs the
towers of test_sglang_towers.py (sglang's Qwen2.5-VL, Qwen3-VL and GLM-4V, the ``ascend_attn`` vision
backend) over their grids, upstream (the shim uninstalled) and the shim, once as today (CPU stand-ins,
today's counter) and once moved to ``npu`` with the counter at dispatch: the counts must be equal and
the device's output equal to the CPU run's, bit for bit. On the newest sglang lane (the release the
engine tests serve); the tower tests count on CPU stand-ins on every sglang lane.
"""
import json
import os
import subprocess
import sys

import pytest
from sglang_support import newest  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)

pytestmark = pytest.mark.lanes(newest.LANE)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def rows():
    env = dict(os.environ, NPU_SHIM_EMULATE="1", NPU_SHIM_EMULATE_DEVICE="1")
    proc = subprocess.run([sys.executable, "-P", "-m", "npu_shim.testing.sglang_device_census"], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def test_every_tower_forward_runs_on_the_device(rows):
    from npu_shim.testing import sglang_towers

    assert [row for row in rows if "error" in row] == []
    expected = {(name, json.dumps(grid), side) for name, spec in sglang_towers.TOWERS.items()
                for grid in spec.grids for side in ("shim", "upstream")}
    assert expected - {(row["tower"], json.dumps(row["grid"]), row["side"]) for row in rows} == set()


def test_dispatch_count_equals_todays_and_outputs_are_equal(rows):
    disagree = [row for row in rows if "error" not in row and (
        row["today"] != row["dispatch"] or sum(row["dispatch_kinds"].values()) != row["dispatch"]
        or not row["equal"])]
    assert disagree == [], disagree
    # upstream reads on every tower here, so equal counts are not two zeros
    upstream = [row for row in rows if row["side"] == "upstream"]
    assert upstream and all(row["dispatch"] > 0 for row in upstream), upstream
