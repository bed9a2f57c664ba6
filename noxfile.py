"""Pinned-version regression lanes (nox, uv).

    nox                          every lane, then one table over all of them
    nox -s "lane(kimi-vl-2025)"  one lane
    nox -s lanes                 same as plain ``nox``: the lanes, one per core at a time
    nox -s lanes -- base vllm-0.18   only these lanes (same scheduling and table)
    nox -l                       list the sessions
    nox -s probe -- vllm-ascend==0.31.0rc1   a release that has no lane yet (see probe())
    nox -s "bench(startup)"      one benchmark (never part of plain ``nox``), in its lane's venv

Needs ``nox`` and ``uv`` on the runner (``pip install nox uv``; .ci/run pins both).

Lane contract (read by this file and by the reference-docs generator; keep it exact)
------------------------------------------------------------------------------------
A lane is one file ``lanes/<lane>.txt`` (files starting with ``_`` are includes, not lanes);
adding a release is adding one file. Its leading comment block holds, one per line:

    # Lane <name>: <one-line description>           first line; <name> is the file's stem
    # Stands for: <dist> <version>[, <version>...][; <dist> <version>...]
                                                    every upstream release the lane stands for
    # Kind: base | vllm | sglang                    the lane's environment, below
    # Python: 3.11                                  CPython minor version of the venv
    # Sdist: <dist>==<version>                      optional, repeatable: a release published
                                                    only as a source archive, installed as the
                                                    wheel its own build makes (lanes/sdist.py)
    # Thin: <dist>                                  optional, repeatable: that dist's pinned
                                                    wheel is installed as its thin copy
                                                    (lanes/thin.py: CUDA extensions left out)
    # Tests of: <lane>                              optional: run that lane's tests
                                                    (NPU_SHIM_LANE=<lane>), e.g. lane base on
                                                    another Python; default: its own name
    # Expected skip: <text>                         optional, repeatable: a test of this lane
                                                    may skip when its message contains <text>;
                                                    any other skip fails the lane

then free prose (why each pin), then the requirement lines: every package pinned with ``==``
(``-r _x.txt`` includes allowed), installed with ``uv pip install --no-deps`` (nothing is
resolved, no CUDA torch is pulled in behind the pins' back), then the shim itself
(``uv pip install --no-deps .``). ``lanes/report.py`` runs pytest with ``NPU_SHIM_LANE=<lane>``
(tests/conftest.py selects the tests whose ``pytest.mark.lanes(...)`` names the lane), writes
``.nox/reports/<lane>/``, prints the lane table (patch x state x reason x tests passed, install
and test seconds) and fails the session if pytest failed or ran no test. On the lanes
``lanes/upstream_tests.py`` names, it then runs upstream's own unit tests of the patched classes,
from the release's source archive (fetched here, ``upstream_archive``), against the declared
differences there.

Environment per Kind (the reasons are in the pin files):
- ``vllm``: ``VLLM_PLUGINS=npu_shim``: vLLM loads only the plugins named there, so
  vllm-ascend's "ascend" platform plugin (which imports torch_npu.npu.*) stays off and
  vLLM keeps its non-NPU platform, while the shim's own vllm.general_plugins entry runs.
- ``sglang``: ``PYTHONPATH=tests/placeholders``: the import placeholder for
  ``sgl_kernel_npu`` (NPU-only, not on the package index, never called by the tested path),
  which sglang's Ascend attention backend imports at module top; and one for ``torchair``
  (NPU-only graph compiler, built by sglang's engine at import, never compiling: engines run eager).
- ``base``: nothing.
``NPU_SHIM_EMULATE`` is not set for pytest: tests that need torch_npu install the emulation
themselves (and some check the default). report.py sets it to 1 only for
``npu-shim status --import``, which imports the targets, some of which import torch_npu.

Package sources: uv reads none of pip's configuration, so the index settings pip would use on
this machine (``pip config get global.index-url`` / ``global.extra-index-url`` /
``global.find-links`` and the PIP_* variables) are handed to ``uv pip install`` as flags at
run time (uv_source_args); file:// or local locations that do not exist are left out, as pip
ignores them. uv installs from its cache by hardlink: a second lane with the same torch costs
megabytes, not gigabytes.
"""
import concurrent.futures
import functools
import glob
import os
import re
import shutil
import subprocess
import sys
import time

