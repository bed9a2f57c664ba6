"""Start-up cost of the shim.

1. An unrelated process: ``python -c pass`` bare vs. with the checkout on
   PYTHONPATH (the shim's sitecustomize runs), interleaved, median of N runs.
   Bound: within 1 ms of bare Python.
2. A process that imports a patched framework (default: vLLM's MoonViT
   module, when vLLM is installed): the same import with the shim switched
   off (NPU_SHIM=0) and on, interleaved, plus the shim's own accounting of the
   time it spent (machinery load + deciding/applying patches). Bound: the
   shim's own time under 3 % of the import.

    python benchmarks/bench_startup.py [--runs 30] [--import-runs 5] [--module M]
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


def wall(argv, env):
    started = time.perf_counter()
    subprocess.run(argv, env=env, check=True, stdout=subprocess.DEVNULL)
    return time.perf_counter() - started


def interleaved(cases, runs):
    """Run each case once per round, rounds alternating order; medians in seconds."""
    samples = {name: [] for name in cases}
    names = list(cases)
    for i in range(runs):
        for name in names if i % 2 == 0 else reversed(names):
            argv, env = cases[name]
            samples[name].append(wall(argv, env))
    return {name: statistics.median(values) for name, values in samples.items()}


def compile_shim():
    """Byte-compile the checkout, as any install or first run does.

    (This machine sets PYTHONDONTWRITEBYTECODE=1; without .pyc files every run
    would recompile the shim's sources and measure the compiler, not the shim.)
    """
    import compileall

    compileall.compile_dir(os.path.join(REPO, "npu_shim"), quiet=1)
    compileall.compile_file(os.path.join(REPO, "sitecustomize.py"), quiet=1)


def bench_unrelated(runs):
    compile_shim()
    cases = {
        "bare": ([sys.executable, "-c", "pass"], clean_env()),
        "shim": ([sys.executable, "-c", "pass"], clean_env(PYTHONPATH=REPO)),
    }
    for argv, env in cases.values():  # warm the page cache and .pyc files
        wall(argv, env)
    med = interleaved(cases, runs)
    added_ms = (med["shim"] - med["bare"]) * 1e3
    print("unrelated process (python -c pass), median of %d interleaved runs:" % runs)
    print("  bare Python            %7.2f ms" % (med["bare"] * 1e3))
    print("  with shim on PYTHONPATH %6.2f ms" % (med["shim"] * 1e3))
    print("  added by the shim      %+7.2f ms   (bound: <= 1 ms)  %s" % (added_ms, "OK" if added_ms <= 1.0 else "OVER"))
    return added_ms <= 1.0


ACCOUNTING = """
import json, sys, time
t0 = time.perf_counter()
import {module}
total = time.perf_counter() - t0
from npu_shim import _machinery as m
rows = m.status()
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
    parser.add_argument("--runs", type=int, default=30)
    parser.add_argument("--import-runs", type=int, default=5)
    parser.add_argument("--module", default="vllm.model_executor.models.moonvit")
    args = parser.parse_args()
    ok = bench_unrelated(args.runs)
    ok = bench_framework(args.module, args.import_runs) and ok
    print("reproduce: python benchmarks/bench_startup.py --runs %d --import-runs %d --module %s"
          % (args.runs, args.import_runs, args.module))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
