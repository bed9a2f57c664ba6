"""sglang's engine started in a child process on the emulated device, as the text engine tests
(tests/lanes/test_engine_sglang*.py) start it: sglang_support/engine_case.py with the test's prompts,
in an environment of the emulated device (1 GiB of device memory, the shim on or off, the import
placeholders first on ``PYTHONPATH``; ``engine_support.tiny.child_env``); a hang fails the test."""
import glob
import json
import os
import re
import sys

from engine_support import tiny

_LANES_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PLACEHOLDERS = os.path.join(os.path.dirname(os.path.dirname(_LANES_DIR)), "tests", "placeholders")
CASE = os.path.join(_LANES_DIR, "sglang_support", "engine_case.py")
# sglang sizes its KV cache as a fraction of the device's free memory, and the emulated device's memory is
# host memory (the default 64 GiB card would take 32 GiB of host RAM)
DEVICE_MEMORY_MIB = "1024"


def child_env(shim_on, **extra):
    """The engine child's environment (``tiny.child_env``) with the placeholders and the device memory."""
    return tiny.child_env(shim_on, pythonpath=[PLACEHOLDERS], NPU_SHIM_EMULATE_DEVICE_MEMORY_MIB=DEVICE_MEMORY_MIB,
                          **extra)


def run(model_dir, tmp_path, shim_on, spec, *, timeout_s=300, what="sglang.Engine", **env):
    """engine_case.py on ``model_dir`` with ``spec`` (a list of prompts, or ``{"rounds", "server"}``)
    written to ``tmp_path``, generating ``tiny.MAX_NEW`` tokens a prompt; ``env`` added to the child's
    environment. Returns (returncode, stdout + stderr)."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(spec))
    return tiny.run_child([sys.executable, CASE, model_dir, str(prompts), str(tiny.MAX_NEW)],
                          child_env(shim_on, **env), str(tmp_path), timeout_s, what)


def run_recorded(model_dir, tmp_path, shim_on, spec, *, timeout_s=300, **env):
    """:func:`run` with ``ENGINE_CASE_OPS_DIR`` set (engine_case.record_ops: each of the engine's
    processes writes its emulated op calls and the shim's counters). Returns (returncode, stdout +
    stderr, ``{op: calls}`` summed over the processes, ``{patch: {"family", "calls", ...}}``)."""
    ops_dir = tmp_path / "ops"
    ops_dir.mkdir()
    rc, output = run(model_dir, tmp_path, shim_on, spec, timeout_s=timeout_s, ENGINE_CASE_OPS_DIR=str(ops_dir), **env)
    recorded = [json.loads(open(path).read()) for path in glob.glob(str(ops_dir / "ops-*.json"))]
    ops = {}
    for record in recorded:
        for name, calls in record["ops"].items():
            ops[name] = ops.get(name, 0) + calls
    shim = {name: row for record in recorded for name, row in record["shim"].items()}
    return rc, output, ops, shim


def kv_sizes(output, kind=""):
    """The K and V sizes (GB) of the last ``<kind>KV Cache is allocated`` line of sglang's log
    (``kind``: "" for the plain pool, "Full " / "SWA " for the hybrid pool's)."""
    found = re.findall(r"%sKV Cache is allocated\. dtype: \S+, #tokens: \d+, K size: ([\d.]+) GB, V size: ([\d.]+) GB"
                       % kind, output)
    assert found, output[-3000:]
    return tuple(float(x) for x in found[-1])
