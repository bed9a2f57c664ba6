"""Start-up cost of the shim.

1. An unrelated process: ``python -c pass`` bare vs. with the shim's checkout
   on PYTHONPATH (its sitecustomize runs), in both bytecode modes side by side:
   with .pyc files (an installed shim, a checkout that ran once) and without
   (PYTHONDONTWRITEBYTECODE=1, as containers and CI images set it: every start
   compiles the start-up path). Interleaved, median of N runs. Bound: within
   1 ms of bare Python in both modes. Without .pyc, CPython's first builtin
   compile() in a process also initialises the AST node types (``import _ast``,
   about 2 ms here), a fixed cost of any sitecustomize without bytecode that
   bare ``python -c pass`` never pays.
2. A process that imports a patched framework (default: vLLM's MoonViT
   module, when vLLM is installed): the same import with the shim switched
   off (NPU_SHIM=0) and on, interleaved, plus the shim's own accounting of the
   time it spent (machinery load + deciding/applying patches). Bound: the
   shim's own time under 3 % of the import.

    nox -s "bench(startup)"     (from a fresh clone: makes or reuses the lane's venv)
    python benchmarks/bench_startup.py [--runs 60] [--import-runs 5] [--module M]
"""
import argparse
import importlib.util
import json
import os
import statistics
import subprocess
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def clean_env(**extra):
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("NPU_SHIM")}
    env.update(extra)
    return env


def wall(argv, env, cpu=None):
    """Wall seconds of one run; its CPU seconds (user + sys) are appended to ``cpu``."""
    started = time.perf_counter()
    child = subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL)
    _, status, usage = os.wait4(child.pid, 0)
    elapsed = time.perf_counter() - started
    if status != 0:
        raise subprocess.CalledProcessError(status, argv)
    if cpu is not None:
        cpu.append(usage.ru_utime + usage.ru_stime)
    return elapsed


def interleaved(cases, runs, cpu_medians=None):
    """Run each case once per round, rounds alternating order; medians in seconds.

    ``cpu_medians`` (a dict) receives the median CPU seconds per case: on a shared,
    loaded machine the CPU time of the child is steadier than its wall time.
    """
    samples = {name: [] for name in cases}
    cpu = {name: [] for name in cases}
    names = list(cases)
    for i in range(runs):
        for name in names if i % 2 == 0 else reversed(names):
            argv, env = cases[name]
            samples[name].append(wall(argv, env, cpu[name]))
    if cpu_medians is not None:
        cpu_medians.update({name: statistics.median(values) for name, values in cpu.items()})
    return {name: statistics.median(values) for name, values in samples.items()}


def shim_copy(where, bytecode):
    """The checkout's start-up files copied to ``where``, with or without .pyc files.

    A checkout on PYTHONPATH under PYTHONDONTWRITEBYTECODE=1 (containers, CI
    images; this machine sets it) never gets .pyc files: every start compiles the
    shim's sources. An installed shim, or a checkout run once without that
    variable, has them. Both copies are run with PYTHONDONTWRITEBYTECODE=1, so
    neither changes during the benchmark.
    """
    import compileall
    import shutil

    shutil.copytree(os.path.join(REPO, "npu_shim"), os.path.join(where, "npu_shim"),
                    ignore=shutil.ignore_patterns("__pycache__", "*.pyc"))
    shutil.copy(os.path.join(REPO, "sitecustomize.py"), where)
    if bytecode:
        compileall.compile_dir(os.path.join(where, "npu_shim"), quiet=1)
        compileall.compile_file(os.path.join(where, "sitecustomize.py"), quiet=1)
    return where


