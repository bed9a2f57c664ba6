"""The read counter at dispatch agrees with today's counter on every tower test's tower (issue 38, item 1).

Today's counter (:func:`npu_shim.testing.count_host_syncs`) watches CPU stand-ins for device
tensors; the emulated device (``NPU_SHIM_EMULATE_DEVICE=1``) counts each device->host transfer at
dispatch (:func:`npu_shim.emulation.device.count_transfers`). In a child process with the device,
:mod:`npu_shim.testing.device_census` runs every tower this vLLM has of the README's (Qwen2.5-VL,
Qwen3-VL, GLM-4.1V, Kimi-VL's MoonViT) and of the census, on both device classes,
shim and upstream (vllm-ascend's untouched attention, vLLM's own tower code), once as today and once
moved to ``npu``: the two counts must be equal, and the device's output equal to the CPU run's, bit
for bit. A tower the device cannot run (an op or an assertion of upstream's that CPU stand-ins never
met) fails here naming it: the first run found the census's Ernie4.5-VL grid on the device where
vLLM 0.30 keeps it on the host (its tower asserts so), mutant ``device-census-ernie-grid``.
"""
import json
import os
import subprocess
import sys

import pytest
from test_engine_vllm import LANES  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)

# the engine tests' lane of the newest vllm-ascend with the vLLM of its own minor (vllm-0.30): the census
# towers of that vLLM on that vllm-ascend's encoder attention, one device's worth of CI time
pytestmark = pytest.mark.lanes(LANES[-1])

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DEVICE_CLASSES = ("310P", "A2")
TIMEOUT_S = 600


@pytest.fixture(scope="module")
def rows():
    env = dict(os.environ, NPU_SHIM_EMULATE="1", NPU_SHIM_EMULATE_DEVICE="1", VLLM_PLUGINS="npu_shim",
               VLLM_CONFIGURE_LOGGING="0")
    proc = subprocess.run([sys.executable, "-P", "-m", "npu_shim.testing.device_census", "--forwards", "1"],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=TIMEOUT_S)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def installed_towers():
    from npu_shim.testing import census, towers

    readme = [name for name, (module, _, _) in towers.TOWERS.items() if census._has_module(module)]
    readme += ["Kimi-VL"] * census._has_module(towers.MOONVIT[0])
    return sorted(readme + [name for name, spec in census.CENSUS.items() if census._has_module(spec.module)])


def test_every_census_tower_runs_on_the_device(rows):
    errors = [row for row in rows if "error" in row]
    assert errors == [], errors
    ran = {(row["tower"], row["device_class"], row["side"]) for row in rows}
    expected = {(name, device_class, side) for name in installed_towers() for device_class in DEVICE_CLASSES
                for side in ("shim", "upstream")}
    assert sorted(expected - ran) == [], "census towers that did not run on the device"


def test_dispatch_count_equals_todays_and_outputs_are_equal(rows):
    disagree = [row for row in rows if "error" not in row and (
        row["today"] != row["dispatch"] or sum(row["dispatch_kinds"].values()) != row["dispatch"]
        or not row["equal"])]
    assert disagree == [], disagree
    # upstream reads on every tower here (once per layer at least), so equal counts are not two zeros
    upstream = [row for row in rows if row.get("side") == "upstream"]
    assert upstream and all(row["dispatch"] > 0 for row in upstream), upstream