import nox

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "lanes"))
from _sources import uv_source_args  # noqa: E402  (shared with lanes/sdist.py's build venv)
import mutants as mutant_table  # noqa: E402  (lanes/mutants.py: the mutants of nox -s mutants)
import upstream_tests  # noqa: E402  (lanes/upstream_tests.py: upstream's unit tests, which lanes run them)

nox.options.sessions = ["lanes"]
nox.options.reuse_existing_virtualenvs = False
nox.options.error_on_missing_interpreters = True

STARTED = time.time()  # nox imports this file once, before the first session: the run's start
HERE = os.path.dirname(os.path.abspath(__file__))
LANES_DIR = os.path.join(HERE, "lanes")
REPORTS = os.path.join(HERE, ".nox", "reports")
# pycs shared between the lanes (lanes/report.py: seed_bytecode, keep_bytecode); emptied at the
# start of each `nox -s lanes` run, so it holds what this run's lanes compiled
BYTECODE = os.path.join(HERE, ".nox", "bytecode")
# the lanes of the tests' pytest.mark.claimed, computed once for all lanes (tests/conftest.py, _selection_cache)
SELECTION_CACHE = os.path.join(HERE, ".nox", "test-selection")
PLACEHOLDERS = os.path.join(HERE, "tests", "placeholders")

KIND_ENV = {
    "base": {},
    "vllm": {"VLLM_PLUGINS": "npu_shim"},
    "sglang": {"PYTHONPATH": PLACEHOLDERS},
}
HEADER_KEYS = {"Stands for": "stands_for", "Kind": "kind", "Python": "python", "Sdist": "sdist",
               "Thin": "thin", "Tests of": "tests_of", "Expected skip": "expected_skips"}
REPEATABLE = ("sdist", "thin", "expected_skips")


def read_lane(path):
    """The header of one pin file: {name, description, stands_for, kind, python, sdist: [...]}."""
    name = os.path.splitext(os.path.basename(path))[0]
    lane = {"name": name, "path": path, "sdist": [], "thin": [], "expected_skips": []}
    with open(path, encoding="utf-8") as handle:
        lines = handle.read().splitlines()
    first = re.match(r"# Lane (\S+): (.+)$", lines[0] if lines else "")
    if not first or first.group(1) != name:
        raise ValueError("%s: the first line must be '# Lane %s: <description>'" % (path, name))
    lane["description"] = first.group(2)
    for line in lines[1:]:
        if not line.startswith("#"):
            break
        match = re.match(r"# (%s): (.+)$" % "|".join(HEADER_KEYS), line)
        if match:
            key, value = HEADER_KEYS[match.group(1)], match.group(2).strip()
            if key in REPEATABLE:
                lane[key].append(value)
            else:
                lane[key] = value
    for key in ("stands_for", "kind", "python"):
        if key not in lane:
            raise ValueError("%s: no '# %s:' line in the header" % (path, [k for k, v in HEADER_KEYS.items() if v == key][0]))
    if lane["kind"] not in KIND_ENV:
        raise ValueError("%s: Kind %r is none of %s" % (path, lane["kind"], ", ".join(KIND_ENV)))
    return lane


def read_lanes():
    paths = sorted(p for p in glob.glob(os.path.join(LANES_DIR, "*.txt")) if not os.path.basename(p).startswith("_"))
    return {lane["name"]: lane for lane in map(read_lane, paths)}


LANES = read_lanes()


@functools.lru_cache(maxsize=None)
def interpreter(version):
    """A CPython ``version`` interpreter: ``python<version>`` on PATH if it runs (a pyenv shim
    of a version that is not selected does not), else pyenv's newest ``version``; else the bare
    version string (nox then reports it missing)."""
    candidates = [shutil.which("python" + version)]
    try:
        prefix = subprocess.run(["pyenv", "prefix", version], capture_output=True, text=True).stdout.strip()
    except OSError:
        prefix = ""
    if prefix:
        candidates.append(os.path.join(prefix.splitlines()[0], "bin", "python" + version))
    for candidate in candidates:
        if candidate and os.path.exists(candidate):
            probe = subprocess.run([candidate, "-c", "import sys; print('%d.%d' % sys.version_info[:2])"],
                                   capture_output=True, text=True)
            if probe.returncode == 0 and probe.stdout.strip() == version:
                return candidate
    return version


