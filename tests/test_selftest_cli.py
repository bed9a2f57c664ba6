"""``npu-shim selftest`` where no framework is installed (lane base)."""
import importlib
import importlib.util
import json
import os
import subprocess
import sys

import pytest

from npu_shim import selftest
from npu_shim.patch import Patch, Selftest
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
    patches = [r for r in rows if r["state"] != "probe"]
    assert [r["patch"] for r in patches] == [name for name, _ in BUILTIN_PATCHES]
    assert all(r["kernels"] == "emulation" and r["ok"] is None for r in patches)
    assert all(r["state"] == "skipped" and r["reason"].startswith("not installed") for r in patches)
    # the op calls upstream reported silently wrong are probed whatever applies (npu_shim.selftest.op_reports)
    probes = [r for r in rows if r["state"] == "probe"]
    assert [r["issue"] for r in probes] == ["vllm-ascend #13699", "vllm-ascend #15503"], probes
    assert all(r["ok"] is True and r["error"] <= r["tolerance"] and r["kernels"] == "emulation" for r in probes)


def _row(**over):
    row = {"patch": "p", "target_version": "x 1", "state": "applied", "reason": "r", "kernels": "emulation",
           "device": "cpu", "error": 1e-6, "error_measure": "max_rel_err", "tolerance": 1e-4,
           "host_syncs": 0, "expected_host_syncs": 0, "case": None, "seconds": 0.1, "failed": [], "ok": True}
    row.update(over)
    return row


def test_a_row_over_its_tolerance_or_off_its_reads_fails_the_command(monkeypatch, capsys):
    rows = [_row(error=0.5, failed=["error"], ok=False)]
    monkeypatch.setattr(selftest, "kernel_provider", lambda: "emulation")
    monkeypatch.setattr(selftest, "run_all", lambda: rows)
    assert selftest.main() == selftest.EXIT_MISMATCH
    assert "FAIL (error)" in capsys.readouterr().out
    rows[:] = [_row(host_syncs=4, failed=["reads"], ok=False, verdict="FAIL (reads): counted 4")]
    assert selftest.main() == selftest.EXIT_MISMATCH
    out = capsys.readouterr().out
    line = next(line for line in out.splitlines() if line.startswith("p "))
    assert line.split()[-2:] == ["FAIL", "(reads)"] and " 4 " in line, out
    rows[:] = [_row()]
    assert selftest.main() == selftest.EXIT_OK
    out = capsys.readouterr().out
    assert "max_rel_err: max |out - ref| / max |ref|:" in out   # the measure says what it is relative to


DECLARED = Selftest("npu_shim.selftest.nothing", host_syncs=0)


def _measured(**over):
    measured = {"max_rel_err": 1e-7, "tolerance": 2e-4, "host_syncs": 0, "seconds": 0.1, "detail": "d"}
    measured.update(over)
    return measured


def test_ok_needs_the_error_within_tolerance_and_the_declared_reads():
    assert selftest.judge(DECLARED, _measured())["ok"] is True
    over = selftest.judge(DECLARED, _measured(max_rel_err=1e-3))
    assert over["failed"] == ["error"] and over["verdict"].startswith("FAIL (error): max_rel_err 0.001 over")
    assert selftest.judge(DECLARED, _measured(max_rel_err=float("nan")))["failed"] == ["error"]


def test_a_path_that_reads_back_once_per_layer_fails_on_its_reads_alone():
    """The error is fine (a read back changes no number); the reads are not what the patch declares."""
    verdict = selftest.judge(DECLARED, _measured(host_syncs=4))   # one read in each of 4 layers
    assert (verdict["ok"], verdict["failed"]) == (False, ["reads"])
    assert verdict["verdict"] == "FAIL (reads): counted 4 device->host reads, the patch declares 0"
    assert (verdict["host_syncs"], verdict["expected_host_syncs"]) == (4, 0)
    assert selftest.judge(Selftest("m", host_syncs=1), _measured(host_syncs=4))["failed"] == ["reads"]
    assert selftest.judge(Selftest("m", host_syncs=1), _measured(host_syncs=0))["failed"] == ["reads"]


def test_the_error_is_reported_under_the_name_of_its_measure():
    verdict = selftest.judge(DECLARED, _measured())
    assert (verdict["error_measure"], verdict["error"]) == ("max_rel_err", 1e-7)
    absolute = _measured(max_abs_err=3e-6)
    del absolute["max_rel_err"]
    assert selftest.judge(DECLARED, absolute)["error_measure"] == "max_abs_err"
    with pytest.raises(ValueError, match="exactly one of"):
        selftest.judge(DECLARED, _measured(max_abs_err=1e-7))
    with pytest.raises(ValueError, match="exactly one of"):
        selftest.judge(DECLARED, {"error": 0.0, "tolerance": 1.0, "host_syncs": 0})


def test_a_selftest_with_cases_is_held_to_the_count_of_the_case_it_ran():
    declared = Selftest("m", host_syncs={"forward": 1, "rejected": 0})
    assert selftest.judge(declared, _measured(host_syncs=1, case="forward"))["ok"] is True
    assert selftest.judge(declared, _measured(host_syncs=0, case="rejected"))["ok"] is True
    assert selftest.judge(declared, _measured(host_syncs=0, case="forward"))["failed"] == ["reads"]
    unnamed = selftest.judge(declared, _measured(host_syncs=0))
    assert unnamed["failed"] == ["reads"] and unnamed["expected_host_syncs"] is None


def test_every_builtin_patch_declares_its_selftest_and_reads():
    for _, declaring_module in BUILTIN_PATCHES:
        patch = importlib.import_module(declaring_module).PATCH
        assert isinstance(patch.selftest, Selftest), patch.name
        module, _, function = patch.selftest.run.partition(":")
        assert importlib.util.find_spec(module) is not None, patch.selftest
        assert hasattr(importlib.import_module(module), function or "run"), patch.selftest


def test_a_selftest_declaration_needs_counts():
    for bad in (None, -1, 1.0, "0", {}, {"case": -1}):
        with pytest.raises(TypeError):
            Selftest("m", host_syncs=bad)
    with pytest.raises(TypeError, match="must be a Selftest"):
        Patch(name="p", target="t", replaces=("a",), check=None, build=lambda m: {}, selftest="npu_shim.x")


def test_a_selftest_with_arguments_gets_them_and_its_patchs_name(monkeypatch):
    """One callable serves several patches (a tower each): its declaration gives the arguments,
    and the runner adds the patch's name."""
    import sys
    import types

    seen = {}

    def run(device=None, **arguments):
        seen.update(arguments, device=device)
        return _measured(host_syncs=0)

    monkeypatch.setitem(sys.modules, "npu_shim_test_selftest_args", types.SimpleNamespace(run=run))
    declared = Selftest("npu_shim_test_selftest_args:run", host_syncs=0, arguments={"tower": "T"})
    monkeypatch.setattr(selftest, "_declared", lambda name: declared)
    assert selftest.run_one("some.patch")["ok"]
    assert seen == {"tower": "T", "patch": "some.patch", "device": "cpu"}
    assert "run(tower='T')" in declared.describe()
    plain = Selftest("npu_shim_test_selftest_args:run", host_syncs=0)
    monkeypatch.setattr(selftest, "_declared", lambda name: plain)
    seen.clear()
    selftest.run_one("some.patch")
    assert seen == {"device": "cpu"}
