"""``npu-shim selftest`` where no framework is installed (lane base)."""
import json
import os
import subprocess
import sys

from npu_shim import selftest
from npu_shim.patches import BUILTIN_PATCHES

CLI = os.path.join(os.path.dirname(sys.executable), "npu-shim")


def test_without_npu_ops_it_says_to_use_the_emulation(make_env):
    proc = subprocess.run([CLI, "selftest"], env=make_env(), capture_output=True, text=True, timeout=120)
    assert proc.returncode == selftest.EXIT_NO_KERNELS
    assert "torch_npu is not importable" in proc.stdout and "NPU_SHIM_EMULATE=1" in proc.stdout


def test_with_emulation_and_no_framework_nothing_applies(make_env):
    proc = subprocess.run([CLI, "selftest", "--json"], env=make_env(NPU_SHIM_EMULATE="1"),
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert {r["patch"] for r in rows} == {name for name, _ in BUILTIN_PATCHES}
    assert all(r["kernels"] == "emulation" and r["ok"] is None for r in rows)
    assert all(r["state"] == "skipped" and r["reason"].startswith("not installed") for r in rows)


def test_a_row_over_its_tolerance_fails_the_command(monkeypatch, capsys):
    rows = [{"patch": "p", "target_version": "x 1", "state": "applied", "reason": "r", "kernels": "emulation",
             "device": "cpu", "max_abs_err": 0.5, "tolerance": 1e-4, "host_syncs": 1, "seconds": 0.1, "ok": False}]
    monkeypatch.setattr(selftest, "kernel_provider", lambda: "emulation")
    monkeypatch.setattr(selftest, "run_all", lambda: rows)
    assert selftest.main() == selftest.EXIT_MISMATCH
    assert "MISMATCH" in capsys.readouterr().out
    rows[0].update(max_abs_err=1e-6, ok=True)
    assert selftest.main() == selftest.EXIT_OK
