import json
import os
import subprocess
import sys

import pytest

from npu_shim.patches import BUILTIN_PATCHES

BIN = os.path.dirname(sys.executable)
KEYS = {"name", "target", "state", "family", "families", "reason", "requires", "versions"}
PATCHES = [name for name, _ in BUILTIN_PATCHES]


def cli(args, env):
    return subprocess.run([os.path.join(BIN, "npu-shim"), *args], env=env, capture_output=True, text=True, timeout=300)


def test_status_json_lists_every_patch_with_the_contract_keys(make_env):
    proc = cli(["status", "--json"], make_env())
    assert proc.returncode == 0, proc.stderr
    rows = json.loads(proc.stdout)
    assert [r["name"] for r in rows] == PATCHES
    for row in rows:
        assert KEYS <= set(row)
        assert "adapter" not in row   # "family" is the one name
        assert row["state"] in {"pending", "applied", "skipped", "disabled", "failed"}
        assert set(row["versions"]) == set(row["requires"])


def test_status_table_and_module_entry_agree(make_env):
    table = cli(["status"], make_env())
    module = subprocess.run([sys.executable, "-m", "npu_shim", "status"], env=make_env(), capture_output=True, text=True)
    assert table.returncode == module.returncode == 0
    assert table.stdout == module.stdout
    header, rule, *lines = table.stdout.splitlines()
    assert header.split() == ["patch", "state", "family", "reason", "versions"]
    assert [line.split()[0] for line in lines] == PATCHES


def test_status_with_absent_targets_does_not_crash_with_import(make_env):
    proc = cli(["status", "--json", "--import"], make_env(NPU_SHIM_ENABLE="sglang.cp_fia"))
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}
    assert rows["transformers.attn_check"]["state"] == "disabled"
    assert rows["sglang.cp_fia"]["state"] in {"skipped", "applied", "failed", "pending"}


@pytest.mark.parametrize("var", ["NPU_SHIM", "NPU_SHIM_STRICT", "NPU_SHIM_EMULATE"])
def test_malformed_boolean_is_a_usage_error(make_env, var):
    proc = cli(["status"], make_env(**{var: "kinda"}))
    assert proc.returncode == 2
    assert "%s='kinda' is not a boolean" % var in proc.stderr
    assert "Traceback" not in proc.stderr


def test_output_cut_short_by_the_reader_is_not_a_traceback(make_env):
    cli = subprocess.Popen([os.path.join(BIN, "npu-shim"), "status", "--json"], env=make_env(),
                           stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    cli.stdout.close()          # the reader is gone before the CLI (~100 ms to start) writes
    stderr = cli.stderr.read().decode()
    assert cli.wait(timeout=60) == 141, stderr
    assert "Traceback" not in stderr and "BrokenPipeError" not in stderr, stderr
