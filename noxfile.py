"""Pinned-version regression lanes (nox).

    nox                          every lane, then one table over all of them
    nox -s "lane(kimi-vl-2025)"  one lane
    nox -s lanes                 same as plain ``nox``
    nox -l                       list the sessions
    nox -s "bench(startup)"      one benchmark (never part of plain ``nox``), in its lane's venv

Each lane is a fresh virtual environment (Python 3.11) holding the exact upstream wheels
pinned in ``lanes/<lane>.txt``, installed with ``pip install --no-deps`` (the pin files
name every package, so pip resolves nothing and never pulls a CUDA torch), then the shim
itself (``pip install --no-deps .``). ``lanes/report.py`` runs pytest with
``NPU_SHIM_LANE=<lane>`` (tests/conftest.py selects that lane's tests), writes
``.nox/reports/<lane>/junit.xml``, prints the lane table (patch x state x reason x tests
passed) and fails the session if pytest failed or ran no test.

Per-lane environment (the reasons are in each pin file's header):
- ``VLLM_PLUGINS=npu_shim`` in lanes with vLLM: vLLM loads only the plugins named there, so
  vllm-ascend's "ascend" platform plugin (which imports torch_npu.npu.*) stays off and
  vLLM keeps its non-NPU platform, while the shim's own vllm.general_plugins entry runs.
- ``PYTHONPATH=tests/placeholders`` in sglang lanes: the import placeholder for
  ``sgl_kernel_npu`` (NPU-only, not on the package index, never called by the tested path),
  which sglang's Ascend attention backend imports at module top.
- ``NPU_SHIM_EMULATE`` is not set for pytest: tests that need torch_npu install the
  emulation themselves (and some check the default). report.py sets it to 1 only for
  ``npu-shim status --import``, which imports the targets, some of which import torch_npu.
"""
import os
import re
import shutil
import sys
import time

import nox

nox.options.sessions = ["lanes"]
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True

PYTHON = "3.11"
HERE = os.path.dirname(os.path.abspath(__file__))
REPORTS = os.path.join(HERE, ".nox", "reports")
PLACEHOLDERS = os.path.join(HERE, "tests", "placeholders")

VLLM_ENV = {"VLLM_PLUGINS": "npu_shim"}
SGLANG_ENV = {"PYTHONPATH": PLACEHOLDERS}

# lane name -> extra environment for its tests; the pins are in lanes/<lane>.txt.
LANES = {
    "base": {},
    "kimi-vl-2025": VLLM_ENV,
    "vllm-0.13": VLLM_ENV,
    "vllm-0.14": VLLM_ENV,
    "vllm-0.15": VLLM_ENV,
    "vllm-0.18": VLLM_ENV,
    "vllm-0.21": VLLM_ENV,
    "vllm-0.22": VLLM_ENV,
    "sglang-0.5.12": SGLANG_ENV,
    "sglang-0.5.13": SGLANG_ENV,
    "sglang-0.5.16": SGLANG_ENV,
    "sglang-0.5.19": SGLANG_ENV,
    "sglang-0.5.21": SGLANG_ENV,
    # "latest" is split: one venv cannot honour the pins of both vllm 0.26.0 (the pair of the
    # newest vllm-ascend wheel) and sglang 0.5.23 (torch, compressed-tensors, transformers;
    # see the two pin files).
    "latest-vllm": VLLM_ENV,
    "latest-sglang": SGLANG_ENV,
}


