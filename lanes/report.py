"""Run one lane's tests and print its table: patch x state x reason x tests passed.

Called by ``noxfile.py`` inside the lane's virtual environment::

    python lanes/report.py run --lane vllm-0.13 --out .nox/reports/vllm-0.13 -- [pytest args]
    python lanes/report.py summary .nox/reports [LANE ...]   # one table over the lanes

``run`` asks the shim what each patch does in this environment (``npu-shim status --json
--import``, see STATUS_SNIPPET; where vllm-ascend is installed the same interpreter then writes
the family matrix the tests read, MATRIX_ENV), runs pytest (writing a junit xml), prints the
lane table and writes ``summary.json`` next to the junit file. With ``--bytecode-store`` the
lanes share the bytecode of the files they share (seed_bytecode, keep_bytecode). The lane fails (non-zero exit, each
reason printed as ``LANE FAILED: ...``) when

- the installed upstream releases are not the ones its pin file's ``# Stands for:`` line
  names (checked first, before any test: a mis-edited pin file must not stay green);
- pytest failed, or ran no test, or passed none (an all-skipped lane is not a green one);
- a test skipped for a reason the pin file does not declare with ``# Expected skip:``;
- a patch one of whose families claims the installed release (its fence admits it: the
  status row's ``admitted``) is not applied with one of those families, or no test marked
  for it passed: a claim no test exercised on the lane standing for it is a defect;
- the status command is missing or fails (the claim above cannot be checked then; the
  table says so instead of rows, none are made up); it fails, naming the function, when an
  upstream function was edited more than once while the patches applied (a family whose build
  edits again what its check edited: build must install the check's edit, ``context.found``);
- npu_shim/releases_read.json (the releases each family was read in) records the installed
  release for a family other than the one applied here, or for a patch not applied here
  (evidence_conflicts);
- on a lane lanes/upstream_tests.py names, upstream's own unit tests of the patched classes
  (taken from the release's pinned source archive, ``--upstream-archive``) fail where no
  difference is declared, or a declared difference no longer happens (stale), or the patch
  they exercise was not applied or not reached. Their verdicts (suite x release x passed /
  declared-different / failed) and seconds go into summary.json (``upstream``).

``run`` also writes ``evidence.json`` (evidence_found: each family applied here, with the release
of its distribution), which ``npu-shim evidence --record`` adds to npu_shim/releases_read.json;
the table lists the applied families that file does not record yet.

"Tests passed" per patch is counted from the tests' markers: a test that exercises a patch
carries ``pytest.mark.patch("<name>")``, which tests/conftest.py writes into the junit xml
as ``<property name="patch" value="<name>"/>`` of its test case; a test is counted for each
patch it names, and for no other. The lane's totals are printed beside it, so tests that
name no patch (the machinery's own) are not hidden.

Only the standard library is used: this runs in every lane's venv and, for ``summary``,
under nox's own Python, where npu_shim is not installed. The table layout is npu_shim's
(``npu_shim/_table.py``), loaded from this checkout by file path: ``import npu_shim``
would install the shim.
"""
import argparse
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PYTEST_NO_TESTS = 5