def _requirement_name(line):
    """The normalized dist name a requirement line pins ("" for comments, options, blanks)."""
    if not line or line.startswith(("#", "-")):
        return ""
    return re.split(r"[=<>!~ \[;@]", line, 1)[0].lower().replace("_", "-").replace(".", "-")


def requirement_lines(path):
    """The lines of the pin file ``path`` with its ``-r`` includes inlined, comments cut."""
    lines = []
    with open(path, encoding="utf-8") as handle:
        for line in handle:
            line = line.split(" #", 1)[0].strip()
            if line.startswith("-r "):
                lines += requirement_lines(os.path.join(os.path.dirname(path), line[3:].strip()))
            else:
                lines.append(line)
    return lines


def lane_requirements(lane, directory, swap=None):
    """The lane's requirements as one file ``directory``/requirements.txt for ``uv pip install
    -r``: includes inlined, each pin of a "# Thin:" dist replaced by the path of its thin wheel
    (lanes/thin.py), each "# Sdist:" release added as the path of the wheel built from its
    archive (lanes/sdist.py), and each dist in ``swap`` ({name: "name==version"}) pinned as given
    there instead (the probe). Returns the file's path."""
    swap = {_requirement_name(name): line for name, line in (swap or {}).items()}
    thin = {_requirement_name(name) for name in lane["thin"]}
    lines = [line for line in requirement_lines(lane["path"]) if _requirement_name(line) not in swap]
    lines += swap.values()
    pinned = {_requirement_name(line): line for line in lines if _requirement_name(line)}
    for name in sorted(thin):
        if name not in pinned or "==" not in pinned[name]:
            raise ValueError("%s: '# Thin: %s' names no 'name==version' pin of the lane" % (lane["path"], name))
        version = pinned[name].split("==", 1)[1].strip()
        wheel = subprocess.run([sys.executable, os.path.join(LANES_DIR, "thin.py"), "wheel", name, version],
                               check=True, capture_output=True, text=True).stdout.strip()
        lines[lines.index(pinned[name])] = wheel
    for requirement in lane["sdist"]:
        name, version = requirement.split("==")
        lines.append(subprocess.run([sys.executable, os.path.join(LANES_DIR, "sdist.py"), "wheel", name, version],
                                    check=True, stdout=subprocess.PIPE, text=True).stdout.strip())
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, "requirements.txt")
    with open(path, "w", encoding="utf-8") as handle:
        handle.write("\n".join(line for line in lines if line and not line.startswith("#")) + "\n")
    return path


def install_lane(session, lane):
    """The lane's pins (uv, --no-deps; thin wheels and sdist-built wheels where the header
    says), then the shim."""
    env = {"UV_PYTHON_DOWNLOADS": "never"}
    requirements = lane_requirements(lane, session.virtualenv.location)
    session.install("--no-deps", *uv_source_args(), "-r", requirements, env=env)
    session.install("--no-deps", *uv_source_args(), ".", env=env)


# --no-compile is uv's default (pip byte-compiled every module of torch, vLLM and sglang: 30-60 s
# a lane on 2 cores); the tests import a fraction of them, compiled on first import and written
# then (PYTHONDONTWRITEBYTECODE is cleared for the lane's tests below: without bytecode, each of
# their subprocesses would compile vLLM again), and kept in .nox/bytecode for the next lanes that
# have the same files (--bytecode-store; lanes/report.py, seed_bytecode and keep_bytecode).
@nox.session(venv_backend="uv")
@nox.parametrize(["python", "lane"],
                 [nox.param(interpreter(spec["python"]), name, id=name) for name, spec in LANES.items()])