@nox.session(python=PYTHON)
@nox.parametrize("lane", [nox.param(name, id=name) for name in LANES])
def lane(session, lane):
    """One pinned stack: fresh venv, exact wheels, the lane's tests, the lane table."""
    started = time.monotonic()
    # --no-compile: pip would byte-compile every module of torch, vLLM and sglang (30-60 s a
    # lane on 2 cores); the tests import a fraction of them, compiled on first import and
    # written then (PYTHONDONTWRITEBYTECODE is cleared for the lane's tests below: without
    # bytecode, each of their subprocesses would compile vLLM again).
    session.install("--no-deps", "--no-compile", "-r", os.path.join("lanes", lane + ".txt"))
    session.install("--no-deps", ".")
    install_seconds = time.monotonic() - started
    session.log("lane %s: installed in %.0f s", lane, install_seconds)
    session.run(
        "python",
        os.path.join("lanes", "report.py"),
        "run",
        "--lane",
        lane,
        "--out",
        os.path.join(REPORTS, lane),
        "--install-seconds",
        "%.1f" % install_seconds,
        "--",
        "-q",
        "-p",
        "no:cacheprovider",
        env=dict(LANES[lane], PYTHONDONTWRITEBYTECODE=""),
    )


@nox.session(python=False, requires=["lane({})".format(name) for name in LANES])
def lanes(session):
    """Every lane (run first, as requirements), then one table over all their reports."""
    session.run(sys.executable, os.path.join("lanes", "report.py"), "summary", REPORTS, *LANES, external=True)


# benchmark -> (lane or lanes whose venv it runs in, extra environment). The venv is the
# lane's own (.nox/lane-<lane>, made by `nox -s "lane(<lane>)"`); a bench session makes it if
# missing. bench_mm_encoder prints one table per vllm-ascend release: it runs in each;
# bench_cp_fia measures 0.5.13's fixed method and 0.5.23's strategy closure.
BENCHMARKS = {
    "startup": ("kimi-vl-2025", {"VLLM_PLUGINS": ""}),
    "stats": ("base", {}),
    "varlen_memory": ("base", {}),
    "moonvit": ("kimi-vl-2025", {"NPU_SHIM_EMULATE": "1", "VLLM_PLUGINS": "npu_shim"}),
    "mm_encoder": (("vllm-0.13", "vllm-0.14", "vllm-0.15", "vllm-0.18", "vllm-0.21", "vllm-0.22",
                    "latest-vllm"), {"NPU_SHIM_EMULATE": "1", "VLLM_PLUGINS": ""}),
    "cp_fia": (("sglang-0.5.13", "latest-sglang"), {"NPU_SHIM_EMULATE": "1", "PYTHONPATH": PLACEHOLDERS}),
}


def lane_venv(lane):
    """The directory nox gives the venv of session "lane(<lane>)"."""
    return os.path.join(HERE, ".nox", re.sub(r"[^\w-]", "-", "lane-" + lane))


@nox.session(python=False, default=False)
@nox.parametrize("name", [nox.param(name, id=name) for name in BENCHMARKS])
def bench(session, name):
    """One benchmark, one command from a fresh clone: reuses (or makes) its lanes' venvs,
    installs this checkout into it, runs benchmarks/bench_<name>.py (extra args after --)."""
    lanes, env = BENCHMARKS[name]
    for lane in (lanes,) if isinstance(lanes, str) else lanes:
        python = _lane_python(session, lane)
        # Bytecode written on first import, as in the lanes (the venvs are installed without it).
        session.run(python, os.path.join("benchmarks", "bench_%s.py" % name), *session.posargs,
                    env=dict(env, PYTHONDONTWRITEBYTECODE=""), external=True)


def _lane_python(session, lane):
    """The python of the lane's venv, made if missing, holding the pins and this checkout."""
    venv = lane_venv(lane)
    python = os.path.join(venv, "bin", "python")
    if not os.path.exists(python):
        interpreter = shutil.which("python" + PYTHON)
        if interpreter is None:
            session.error("python%s not found on PATH; the lanes need CPython %s" % (PYTHON, PYTHON))
        session.run(interpreter, "-m", "venv", venv, external=True)
    # Pinned, --no-deps: a venv that already holds the pins is checked in seconds.
    session.run(python, "-m", "pip", "install", "--quiet", "--no-deps", "--no-compile", "-r",
                os.path.join("lanes", lane + ".txt"), external=True)
    session.run(python, "-m", "pip", "install", "--quiet", "--no-deps", ".", external=True)
    return python

