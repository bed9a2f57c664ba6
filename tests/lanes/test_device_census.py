"""The emulated Ascend device (npu_shim.emulation.device) on a real tower: vLLM's Qwen2-VL vision
tower with vllm-ascend's attention (npu_shim.testing.census), moved to ``npu``, its device->host
reads counted at dispatch, against today's counter on CPU stand-ins, shim on and off
(npu_shim.testing.device_census). The device is switched on per process, so the towers run in a
child with ``NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1``.
"""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.patch("vllm.qwen2_vl_host_lengths")]


@pytest.mark.claimed("vllm.qwen2_vl_host_lengths", per_family=True)
def test_dispatch_counter_agrees_with_todays_on_the_tower():
    import torch.utils.backend_registration as registration

    if not hasattr(registration, "_setup_privateuseone_for_python_backend"):
        pytest.skip("this torch has no Python PrivateUse1 backend registration (the emulated device needs it)")
    env = dict(os.environ, NPU_SHIM_EMULATE="1", NPU_SHIM_EMULATE_DEVICE="1")
    flags = ["-P"] if sys.flags.safe_path else []
    proc = subprocess.run([sys.executable, *flags, "-m", "npu_shim.testing.device_census", "Qwen2-VL"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]
    assert rows and not [r for r in rows if "error" in r], rows
    for r in rows:
        print("%(tower)s %(device_class)s forward %(forward)d %(side)s: today %(today)d, dispatch %(dispatch)d "
              "%(dispatch_kinds)s, outputs equal %(equal)s" % r)
    assert {(r["device_class"], r["side"]) for r in rows} == {(d, s) for d in ("A2", "310P") for s in ("shim", "upstream")}
    assert all(r["today"] == r["dispatch"] and r["equal"] for r in rows), rows
    # both sides seen: the shim reads nothing back, upstream's attention once a layer (3 layers)
    assert {r["dispatch"] for r in rows if r["side"] == "shim"} == {0}
    assert {r["dispatch"] for r in rows if r["side"] == "upstream"} == {3}