def lane(session, lane):
    """One pinned stack: fresh venv, exact wheels, the lane's tests, the lane table."""
    spec = LANES[lane]
    started = time.monotonic()
    install_lane(session, spec)
    install_seconds = time.monotonic() - started
    session.log("lane %s: installed in %.0f s", lane, install_seconds)
    archive = upstream_archive(lane)
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
        "--tests-of",
        spec.get("tests_of", lane),
        "--stands-for",
        spec["stands_for"],
        "--bytecode-store",
        BYTECODE,
        *(["--variant"] if "tests_of" in spec else []),
        *[argument for text in spec["expected_skips"] for argument in ("--expected-skip", text)],
        *(["--upstream-archive", archive] if archive else []),
        "--",
        "-q",
        "-p",
        "no:cacheprovider",
        env=dict(KIND_ENV[spec["kind"]], PYTHONDONTWRITEBYTECODE="", NPU_SHIM_TEST_SELECTION_CACHE=SELECTION_CACHE),
    )


def upstream_archive(lane):
    """The cached source archive (lanes/sdist.py fetch: pip's index client, which nox's Python
    has and the lane's venv does not) of the release whose unit tests the lane runs
    (lanes/upstream_tests.py LANES), or None; lanes/report.py checks its sha256 and runs them."""
    release = upstream_tests.lane_release(lane)
    if release is None:
        return None
    return subprocess.run([sys.executable, os.path.join(LANES_DIR, "sdist.py"), "fetch", *release],
                          check=True, stdout=subprocess.PIPE, text=True).stdout.strip()


def lane_jobs():
    """How many lanes run at once: ``$NPU_SHIM_LANE_JOBS``, else one per CPU core. A lane is
    one pytest process (and short-lived subprocesses of it) that keeps about one core busy, so
    one per core comes close to halving the wall time (the figures of the last recorded run
    are in benchmarks/results/ci-lanes.txt)."""
    value = os.environ.get("NPU_SHIM_LANE_JOBS", "")
    if value:
        if not value.isdigit() or int(value) < 1:
            raise ValueError("NPU_SHIM_LANE_JOBS=%r: give a whole number of lanes, 1 or more" % value)
        return int(value)
    return os.cpu_count() or 1


def recorded_costs(path=os.path.join(HERE, "benchmarks", "results", "ci-lanes.txt")):
    """{lane: install + test seconds} from the last recorded CI table; {} if there is none."""
    costs = {}
    try:
        with open(path, encoding="utf-8") as handle:
            for line in handle:
                words = line.split()
                if len(words) >= 4 and words[0] in LANES and words[2].isdigit() and words[3].isdigit():
                    costs[words[0]] = int(words[2]) + int(words[3])
    except OSError:
        pass
    return costs


def schedule(names, costs):
    """Longest first (a lane with no recorded cost counts as the longest): with a fixed number
    of workers, the last lane to start is a short one, so no core idles at the end."""
    longest = max(costs.values(), default=0) + 1
    return sorted(names, key=lambda name: (-costs.get(name, longest), name))