def bench_unrelated(runs):
    import tempfile

    with tempfile.TemporaryDirectory() as tmp:
        with_pyc = shim_copy(os.path.join(tmp, "bytecode"), bytecode=True)
        source_only = shim_copy(os.path.join(tmp, "source"), bytecode=False)
        quiet = {"PYTHONDONTWRITEBYTECODE": "1"}
        cases = {
            "bare": ([sys.executable, "-c", "pass"], clean_env(**quiet)),
            "bytecode": ([sys.executable, "-c", "pass"], clean_env(PYTHONPATH=with_pyc, **quiet)),
            "source": ([sys.executable, "-c", "pass"], clean_env(PYTHONPATH=source_only, **quiet)),
        }
        for argv, env in cases.values():  # warm the page cache
            wall(argv, env)
        cpu = {}
        med = interleaved(cases, runs, cpu)
    load = os.getloadavg()[0]
    print("unrelated process (python -c pass), median of %d interleaved runs (load average %.1f on %d cores):"
          % (runs, load, os.cpu_count()))
    print("  %-33s %9s %18s %9s %18s" % ("", "wall", "added (ratio)", "CPU", "added (ratio)"))
    print("  %-33s %6.2f ms %18s %6.2f ms" % ("bare Python", med["bare"] * 1e3, "", cpu["bare"] * 1e3))
    ok = True
    for mode, label in (("bytecode", "shim on PYTHONPATH, with .pyc"),
                        ("source", "shim on PYTHONPATH, no .pyc")):
        added = (med[mode] - med["bare"]) * 1e3
        added_cpu = (cpu[mode] - cpu["bare"]) * 1e3
        ok = ok and added <= 1.0
        print("  %-33s %6.2f ms %+8.2f ms (x%.3f) %6.2f ms %+8.2f ms (x%.3f)  wall bound <= +1 ms: %s"
              % (label, med[mode] * 1e3, added, med[mode] / med["bare"], cpu[mode] * 1e3, added_cpu,
                 cpu[mode] / cpu["bare"], "OK" if added <= 1.0 else "OVER"))
    if load > os.cpu_count():
        print("  (the machine is oversubscribed: every figure is inflated; compare the ratios)")
    return ok


ACCOUNTING = """
import json, sys, time
t0 = time.perf_counter()
import {module}
total = time.perf_counter() - t0
import npu_shim
from npu_shim.engine import registry as m
rows = npu_shim.status()
print(json.dumps({{"total": total, "load": m.load_seconds,
                  "patches": sum(r["seconds"] for r in rows),
                  "states": {{r["name"]: r["state"] for r in rows}}}}))
"""


def bench_framework(module, runs):
    if importlib.util.find_spec(module.partition(".")[0]) is None:
        print("framework import: %s is not installed here; run this in a lane with it (nox -s 'lane(kimi-vl-2025)')" % module)
        return True
    argv = [sys.executable, "-c", "import " + module]
    emulate = {"NPU_SHIM_EMULATE": "1", "VLLM_PLUGINS": ""}
    cases = {
        "off": (argv, clean_env(PYTHONPATH=REPO, NPU_SHIM="0", **emulate)),
        "on": (argv, clean_env(PYTHONPATH=REPO, **emulate)),
    }
    wall(*cases["on"])
    med = interleaved(cases, runs)
    proc = subprocess.run(
        [sys.executable, "-c", ACCOUNTING.format(module=module)],
        env=clean_env(PYTHONPATH=REPO, **emulate), capture_output=True, text=True, check=True,
    )
    acct = json.loads(proc.stdout.strip().splitlines()[-1])
    own = acct["load"] + acct["patches"]
    share = own / acct["total"] * 100
    print("framework process (import %s), median of %d interleaved runs:" % (module, runs))
    print("  shim off (NPU_SHIM=0)  %8.3f s" % med["off"])
    print("  shim on                %8.3f s   (difference %+.3f s, %+.2f %%, run-to-run noise included)"
          % (med["on"], med["on"] - med["off"], (med["on"] - med["off"]) / med["off"] * 100))
    print("  shim's own time        %8.3f s   = machinery %.3f s + patches %.3f s"
          % (own, acct["load"], acct["patches"]))
    print("  share of the import    %8.2f %%   (bound: < 3 %%)  %s" % (share, "OK" if share < 3 else "OVER"))
    print("  patch states: %s" % ", ".join("%s=%s" % kv for kv in acct["states"].items()))
    return share < 3


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=60)
    parser.add_argument("--import-runs", type=int, default=5)
    parser.add_argument("--module", default="vllm.model_executor.models.moonvit")
    args = parser.parse_args()
    ok = bench_unrelated(args.runs)
    ok = bench_framework(args.module, args.import_runs) and ok
    print('reproduce: nox -s "bench(startup)" -- --runs %d --import-runs %d --module %s'
          % (args.runs, args.import_runs, args.module))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