def _load_by_path(name, *path):
    """A module of this checkout, loaded by path (npu_shim/_table.py: not through ``import
    npu_shim``; lanes/upstream_tests.py: also when this file is itself loaded by path)."""
    spec = importlib.util.spec_from_file_location(name, os.path.join(REPO, *path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


format_table = _load_by_path("_npu_shim_table", "npu_shim", "_table.py").format_table
upstream_tests = _load_by_path("_npu_shim_upstream_tests", "lanes", "upstream_tests.py")


def run_pytest(junit_path, pytest_args, env):
    # -P: the checkout is not put on sys.path, so the tests import the installed npu_shim.
    # (-P is 3.11+; below, the venv's pytest script, whose sys.path[0] is the venv's bin/.)
    if sys.version_info >= (3, 11):
        command = [sys.executable, "-P", "-m", "pytest"]
    else:
        command = [os.path.join(os.path.dirname(sys.executable), "pytest")]
    command += ["--junitxml", junit_path] + list(pytest_args)
    print("+ " + " ".join(command), flush=True)
    return subprocess.call(command, cwd=REPO, env=env)


# ``npu-shim status --json --import``, run with one isolation the lane tests use too:
# vllm_ascend/ops/__init__.py imports compiled Ascend ops (and torch.npu), which cannot load
# without an NPU, so when vllm-ascend is installed the package ``vllm_ascend.ops`` is
# registered with its real __path__ but without running that __init__; the real
# ``vllm_ascend.ops.mm_encoder_attention`` file is then imported by the shim as usual.
STATUS_SNIPPET = """
import collections, contextlib, json, sys, traceback
from npu_shim.patches._shared import source_edit
# Each edit of upstream's function reads its definition once (_function_node): counted per function
# object, so a family whose build edits again what its check edited (and threw away) shows here.
edits, definition = collections.Counter(), source_edit._function_node
def counted(function):
    edits["%s.%s" % (function.__module__, function.__qualname__), id(function)] += 1
    return definition(function)
source_edit._function_node = counted
from npu_shim.testing.towers import targets_importable
from npu_shim.cli import main
with targets_importable():
    status = main(["status", "--json", "--import"])
source_edit._function_node = definition
twice = sorted("%s (%d times)" % (name, n) for (name, _), n in edits.items() if n > 1)
sys.stdout.flush()
if len(sys.argv) > 1:
    # The family matrix, after the status is printed (see MATRIX_NOTE); a failure here is the
    # matrix test's, written to its file, and leaves the status and its exit code alone.
    try:
        with contextlib.redirect_stdout(sys.stderr):
            from npu_shim.testing.family_matrix import checks_of_originals
            matrix = checks_of_originals()
    except BaseException:
        matrix = {"error": traceback.format_exc()}
    with open(sys.argv[1], "w", encoding="utf-8") as handle:
        json.dump(matrix, handle)
if twice:
    print("%s: %s" % (EDITED_TWICE, ", ".join(twice)), file=sys.stderr)
    sys.exit(3)
sys.exit(status)
""".replace("EDITED_TWICE", repr("upstream's function edited more than once at install (build must install the "
                                 "edit its check made, context.found)"))
# Where vllm-ascend is installed, the status interpreter then also computes the family
# matrix of tests/lanes/test_family_by_structure.py (every family's structural check against
# upstream's code; the test would otherwise import every target once more in a fresh
# interpreter, 7-16 s a lane): npu_shim.testing.family_matrix.checks_of_originals uninstalls
# the shim (the engine restores each original object it replaced), keeps it off, and reports
# any replacement still in place. The file's path goes to pytest as $FAMILY_MATRIX_JSON, which
# the test reads (without it, the test computes the matrix in a fresh NPU_SHIM=0 interpreter).
MATRIX_ENV = "FAMILY_MATRIX_JSON"
STATUS_NOTE = ("status: npu-shim status --json --import (vllm_ascend.ops loaded without its __init__; "
               "torchvision, which vLLM's GLM-4.1V module imports and the lanes do not install, as the "
               "tests' import-only placeholder)")


def patch_status(env, matrix_path=None):
    """Rows from ``npu-shim status --json --import``; (None, message) when unavailable.
    With ``matrix_path``, the same interpreter then writes the family matrix there (STATUS_SNIPPET)."""
    # -P (3.11+) keeps the checkout off sys.path; below 3.11, run from the venv's directory.
    safe = sys.version_info >= (3, 11)
    command = [sys.executable] + (["-P"] if safe else []) + ["-c", STATUS_SNIPPET] + ([matrix_path] if matrix_path else [])
    try:
        proc = subprocess.run(command, cwd=REPO if safe else sys.prefix, env=env, capture_output=True, text=True, timeout=600)
    except subprocess.TimeoutExpired:
        return None, "`npu-shim status --json --import` did not finish in 600 s"
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        return None, "`npu-shim status --json --import` exited %d: %s" % (proc.returncode, " | ".join(tail))
    rows = _json_list_in(proc.stdout)
    if rows is None:
        return None, "`npu-shim status --json --import` printed no JSON list: %r" % proc.stdout[:200]
    if not isinstance(rows, list):
        return None, "`npu-shim status --json --import` printed %s, not a list" % type(rows).__name__
    return rows, None


def _json_list_in(text):
    """The JSON list in ``text``; upstream frameworks imported by ``--import`` may log to
    stdout first (vLLM's default handler does), so parsing starts at the first line that
    opens a list."""
    lines = text.splitlines()
    for index, line in enumerate(lines):
        if line.startswith("["):
            try:
                return json.loads("\n".join(lines[index:]))
            except ValueError:
                continue
    return None


def read_junit(junit_path):
    """Per test case: (patch names, outcome, test id, skip message); the names are the case's
    ``patch`` properties (its ``pytest.mark.patch`` markers, see tests/conftest.py), the
    outcome is passed/failed/error/skipped."""
    if not os.path.exists(junit_path):
        return []
    cases = []
    for case in ET.parse(junit_path).getroot().iter("testcase"):
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("failure", "error", "skipped"):
                outcome = "failed" if child.tag == "failure" else child.tag
                message = child.get("message") or ""
                break
        patches = tuple(prop.get("value") for prop in case.findall("properties/property")
                        if prop.get("name") == "patch")
        test_id = "%s::%s" % (case.get("classname", ""), case.get("name", ""))
        cases.append((patches, outcome, test_id, message))
    return cases


def totals(cases):
    counts = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for case in cases:
        counts[case[1]] += 1
    return counts


def tests_per_patch(rows, cases):
    """For each patch row: passed/total over the test cases that name the patch."""
    result = {}
    for row in rows:
        mine = [case[1] for case in cases if row["name"] in case[0]]
        result[row["name"]] = {"passed": mine.count("passed"), "total": len(mine)}
    return result


def stands_for(text):
    """{dist: [versions]} from a pin file's ``# Stands for:`` value."""
    out = {}
    for part in (text or "").split(";"):
        words = part.replace(",", " ").split()
        if len(words) >= 2:
            out.setdefault(words[0].lower(), []).extend(words[1:])
    return out


def release_mismatches(text):
    """Why the installed releases are not those ``# Stands for: <text>`` names ([] if they are).
    A local version label (torch's ``+cpu``) is not part of the release."""
    from importlib.metadata import PackageNotFoundError, version

    problems = []
    for dist, versions in stands_for(text).items():
        if dist == "python":
            installed = "%d.%d" % sys.version_info[:2]
        else:
            try:
                installed = version(dist).split("+", 1)[0]
            except PackageNotFoundError:
                installed = None
        if installed not in versions:
            problems.append("the pin file says the lane stands for %s %s, but %s is installed"
                            % (dist, ", ".join(versions), "%s %s" % (dist, installed) if installed else "no " + dist))
    return problems


def undeclared_skips(cases, expected):
    """Skipped cases whose message contains none of the ``# Expected skip:`` texts."""
    return ["%s (%s)" % (case[2], case[3]) for case in cases
            if case[1] == "skipped" and not any(text in case[3] for text in expected)]


def unexercised_claims(rows, per_patch):
    """Patches a family of which claims the installed release (fence admits it) but that are
    not applied with such a family, or that no test marked for them passed here."""
    problems = []
    for row in rows:
        admitted = row.get("admitted") or []
        if not admitted or row["state"] == "disabled":
            continue
        if row["state"] != "applied" or row.get("family") not in admitted:
            problems.append("%s: family %s claims this release, but the patch is %s%s: %s"
                            % (row["name"], " / ".join(admitted), row["state"],
                               " (%s)" % row["family"] if row.get("family") else "", row["reason"]))
        elif not per_patch.get(row["name"], {}).get("passed"):
            problems.append("%s: applied (%s) on the release its family claims, but no test marked for it passed "
                            "on this lane" % (row["name"], row["family"]))
    return problems


EVIDENCE_FILE = "evidence.json"
RECORD_COMMAND = "npu-shim evidence --record"


def evidence_found(rows):
    """``{patch: {family: release}}``: the families applied here on a release build (the status
    rows' ``release``), what ``npu-shim evidence --record`` adds to npu_shim/releases_read.json."""
    found = {}
    for row in rows:
        if row["state"] == "applied" and row.get("family") and row.get("release"):
            found.setdefault(row["name"], {})[row["family"]] = row["release"]
    return found


def evidence_conflicts(rows):
    """Where npu_shim/releases_read.json (the rows' ``read_as``: the families recorded as read in
    the installed release) contradicts what the shim does here: a release recorded for one
    family applied with another, or recorded for a family of a patch that is not applied."""
    problems = []
    for row in rows:
        read_as = row.get("read_as") or []
        if not read_as or row["state"] == "disabled":
            continue
        if row["state"] == "applied":
            if row.get("release") and read_as != [row.get("family")]:
                problems.append("%s: applied with family %s on %s, which npu_shim/releases_read.json records as "
                                "read for %s" % (row["name"], row.get("family"), row["release"], " / ".join(read_as)))
        else:
            problems.append("%s: npu_shim/releases_read.json records this release as read for family %s, but the "
                            "patch is %s: %s" % (row["name"], " / ".join(read_as), row["state"], row["reason"]))
    return problems


def unrecorded(rows):
    """Applied families whose installed release npu_shim/releases_read.json does not record yet."""
    return ["%s: family %s on %s" % (row["name"], row["family"], row["release"])
            for row in rows if row["state"] == "applied" and row.get("release") and not row.get("read_as")]


def write_evidence(out, lane, rows):
    """The lane's findings for ``npu-shim evidence``: ``out/evidence.json``."""
    source = ("probe %s" % lane) if lane.startswith("probe-") else ("lane %s" % lane)
    with open(os.path.join(out, EVIDENCE_FILE), "w", encoding="utf-8") as handle:
        json.dump({"source": source, "found": evidence_found(rows)}, handle, indent=1, sort_keys=True)


def disk_use(top):
    """(own, shared) bytes on disk under ``top``: ``own`` counts files with one link, ``shared``
    each hardlinked inode once (uv installs from its cache by hardlink, so most of a lane is
    shared with the cache and with the other lanes). Like ``du``: blocks, inodes once."""
    own = shared = 0
    seen = set()
    for root, _, files in os.walk(top):
        for name in files:
            try:
                st = os.lstat(os.path.join(root, name))
            except OSError:
                continue
            if (st.st_dev, st.st_ino) in seen:
                continue
            seen.add((st.st_dev, st.st_ino))
            if st.st_nlink > 1:
                shared += st.st_blocks * 512
            else:
                own += st.st_blocks * 512
    return own, shared


# Bytecode shared between lanes (``--bytecode-store``). The venvs are installed without
# bytecode, so every lane compiled again what its tests import: torch alone, the same files
# in most lanes (hardlinks of one copy in uv's cache), is about 8 s of CPU a lane. After a
# lane, each .pyc of a source file that is a hardlink (one file shared with uv's cache and
# the other lanes) is kept in the store under that file's identity (device, inode), as a
# *checked hash-based* pyc (PEP 552): whoever loads it, Python hashes the source and compiles
# it afresh if the hash differs, so a store entry can never stand in for other code. Before
# the next lane's first import, each of its hardlinked sources that has an entry gets it in
# its __pycache__ (a hardlink; Python never writes into a pyc in place, it replaces the file).
# Python corrects the code's file name to the path it loads it from (co_filename).
PYC_SUFFIX = ".%s.pyc" % sys.implementation.cache_tag
CHECKED_HASH = (0b11).to_bytes(4, "little")


def _store_key(stat):
    return "%d-%d%s" % (stat.st_dev, stat.st_ino, PYC_SUFFIX)


def seed_bytecode(venv, store):
    """Hardlink the store's pycs into ``venv``'s __pycache__ directories; returns how many."""
    try:
        held = set(os.listdir(store))
    except OSError:
        return 0
    linked = 0
    for directory, subdirs, files in os.walk(venv):
        if "__pycache__" in subdirs:
            subdirs.remove("__pycache__")
        for name in files:
            if not name.endswith(".py"):
                continue
            try:
                st = os.lstat(os.path.join(directory, name))
            except OSError:
                continue
            key = _store_key(st)
            if st.st_nlink < 2 or key not in held:
                continue
            cache = os.path.join(directory, "__pycache__")
            try:
                os.makedirs(cache, exist_ok=True)
                os.link(os.path.join(store, key), os.path.join(cache, name[:-3] + PYC_SUFFIX))
                linked += 1
            except OSError:
                pass
    return linked


def keep_bytecode(venv, store):
    """Add to the store each pyc under ``venv`` compiled from a hardlinked source it does not
    hold yet, as a checked hash-based pyc; a timestamp pyc that does not match its source's
    mtime and size (stale) is left out. Returns how many were added."""
    import importlib.util

    os.makedirs(store, exist_ok=True)
    held = set(os.listdir(store))
    added = 0
    for directory, subdirs, files in os.walk(venv):
        if os.path.basename(directory) != "__pycache__":
            continue
        for name in files:
            if not name.endswith(PYC_SUFFIX):
                continue
            source = os.path.join(os.path.dirname(directory), name[:-len(PYC_SUFFIX)] + ".py")
            try:
                st = os.lstat(source)
                if st.st_nlink < 2 or _store_key(st) in held:
                    continue
                with open(os.path.join(directory, name), "rb") as handle:
                    data = handle.read()
                if data[:4] != importlib.util.MAGIC_NUMBER or int.from_bytes(data[4:8], "little") != 0:
                    continue
                if data[8:16] != ((int(st.st_mtime) & 0xFFFFFFFF).to_bytes(4, "little")
                                  + (st.st_size & 0xFFFFFFFF).to_bytes(4, "little")):
                    continue
                with open(source, "rb") as handle:
                    digest = importlib.util.source_hash(handle.read())
                key = _store_key(st)
                partial = os.path.join(store, "%s.%d.tmp" % (key, os.getpid()))
                with open(partial, "wb") as handle:
                    handle.write(data[:4] + CHECKED_HASH + digest + data[16:])
                os.replace(partial, os.path.join(store, key))
                held.add(key)
                added += 1
            except OSError:
                continue
    return added


def drop_bytecode(venv):
    """Remove the ``__pycache__`` directories under ``venv``, once the lane's tests and status
    have run: the venv is installed without bytecode and made anew by every run, so what the
    tests compiled on import is never read again (about 3 GiB over all lanes). Returns the
    bytes freed."""
    freed = 0
    for directory, subdirs, _ in os.walk(venv):
        if "__pycache__" in subdirs:
            cache = os.path.join(directory, "__pycache__")
            for entry in os.scandir(cache):
                freed += entry.stat(follow_symlinks=False).st_size
            shutil.rmtree(cache, ignore_errors=True)
            subdirs.remove("__pycache__")
    return freed


def venv_size_mib():
    """This lane's venv (sys.prefix) in MiB: (own files, hardlinked files)."""
    own, shared = disk_use(sys.prefix)
    return round(own / 2**20), round(shared / 2**20)


def _fmt_versions(versions):
    return ", ".join("%s %s" % (dist, version or "-") for dist, version in sorted(versions.items())) or "-"


def lane_table(summary):
    headers = ("patch", "state", "reason", "versions", "tests passed (marked for it)")
    table = []
    for row in summary["patches"] or []:
        tests = summary["tests_per_patch"].get(row["name"], {"passed": 0, "total": 0})
        table.append(
            (
                row["name"],
                row["state"] + (" (%s)" % row["family"] if row.get("family") else ""),
                row["reason"] or "-",
                _fmt_versions(row.get("versions") or {}),
                "%d/%d" % (tests["passed"], tests["total"]) if tests["total"] else "-",
            )
        )
    return format_table(headers, table) if table else "(no patch rows)"


UPSTREAM_HEADERS = ("lane", "upstream suite", "release (archive sha256, commit)", "passed", "declared-different",
                    "failed", "seconds")


def upstream_table(summaries):
    """Upstream's own tests per lane: suite x release x passed / declared-different / failed,
    then each declared difference that happened, with its reason."""
    rows, notes = [], {}
    for summary in summaries:
        upstream = summary.get("upstream")
        if not upstream:
            continue
        release = "%s %s (%s, %s)" % (upstream["dist"], upstream["release"], upstream["sha256"][:12],
                                      upstream["commit"][:12])
        for suite in upstream.get("suites") or []:
            rows.append((summary["lane"], suite["suite"], release, suite["passed"], suite["declared"],
                         suite["failed"], _secs(upstream.get("seconds"))))
            for test in suite["tests"]:
                if test["verdict"] == "declared-different":
                    notes.setdefault((test["test"], test["outcome"], test["reason"]), []).append(
                        "%s %s" % (summary["lane"], upstream["release"]))
        if not upstream.get("suites"):
            rows.append((summary["lane"], "(not run)", release, "-", "-", "-", _secs(upstream.get("seconds"))))
    if not rows:
        return "(no upstream suites)"
    return "\n".join([format_table(UPSTREAM_HEADERS, rows)] + [
        "declared %s (%s): %s: %s" % (outcome, ", ".join(where), test, reason)
        for (test, outcome, reason), where in notes.items()])


def lane_costs(summary):
    """'Python 3.11.7, install 12 s, tests 80 s, venv 30 MiB own + 1650 MiB hardlinked'."""
    def seconds(key):
        value = summary.get(key)
        return "?" if value is None else "%.0f" % value
    dropped = summary.get("bytecode_mib_dropped")
    upstream = (summary.get("upstream") or {}).get("seconds")
    return "Python %s, install %s s, tests %s s%s, venv %s MiB own + %s MiB hardlinked%s" % (
        summary.get("python", "?"), seconds("install_seconds"), seconds("test_seconds"),
        "" if upstream is None else " + upstream's unit tests %.0f s" % upstream,
        summary.get("venv_mib", "?"), summary.get("venv_shared_mib", "?"),
        "" if dropped is None else " (after dropping %s MiB of test bytecode)" % dropped)


def closing_line(counts):
    return "%d passed, %d failed, %d skipped" % (
        counts["passed"],
        counts["failed"] + counts["error"],
        counts["skipped"],
    )


def cmd_run(args):
    os.makedirs(args.out, exist_ok=True)
    junit_path = os.path.abspath(os.path.join(args.out, "junit.xml"))
    if os.path.exists(junit_path):
        os.remove(junit_path)
    env = dict(os.environ, NPU_SHIM_LANE=args.tests_of or args.lane)
    if args.variant:
        env["NPU_SHIM_LANE_VARIANT"] = "1"
    mismatches = release_mismatches(args.stands_for) if args.stands_for is not None else []
    if mismatches:
        # Before any test: the lane's results would be credited to a release it did not run.
        for problem in mismatches:
            print("LANE FAILED: lane %s: %s" % (args.lane, problem), file=sys.stderr)
        with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as handle:
            json.dump({"lane": args.lane, "tests_of": args.tests_of or args.lane, "pytest_exit_code": None,
                       "tests": totals([]), "patches": [], "status_problem": "not run", "tests_per_patch": {},
                       "problems": mismatches, "install_seconds": args.install_seconds,
                       "python": "%d.%d.%d" % sys.version_info[:3]}, handle, indent=2, sort_keys=True)
        return 1
    # The status first (its gate is read after the tests): where vllm-ascend is installed, its
    # interpreter also writes the family matrix the tests read (MATRIX_ENV).
    # The status needs the targets imported: with no real torch_npu here, the emulation
    # stands in for it (NPU_SHIM_EMULATE=1), as in the lane's tests.
    # VLLM_CONFIGURE_LOGGING=0: vLLM's default log handler writes to stdout.
    store = getattr(args, "bytecode_store", None)
    linked = seed_bytecode(sys.prefix, store) if store else None
    if store:
        print("lane %s: %d pycs linked from %s" % (args.lane, linked, store), flush=True)
    matrix_path = None
    if importlib.util.find_spec("vllm_ascend") is not None:
        matrix_path = os.path.abspath(os.path.join(args.out, "family-matrix.json"))
        if os.path.exists(matrix_path):
            os.remove(matrix_path)
    started = time.monotonic()
    rows, status_problem = patch_status(dict(env, NPU_SHIM_EMULATE="1", VLLM_CONFIGURE_LOGGING="0"), matrix_path)
    status_seconds = time.monotonic() - started
    if matrix_path and os.path.exists(matrix_path):
        env[MATRIX_ENV] = matrix_path
    started = time.monotonic()
    pytest_rc = run_pytest(junit_path, args.pytest_args, env)
    test_seconds = time.monotonic() - started
    cases = read_junit(junit_path)
    counts = totals(cases)
    # Upstream's own tests of the patched classes, where the lane runs a release that has them.
    upstream = None
    if upstream_tests.lane_release(args.lane):
        upstream = upstream_tests.run(args.lane, getattr(args, "upstream_archive", None), env)

    summary = {
        "lane": args.lane,
        "tests_of": args.tests_of or args.lane,
        "pytest_exit_code": pytest_rc,
        "tests": counts,
        "patches": rows,
        "status_problem": status_problem,
        "tests_per_patch": tests_per_patch(rows or [], cases),
        "junit": os.path.relpath(junit_path, REPO),
        "install_seconds": args.install_seconds,
        "test_seconds": round(test_seconds, 1),
        "status_seconds": round(status_seconds, 1),
        "python": "%d.%d.%d" % sys.version_info[:3],
        "upstream": upstream,
    }
    problems = []
    if pytest_rc == PYTEST_NO_TESTS or not cases:
        problems.append("no test ran")
    elif pytest_rc != 0:
        problems.append("pytest failed (exit code %d)" % pytest_rc)
    elif not counts["passed"]:
        problems.append("no test passed (%d skipped)" % counts["skipped"])
    problems += ["a test skipped for a reason the pin file does not declare (# Expected skip:): " + skip
                 for skip in undeclared_skips(cases, args.expected_skip)]
    if status_problem:
        problems.append("which patches claim this release cannot be checked: " + status_problem)
    problems += unexercised_claims(rows or [], summary["tests_per_patch"])
    problems += evidence_conflicts(rows or [])
    problems += (upstream or {}).get("problems", [])
    summary["problems"] = problems
    if rows:
        write_evidence(args.out, args.lane, rows)
    if store:
        summary["bytecode_linked"], summary["bytecode_kept"] = linked, keep_bytecode(sys.prefix, store)
    summary["bytecode_mib_dropped"] = round(drop_bytecode(sys.prefix) / 2**20)
    summary["venv_mib"], summary["venv_shared_mib"] = venv_size_mib()
    with open(os.path.join(args.out, "summary.json"), "w", encoding="utf-8") as handle:
        json.dump(summary, handle, indent=2, sort_keys=True)

    print()
    print("=== lane %s ===" % args.lane)
    if status_problem:
        print("patch status unavailable: %s" % status_problem)
    else:
        print(lane_table(summary))
        print(STATUS_NOTE)
        for line in unrecorded(rows):
            print("not recorded as read yet (%s, after the lane): %s" % (RECORD_COMMAND, line))
    if upstream:
        print(upstream_table([summary]))
    print(
        "lane %s: %s (pytest exit code %d, junit %s; %s)"
        % (args.lane, closing_line(counts), pytest_rc, summary["junit"], lane_costs(summary))
    )

    for problem in problems:
        print("LANE FAILED: lane %s: %s" % (args.lane, problem), file=sys.stderr)
    return 1 if problems else 0


def cmd_status(args):
    """Only the status of a venv (a probe's, ``nox -s probe -- ... --no-tests``): the lane
    table's patch columns, no tests."""
    env = dict(os.environ, NPU_SHIM_EMULATE="1", VLLM_CONFIGURE_LOGGING="0")
    rows, status_problem = patch_status(env)
    print("=== %s: status only, no tests ===" % args.lane)
    if status_problem:
        print("patch status unavailable: %s" % status_problem)
        return 1
    print(lane_table({"patches": rows, "tests_per_patch": {}}))
    print(STATUS_NOTE)
    return 0


def cmd_summary(args):
    lanes = args.lanes or (sorted(os.listdir(args.reports)) if os.path.isdir(args.reports) else [])
    summaries, missing = [], []
    for lane in lanes:
        path = os.path.join(args.reports, lane, "summary.json")
        if os.path.exists(path):
            with open(path, encoding="utf-8") as handle:
                summaries.append(json.load(handle))
        else:
            missing.append(lane)
    if not summaries:
        print("no lane summaries under %s" % args.reports)
        return 1
    table = []
    overall = {"passed": 0, "failed": 0, "error": 0, "skipped": 0}
    for summary in summaries:
        for key in overall:
            overall[key] += summary["tests"][key]
        lane_counts = closing_line(summary["tests"])
        if summary["status_problem"]:
            table.append((summary["lane"], "-", "status unavailable", summary["status_problem"][:60], lane_counts))
            continue
        for row in summary["patches"]:
            tests = summary["tests_per_patch"].get(row["name"], {"passed": 0, "total": 0})
            table.append(
                (
                    summary["lane"],
                    row["name"],
                    row["state"] + (" (%s)" % row["family"] if row.get("family") else ""),
                    row["reason"] or "-",
                    "%d/%d" % (tests["passed"], tests["total"]) if tests["total"] else "-",
                )
            )
        table.append((summary["lane"], "(lane)", "", lane_costs(summary), lane_counts))
    print(format_table(("lane", "patch", "state", "reason", "tests passed (marked for it)"), table))
    print()
    print("upstream's own unit tests of the patched classes (lanes/upstream_tests.py):")
    print(upstream_table(summaries))
    print()
    costs = []
    for summary in summaries:
        costs.append((summary["lane"], summary.get("python", "?"),
                      _secs(summary.get("install_seconds")), _secs(all_test_seconds(summary)),
                      summary.get("venv_mib", "?"), summary.get("venv_shared_mib", "?"),
                      closing_line(summary["tests"])))
    installs = [s.get("install_seconds") or 0 for s in summaries]
    tests = [all_test_seconds(s) or 0 for s in summaries]
    costs.append(("(%d lanes)" % len(summaries), "", "%.0f" % sum(installs), "%.0f" % sum(tests), "", "",
                  closing_line(overall)))
    record = [format_table(("lane", "python", "install s", "tests s", "venv own MiB", "hardlinked MiB", "tests"),
                           costs)]
    if args.wall_seconds is not None:
        record.append("lanes: wall time %.0f s (%.1f min)%s" % (args.wall_seconds, args.wall_seconds / 60,
                                                                ", %d lanes at a time" % args.jobs if args.jobs else ""))
    if args.disk:
        own, shared = disk_use(args.disk)
        record.append("lanes: venvs under %s use %.1f GiB on disk (du: each file once; %.1f GiB of it hardlinked "
                      "with the uv cache)" % (os.path.relpath(args.disk), (own + shared) / 2**30, shared / 2**30))
    print("\n".join(record))
    for summary in summaries:
        for problem in summary.get("problems") or []:
            print("lane %s: %s" % (summary["lane"], problem))
    failed = [s["lane"] for s in summaries
              if s["pytest_exit_code"] != 0 or not s["tests"]["passed"] or s.get("problems")]
    failed += ["%s (no report)" % lane for lane in missing]
    if failed:
        print("lanes with failures or no tests: " + ", ".join(failed))
    record.append("lanes: " + closing_line(overall))
    if args.record:
        header = run_header(args)   # before the file is opened: truncating it would read as an uncommitted change
        with open(args.record, "w", encoding="utf-8") as handle:
            handle.write(header + "\n\n" + "\n".join(record[:1]) + "\n" + "\n".join(record[1:]) + "\n")
            handle.write("\nupstream's own unit tests of the patched classes (lanes/upstream_tests.py):\n"
                         + upstream_table(summaries) + "\n")
    print(record[-1])
    return 1 if failed else 0


def run_header(args):
    """Where and when the recorded run ran: UTC start-end, machine, commit (and whether the
    tree had uncommitted changes), the caches' state at the start, the command."""
    import platform

    def git(*words):
        proc = subprocess.run(["git", *words], cwd=REPO, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    cpu = ""
    try:
        with open("/proc/cpuinfo", encoding="utf-8") as handle:
            cpu = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    except OSError:
        pass
    commit = git("rev-parse", "--short=12", "HEAD") or "unknown commit"
    dirty = " + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else ""
    started = time.strftime("%Y-%m-%d %H:%M", time.gmtime(args.started)) if args.started else "?"
    return ("ran %s-%s UTC on %s %s, %d cores%s: bash .ci/run at %s%s; %s; written by lanes/report.py summary --record"
            % (started, time.strftime("%H:%M", time.gmtime()), platform.system(), platform.machine(),
               os.cpu_count() or 0, " (%s)" % cpu if cpu else "", commit, dirty,
               args.caches or "caches at start not given"))


def all_test_seconds(summary):
    """The lane's own tests and upstream's unit tests (the cost table's "tests s")."""
    own = summary.get("test_seconds")
    upstream = (summary.get("upstream") or {}).get("seconds") or 0
    return None if own is None else own + upstream


def _secs(value):
    return "?" if value is None else "%.0f" % value


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = parser.add_subparsers(dest="command", required=True)
    run = sub.add_parser("run", help="run the lane's tests and print its table")
    run.add_argument("--lane", required=True)
    run.add_argument("--out", required=True, help="directory for junit.xml and summary.json")
    run.add_argument("--install-seconds", type=float, default=None, help="how long the lane's install took")
    run.add_argument("--tests-of", default=None, help="run this lane's tests (NPU_SHIM_LANE); default --lane")
    run.add_argument("--variant", action="store_true",
                     help="a Python variant of the --tests-of lane: leave out its tests marked "
                          "claimed(..., per_family=True) (NPU_SHIM_LANE_VARIANT=1; tests/conftest.py)")
    run.add_argument("--bytecode-store", default=None,
                     help="directory of pycs shared between lanes: link them in first, add this lane's after")
    run.add_argument("--stands-for", default=None,
                     help="the pin file's '# Stands for:' value: the installed releases must be among them")
    run.add_argument("--expected-skip", action="append", default=[],
                     help="a text every skip message must contain one of (the pin file's '# Expected skip:')")
    run.add_argument("--upstream-archive", default=None,
                     help="the source archive of the lane's release whose unit tests lanes/upstream_tests.py runs")
    run.add_argument("pytest_args", nargs=argparse.REMAINDER, help="after --: arguments for pytest")
    run.set_defaults(func=cmd_run)
    status = sub.add_parser("status", help="only the patch status of this venv, no tests (a probe's)")
    status.add_argument("--lane", required=True, help="the name the table is printed under")
    status.set_defaults(func=cmd_status)
    summary = sub.add_parser("summary", help="one table over every lane summary under REPORTS")
    summary.add_argument("reports")
    summary.add_argument("lanes", nargs="*", help="lanes to include (default: every report found)")
    summary.add_argument("--wall-seconds", type=float, default=None, help="wall time of the whole run")
    summary.add_argument("--jobs", type=int, default=None, help="how many lanes ran at once")
    summary.add_argument("--disk", default=None, help="directory whose disk use to print (the venvs)")
    summary.add_argument("--record", default=None,
                         help="also write the cost table with the run's header (commit, machine) to this file")
    summary.add_argument("--started", type=float, default=None, help="the run's start, seconds since the epoch")
    summary.add_argument("--caches", default=None, help="the caches' state at the start, for the header")
    summary.set_defaults(func=cmd_summary)
    args = parser.parse_args(argv)
    if getattr(args, "pytest_args", None) and args.pytest_args[0] == "--":
        args.pytest_args = args.pytest_args[1:]
    return args.func(args)


if __name__ == "__main__":
    sys.exit(main())