def run_lanes(session, names, jobs):
    """Each lane as its own ``nox -s "lane(<name>)"`` process, ``jobs`` at a time; a lane's
    output goes to .nox/logs/<lane>.log and is printed whole when the lane ends (never
    interleaved). Torch's intra-op threads are split between the lanes running at once."""
    logs = os.path.join(HERE, ".nox", "logs")
    os.makedirs(logs, exist_ok=True)
    env = dict(os.environ)
    threads = str(max(1, (os.cpu_count() or 1) // jobs))
    for variable in ("OMP_NUM_THREADS", "MKL_NUM_THREADS"):
        env.setdefault(variable, threads)
    pending = list(names)
    running = {}
    failed = []
    while pending or running:
        while pending and len(running) < jobs:
            name = pending.pop(0)
            log = open(os.path.join(logs, name + ".log"), "w", encoding="utf-8")
            command = [sys.executable, "-m", "nox", "-f", os.path.join(HERE, "noxfile.py"),
                       "-s", "lane({})".format(name)]
            running[name] = (subprocess.Popen(command, cwd=HERE, env=env, stdout=log, stderr=subprocess.STDOUT),
                             log, time.monotonic())
            session.log("lane %s: started (%d running, %d waiting)", name, len(running), len(pending))
        time.sleep(0.5)
        for name, (process, log, started) in list(running.items()):
            if process.poll() is None:
                continue
            log.close()
            del running[name]
            with open(log.name, encoding="utf-8", errors="replace") as handle:
                print(handle.read(), end="", flush=True)
            verdict = "passed" if process.returncode == 0 else "FAILED (exit %d)" % process.returncode
            session.log("lane %s: %s in %.0f s (log: %s)", name, verdict, time.monotonic() - started,
                        os.path.relpath(log.name, HERE))
            if process.returncode != 0:
                failed.append(name)
    return failed


@nox.session(python=False)
def lanes(session):
    """Every lane (or those named: ``nox -s lanes -- base vllm-0.18``), ``lane_jobs()`` at a
    time, longest first, then one table over their reports; fails if any lane failed, after
    the table."""
    unknown = [name for name in session.posargs if name not in LANES]
    if unknown:
        session.error("no lane named %s (nox -l lists them)" % ", ".join(unknown))
    selected = session.posargs or list(LANES)
    jobs = lane_jobs()
    names = schedule(selected, recorded_costs())
    shutil.rmtree(BYTECODE, ignore_errors=True)
    shutil.rmtree(SELECTION_CACHE, ignore_errors=True)
    session.log("%d lanes, %d at a time", len(names), jobs)
    failed = run_lanes(session, names, jobs)
    session.run(sys.executable, os.path.join("lanes", "report.py"), "summary", REPORTS, *selected,
                "--wall-seconds", "%.0f" % (time.time() - STARTED), "--disk", os.path.join(HERE, ".nox"),
                "--jobs", str(jobs), external=True, success_codes=[0, 1])
    if failed:
        session.error("%d lane(s) failed: %s" % (len(failed), ", ".join(failed)))


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
    "towers": (("vllm-0.18", "vllm-0.22", "latest-vllm", "vllm-0.30", "sglang-0.5.11", "sglang-0.5.13", "sglang-0.5.15",
                "sglang-0.5.16", "sglang-0.5.17", "sglang-0.5.20", "latest-sglang"),
               {"NPU_SHIM_EMULATE": "1", "VLLM_PLUGINS": "npu_shim"}),
}


def lane_venv(lane):
    """The directory nox gives the venv of session "lane(<lane>)"."""
    return os.path.join(HERE, ".nox", re.sub(r"[^\w-]", "-", "lane-" + lane))


@nox.session(python=False, default=False)
@nox.parametrize("name", [nox.param(name, id=name) for name in BENCHMARKS])
def bench(session, name):
    """One benchmark, one command from a fresh clone: reuses (or makes) its lanes' venvs,
    installs this checkout into it, runs benchmarks/bench_<name>.py (extra args after --) through
    benchmarks/record.py, which keeps what it printed in benchmarks/results/<name>-<lane>.txt
    with the date and machine (the reference shows those files)."""
    lanes, env = BENCHMARKS[name]
    for lane in (lanes,) if isinstance(lanes, str) else lanes:
        python = _lane_python(session, lane)
        # Bytecode written on first import, as in the lanes (the venvs are installed without it).
        session.run(python, os.path.join("benchmarks", "record.py"), name, lane, *session.posargs,
                    env=dict(env, PYTHONDONTWRITEBYTECODE=""), external=True)


def _lane_python(session, lane):
    """The python of the lane's venv, made if missing, holding the pins and this checkout."""
    venv = lane_venv(lane)
    python = os.path.join(venv, "bin", "python")
    uv = (sys.executable, "-m", "uv")
    if not os.path.exists(python):
        session.run(*uv, "venv", "--python", interpreter(LANES[lane]["python"]), venv, external=True,
                    env={"UV_PYTHON_DOWNLOADS": "never"})
    # Pinned, --no-deps: a venv that already holds the pins is checked in a second.
    session.run(*uv, "pip", "install", "--quiet", "--python", python, "--no-deps", *uv_source_args(), "-r",
                lane_requirements(LANES[lane], venv), external=True)
    session.run(*uv, "pip", "install", "--quiet", "--python", python, "--no-deps", ".", external=True)
    return python


def _version_key(text):
    from packaging.version import Version

    try:
        return Version(text)
    except Exception:  # noqa: BLE001 - an unparsable version sorts first
        return Version("0")


def _stands_for(lane):
    """{dist: [versions]} from a lane's "# Stands for:" line."""
    out = {}
    for part in lane["stands_for"].split(";"):
        words = part.replace(",", " ").split()
        if len(words) >= 2:
            out.setdefault(words[0], []).extend(words[1:])
    return out


def nearest_lane(dist, version):
    """The lane standing for the newest release of ``dist`` not newer than ``version`` (else the
    oldest lane of that dist), Python 3.11 lanes only."""
    target = _version_key(version)
    known = []
    for name, lane in LANES.items():
        if lane["python"] != "3.11" or "tests_of" in lane:
            continue
        for v in _stands_for(lane).get(dist, []):
            known.append((_version_key(v), name))
    if not known:
        return None
    below = [item for item in known if item[0] <= target]
    return max(below)[1] if below else min(known)[1]


@nox.session(python=False, default=False)
def probe(session):
    """A release with no lane yet: ``nox -s probe -- vllm-ascend==0.31.0rc1 [vllm==0.31.0]`` or
    ``nox -s probe -- sglang==0.5.24``.

    Makes a throwaway venv (.nox/probe) with that release (its wheel, else the wheel its sdist's
    own build makes, lanes/sdist.py) and its framework (vllm-ascend: the vLLM its own versioning policy names,
    unless given), plus the other pins of the nearest lane (the lane standing for the newest
    release not newer than it); prints ``npu-shim status --import`` (which family of each patch
    applies, or every family's reason), then runs that lane's tests (NPU_SHIM_LANE=<lane>). Its
    report (.nox/probe-reports/probe-<dist>-<version>/evidence.json) names each family applied on
    the probed release: ``npu-shim evidence --record`` adds them to npu_shim/releases_read.json.

    After the first pin, more ``name==version`` pins replace the lane's pins of those dists (a
    framework whose release needs newer transformers, tokenizers, ...); ``-r _file.txt`` (a pin
    include under lanes/) replaces the lane's pins of every dist it pins and adds the rest (a
    torch build: ``-r _torch-2.14.0-cuda-bare.txt``); ``--no-tests`` stops after the status (the
    venv is then there for a benchmark, e.g. ``.nox/probe/bin/python benchmarks/bench_census.py
    --lane probe-... --probe``)."""
    args = list(session.posargs)
    run_tests = "--no-tests" not in args
    args = [arg for arg in args if arg != "--no-tests"]
    includes = []
    while "-r" in args:
        at = args.index("-r")
        if at + 1 >= len(args):
            session.error("-r needs a pin include under lanes/, e.g. -r _torch-2.14.0-cuda-bare.txt")
        includes.append(os.path.join(LANES_DIR, args[at + 1]))
        del args[at:at + 2]
    if not args or any("==" not in arg for arg in args):
        session.error("usage: nox -s probe -- vllm-ascend==<version> [vllm==<version>] | sglang==<version> "
                      "[name==<version> ...] [-r _include.txt] [--no-tests]")
    pins = dict(arg.split("==", 1) for arg in args)
    dist = next(iter(pins))
    version = pins[dist]
    lane_name = nearest_lane(dist, version)
    if lane_name is None:
        session.error("no lane stands for any release of %s" % dist)
    lane = LANES[lane_name]
    session.log("probe %s %s: nearest lane %s (%s)", dist, version, lane_name, lane["stands_for"])
    if dist == "vllm-ascend" and "vllm" not in pins:
        pair = subprocess.run([sys.executable, os.path.join("lanes", "sdist.py"), "pair", dist, version],
                              capture_output=True, text=True)
        if pair.returncode != 0:
            session.error("vllm-ascend %s: no vLLM named by its versioning policy; give vllm==<version>" % version)
        pins["vllm"] = pair.stdout.strip()
        session.log("probe: vllm-ascend %s names vllm %s in its versioning policy", version, pins["vllm"])

    venv = os.path.join(HERE, ".nox", "probe")
    python = os.path.join(venv, "bin", "python")
    uv = (sys.executable, "-m", "uv")
    shutil.rmtree(venv, ignore_errors=True)
    session.run(*uv, "venv", "--quiet", "--python", interpreter(lane["python"]), venv, external=True,
                env={"UV_PYTHON_DOWNLOADS": "never"})
    # The nearest lane's pins, with the probed release and its framework swapped in: as a wheel
    # where the index has one (thin if the lane thins that dist), else built from its sdist.
    sdists = [req for req in lane["sdist"] if req.split("==")[0] not in pins]
    wheels = {}
    for name, pinned in pins.items():
        probe_ = subprocess.run([*uv, "pip", "install", "--dry-run", "--quiet", "--python", python, "--no-deps",
                                 "--only-binary", ":all:", *uv_source_args(), "%s==%s" % (name, pinned)],
                                capture_output=True, text=True)
        if probe_.returncode == 0:
            wheels[name] = "%s==%s" % (name, pinned)
        else:
            sdists.append("%s==%s" % (name, pinned))
            session.log("probe: %s %s has no wheel here: built from its sdist", name, pinned)
    leave_out = {name: "" for name in pins if name not in wheels}
    # pins of the includes first: the pins given one by one win over them
    swap = {}
    for path in includes:
        swap.update((_requirement_name(line), line) for line in requirement_lines(path) if _requirement_name(line))
        session.log("probe: the pins of %s replace the lane's", os.path.relpath(path, HERE))
    swap.update((_requirement_name(name), line) for name, line in dict(leave_out, **wheels).items())
    requirements = lane_requirements(dict(lane, thin=[t for t in lane["thin"] if t not in leave_out], sdist=sdists),
                                     venv, swap=swap)
    session.run(*uv, "pip", "install", "--quiet", "--python", python, "--no-deps", *uv_source_args(),
                "-r", requirements, external=True)
    session.run(*uv, "pip", "install", "--quiet", "--python", python, "--no-deps", ".", external=True)

    env = dict(KIND_ENV[lane["kind"]], PYTHONDONTWRITEBYTECODE="")
    name = "probe-%s-%s" % (dist, version)
    if not run_tests:
        session.run(python, os.path.join("lanes", "report.py"), "status", "--lane", name, env=env, external=True)
        return
    # The lane's declared skips are the probe's too (a patch out for the lane's release is out for a newer one).
    session.run(python, os.path.join("lanes", "report.py"), "run", "--lane", name, "--tests-of", lane_name,
                "--out", os.path.join(REPORTS, "..", "probe-reports", name),
                *[argument for text in lane["expected_skips"] for argument in ("--expected-skip", text)],
                "--", "-q", "-p", "no:cacheprovider", env=env, external=True)


# The mutation session: each gate shown to fail on the defect it exists for. The mutants (an
# edit of a scratch copy of this checkout, tracked files only, and the lane that must catch it)
# are the table in lanes/mutants.py, which also checks in memory that each still applies.


def _scratch_copy(destination):
    """The checkout's tracked files, as they are in the working tree, copied to ``destination``."""
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=HERE, check=True, capture_output=True).stdout
    for relative in filter(None, listed.decode().split("\0")):
        source = os.path.join(HERE, relative)
        if os.path.isfile(source):
            os.makedirs(os.path.dirname(os.path.join(destination, relative)), exist_ok=True)
            shutil.copy2(source, os.path.join(destination, relative))


