"""``npu-shim selftest`` on the MoonViT stacks: the command an operator runs before serving."""
import json
import os
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.claimed("transformers.attn_check", "vllm.moonvit_attn"),
              pytest.mark.patch("transformers.attn_check", "vllm.moonvit_attn")]

CLI = os.path.join(os.path.dirname(sys.executable), "npu-shim")


def test_selftest_checks_both_applied_patches_against_float64(make_env, tmp_path):
    env = make_env(NPU_SHIM_EMULATE="1", VLLM_PLUGINS="npu_shim", TMPDIR=str(tmp_path))
    proc = subprocess.run([CLI, "selftest", "--json"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert list(tmp_path.glob("npu_shim_*")) == []   # vLLM 0.11+'s gloo init file is removed at exit
    rows = {r["patch"]: r for r in json.loads(proc.stdout)}   # framework logs went to stderr
    for name in ("transformers.attn_check", "vllm.moonvit_attn"):
        row = rows[name]
        assert row["state"] == "applied" and row["ok"] is True, row
        assert row["error_measure"] == "max_abs_err" and row["error"] <= row["tolerance"]
        assert row["host_syncs"] == row["expected_host_syncs"] == 1, row
    assert rows["sglang.cp_fia"]["ok"] is None


def test_selftest_table_names_the_emulation(make_env):
    env = make_env(NPU_SHIM_EMULATE="1", VLLM_PLUGINS="npu_shim", NPU_SHIM_ENABLE="vllm.moonvit_attn")
    proc = subprocess.run([CLI, "selftest"], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "pure-PyTorch emulation of torch_npu" in proc.stdout
    line = next(line for line in proc.stdout.splitlines() if line.startswith("vllm.moonvit_attn"))
    assert line.split()[-1] == "ok"