def _evidence(output, expect):
    """The line of the lane's output that shows the catch (the expected text's line)."""
    return next((line.strip() for line in output.splitlines() if expect in line), "")


@nox.session(python=False, default=False)
def mutants_apply(session):
    """``nox -s mutants_apply``: every mutant of ``nox -s mutants`` applied in memory, no lane run
    (seconds): fails naming the mutant, file and text when an edit's text is gone or not unique,
    or its lane has no pin file. .ci/run runs it before the lanes."""
    broken = mutant_table.problems(HERE)
    if broken:
        session.error("mutants that no longer apply (lanes/mutants.py):\n  " + "\n  ".join(broken))
    session.log("mutants: all %d apply (%d edits, each text found once)", len(mutant_table.MUTANTS),
                sum(len(entry.edits) for entry in mutant_table.MUTANTS))


@nox.session(python=False, default=False)
def mutants(session):
    """``nox -s mutants [-- ID ...]``: apply each mutant (lanes/mutants.py) to a scratch copy, run the
    lane that must catch it there (fresh venv, warm caches), print mutant -> what failed; fails
    if any mutant was not caught by the gate it names. Run whole, it writes the table to
    benchmarks/results/mutants.txt."""
    import platform
    import tempfile

    chosen = [m for m in mutant_table.MUTANTS if not session.posargs or m.ident in session.posargs]
    unknown = sorted(set(session.posargs) - {m.ident for m in mutant_table.MUTANTS})
    broken = mutant_table.problems(HERE, chosen)
    if unknown or broken:   # before any lane runs, not an hour in
        session.error("; ".join((["no mutant %s" % ", ".join(unknown)] if unknown else []) + broken))
    logs = os.path.join(HERE, ".nox", "mutants")
    os.makedirs(logs, exist_ok=True)
    first = time.time()

    def run_one(entry):
        ident, defect, lane_name, expect = entry.ident, entry.defect, entry.lane, entry.expect
        with tempfile.TemporaryDirectory(prefix="npu-shim-mutant-%s-" % ident) as scratch:
            _scratch_copy(scratch)
            mutant_table.apply(scratch, entry)
            started = time.monotonic()
            proc = subprocess.run([sys.executable, "-m", "nox", "-f", os.path.join(scratch, "noxfile.py"),
                                   "-s", "lane(%s)" % lane_name], cwd=scratch, capture_output=True, text=True)
            output = proc.stdout + proc.stderr
        with open(os.path.join(logs, ident + ".log"), "w", encoding="utf-8") as handle:
            handle.write(output)
        evidence = _evidence(output, expect)
        caught = proc.returncode != 0 and bool(evidence)
        row = (ident, defect, "lane(%s)" % lane_name, "caught" if caught else "MISSED",
               "%.0f s" % (time.monotonic() - started), evidence[:160] or "(expected: %s)" % expect)
        session.log("mutant %s: %s (%s)", ident, row[3], row[4])
        return row

    # each mutant is a lane run in its own scratch copy and venv, independent of the others: run
    # NPU_SHIM_MUTANT_JOBS at a time (default: one per core), rows kept in table order
    jobs = max(1, int(os.environ.get("NPU_SHIM_MUTANT_JOBS") or os.cpu_count() or 1))
    with concurrent.futures.ThreadPoolExecutor(max_workers=jobs) as pool:
        rows = list(pool.map(run_one, chosen))
    missed = [row[0] for row in rows if row[3] != "caught"]
    sys.path.insert(0, os.path.join(HERE, "lanes"))
    from report import format_table

    table = format_table(("mutant", "defect", "ran", "verdict", "time", "what failed"), rows)
    print(table)
    # recorded with where and when it ran: a whole run replaces the file, a re-run of some appends
    commit = subprocess.run(["git", "rev-parse", "--short=12", "HEAD"], cwd=HERE, capture_output=True,
                            text=True).stdout.strip()
    dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=HERE,
                           capture_output=True, text=True).stdout.strip()
    header = "ran %s-%s UTC on %s, %d cores, %d mutants at a time: nox -s mutants%s at %s%s; written by noxfile.py mutants" % (
        time.strftime("%Y-%m-%d %H:%M", time.gmtime(first)), time.strftime("%H:%M", time.gmtime()),
        platform.machine(), os.cpu_count() or 0, jobs, " -- " + " ".join(session.posargs) if session.posargs else "",
        commit, " + uncommitted changes" if dirty else "")
    with open(os.path.join(HERE, "benchmarks", "results", "mutants.txt"), "a" if session.posargs else "w",
              encoding="utf-8") as handle:
        handle.write(("\n" if session.posargs else "") + header + "\n\n" + table + "\n")
    if missed:
        session.error("mutants not caught: %s (logs: .nox/mutants/)" % ", ".join(missed))
