"""Lane selection.

Every test belongs to one or more *lanes* (pinned upstream stacks, see ``lanes/``).
A test module says which with ``pytestmark = pytest.mark.claimed(<patch>, ...)`` (below);
unmarked tests belong to the ``base`` lane (no upstream framework installed).
``NPU_SHIM_LANE`` (set by the nox sessions) names the lane being run; tests of
other lanes are deselected, never skipped, so a lane that silently runs nothing
shows up as "no tests ran" instead of a green run.

A test that exercises a patch names it: ``pytest.mark.patch("sglang.cp_fia")``
(module level in ``pytestmark``, or per test where a module exercises several).
Each selected test's patch names are recorded as ``<property name="patch">`` in
the junit XML, from which ``lanes/report.py`` counts the tests of each patch.

A test names its lanes by what it is about, derived from the declarations and the pin files,
not by a hand-kept list: ``pytest.mark.claimed("vllm.qwen2_vl_host_lengths")`` adds every lane
whose pinned releases a family of that patch claims (its fence admits them;
``npu_shim.reference.claimed_lanes``), the same lanes on which ``lanes/report.py`` requires the
patch applied and a test marked for it passed. Reading one more release into a fence, or adding
a lane, moves the test with no edit here. Keywords narrow or change the selection
(``npu_shim.reference.lane_selection`` computes it):

* ``implemented_in="pkg.module"`` (or a tuple): only the families whose implementation lives in
  that module: a test of one family's code names the code it exercises, not the family's id or
  its lanes. A module no family of the patch lives in fails collection.
* ``per_family=True``: one lane per family, the lane pinning the family's newest release, and
  none in the Python-variant lanes (``# Tests of:``, where everything else of their base lane
  runs): for a test that starts fresh interpreters to show a switch or strict mode (the
  engine's handling of one family, 5-20 s each).
* ``window=True``: every lane whose pins the patch's window admits (``Patch.window``: its
  ``requires``, and its families' fences where every family is fenced), claimed or not (a
  patch whose family names no release, told apart by structure alone).
* ``outside="all"`` / ``"below"`` / ``"above"`` / ``"newest"`` (or a tuple): lanes that pin
  every distribution the patch requires and that no family claims, where the patch must be out
  with its reason: all of them; the one nearest the claimed lanes below or above them; the
  newest. Representatives keep a skip test's CI time flat as lanes are added.
* ``pinned={dist: condition}`` narrows any of these by a lane's pins: a PEP 440 range, a list
  of releases, or None for "not installed". For a test whose subject is one release's code
  (the release of an upstream fix, a bug one release had), the release is the literal, never
  the lane.

Several ``claimed`` markers on one node add up; a test's own markers replace its module's. A
selection that yields no lane, or an unknown keyword, fails collection naming the test.
``pytest.mark.lanes(*names)`` names lanes literally: for the base lane and for the tests of this
mechanism. ``pytest.mark.engine`` (tests/lanes/test_engine_*.py: a whole engine started, 20-60 s)
keeps a test out of the Python-variant lanes: it runs once per stack, in its lane; so does
``pytest.mark.machinery`` (tests/test_markers.py: the tests of this selection).

The markers are checked over every collected test, selected or not: a lane name
that nox does not define (a pin file ``lanes/<name>.txt`` whose name does not
start with ``_``) or a patch name that ``npu_shim.patches.BUILTIN_PATCHES`` does
not list fails collection, naming the test and the name, instead of leaving the
test in no lane or its patch uncounted.
"""
import functools
import hashlib
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

BASE_LANE = "base"
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
LANES_DIR = os.path.join(REPO, "lanes")


def pytest_configure(config):
    config.addinivalue_line("markers", "lanes(*names): pinned stacks this test runs in")
    config.addinivalue_line("markers", "patch(*names): the npu-shim patches this test exercises")
    config.addinivalue_line("markers", "claimed(*patches, implemented_in=(), per_family=False, window=False, "
                                       "outside=(), pinned=None): lanes derived from the patches' declarations "
                                       "and the lanes' pins (see tests/conftest.py)")
    config.addinivalue_line("markers", "float32_math: a math check that feeds the emulated attention "
                                       "ops float32, which the real ops reject (see float32_math)")
    config.addinivalue_line("markers", "hardware_dtypes: only the dtypes the real ops take, also in a "
                                       "float32_math module")
    config.addinivalue_line("markers", "keeps_process_state: sets up process-wide state and keeps it (sglang's "
                                       "one-rank process group); runs after the lane's other tests")
    config.addinivalue_line("markers", "engine: starts a whole engine on the emulated device (20-60 s); runs in "
                                       "its lanes, not in their Python variants (see once_per_stack_in_variant)")
    config.addinivalue_line("markers", "machinery: a test of the project's own lane selection (this file's markers); "
                                       "runs in its lane, not in its Python variants (see once_per_stack_in_variant)")


def defined_lanes(lanes_dir=LANES_DIR):
    """The lanes nox defines: the pin files ``<name>.txt`` not starting with ``_``."""
    return sorted(name[:-len(".txt")] for name in os.listdir(lanes_dir)
                  if name.endswith(".txt") and not name.startswith("_"))


def builtin_patch_names():
    """The names in ``npu_shim.patches.BUILTIN_PATCHES``, read without importing ``npu_shim``
    (which installs the shim): the index file of the npu_shim the tests import (the lane's
    installed copy, or this checkout) is loaded by path under a private name."""
    spec = importlib.util.find_spec("npu_shim")   # locates the package, does not run it
    root = spec.submodule_search_locations[0] if spec and spec.submodule_search_locations else \
        os.path.join(REPO, "npu_shim")
    index = importlib.util.spec_from_file_location("_npu_shim_patch_index",
                                                   os.path.join(root, "patches", "__init__.py"))
    module = importlib.util.module_from_spec(index)
    index.loader.exec_module(module)
    return [name for name, _ in module.BUILTIN_PATCHES]


CLAIMED_KEYWORDS = ("implemented_in", "outside", "window", "per_family", "pinned")


def claimed_specs(item):
    """``{node: [spec]}`` for the ``claimed`` markers of ``item``'s chain (test, class, module):
    one spec, ``json.dumps([patch, keywords])``, per patch the marker names. An unknown keyword
    or a value JSON cannot carry fails collection naming the test."""
    out = {}
    for node in item.listchain():
        for mark in node.own_markers:
            if mark.name != "claimed":
                continue
            unknown = set(mark.kwargs) - set(CLAIMED_KEYWORDS)
            if unknown:
                raise pytest.UsageError("%s: pytest.mark.claimed takes no %s (it takes %s)" % (
                    item.nodeid, ", ".join(sorted(unknown)), ", ".join(CLAIMED_KEYWORDS)))
            try:
                out.setdefault(node, []).extend(json.dumps([patch, mark.kwargs], sort_keys=True)
                                                for patch in mark.args)
            except TypeError as exc:
                raise pytest.UsageError("%s: pytest.mark.claimed(%s): %s" % (
                    item.nodeid, ", ".join("%s=%r" % kv for kv in sorted(mark.kwargs.items())), exc))
    return out


@functools.lru_cache(maxsize=None)
def declared_lanes(specs):
    """``{spec: {"lanes": [...]} or {"error": why}}`` for the ``claimed`` specs (a tuple of
    :func:`claimed_specs` strings), from the installed npu_shim's declarations and this
    checkout's pin files (``npu_shim.reference.lane_selection``), computed in a child
    interpreter with the shim off (``import npu_shim`` installs it, which this collecting
    process must not do before the tests ask for it)."""
    code = textwrap.dedent("""
        import json, sys
        from npu_shim import reference
        out = {}
        for spec in json.load(sys.stdin):
            patch, keywords = json.loads(spec)
            try:
                out[spec] = {"lanes": reference.lane_selection(sys.argv[1], patch, **keywords)}
            except ValueError as exc:
                out[spec] = {"error": str(exc)}
        json.dump(out, sys.stdout)
    """)
    cached = _selection_cache(specs)
    if cached and os.path.exists(cached):
        with open(cached, encoding="utf-8") as handle:
            return json.load(handle)
    env = dict(os.environ, NPU_SHIM="0")
    proc = subprocess.run([sys.executable, "-c", code, REPO], input=json.dumps(list(specs)), env=env,
                          capture_output=True, text=True, cwd=os.path.dirname(sys.executable))
    if proc.returncode != 0:
        raise pytest.UsageError("cannot derive the lanes of pytest.mark.claimed: " + proc.stderr.strip()[-2000:])
    if cached:
        os.makedirs(os.path.dirname(cached), exist_ok=True)
        with open(cached + ".%d" % os.getpid(), "w", encoding="utf-8") as handle:
            handle.write(proc.stdout)
        os.replace(cached + ".%d" % os.getpid(), cached)
    return json.loads(proc.stdout)


def _selection_cache(specs):
    """Where :func:`declared_lanes` keeps its answer for these inputs, or None (no
    ``NPU_SHIM_TEST_SELECTION_CACHE`` folder: nox sets one, so the 40 lanes of a CI run compute
    it once, 3 s a lane). The name is a digest of everything the answer is read from: the specs,
    every file of the installed npu_shim and every pin file; a change to any gives a new name."""
    folder = os.environ.get("NPU_SHIM_TEST_SELECTION_CACHE")
    if not folder:
        return None
    digest = hashlib.sha256(json.dumps(list(specs)).encode())
    spec = importlib.util.find_spec("npu_shim")   # locates the package, does not run it
    for root in (spec.submodule_search_locations[0], LANES_DIR):
        for folder_path, folders, files in os.walk(root):
            folders[:] = sorted(name for name in folders if name != "__pycache__")
            for name in sorted(files):
                if name.endswith((".py", ".json", ".txt")):
                    path = os.path.join(folder_path, name)
                    digest.update(os.path.relpath(path, root).encode() + b"\0")
                    with open(path, "rb") as handle:
                        digest.update(handle.read() + b"\0")
    return os.path.join(folder, digest.hexdigest() + ".json")


def _lanes_of(item, selections, variant=False):
    """The lanes of the closest node (test, class, module) that names any: its ``lanes`` and
    the lanes its ``claimed`` markers select (``selections``: :func:`declared_lanes`),
    together; a test's own marker replaces its module's, so a test marked for one lane outside
    a module's claims stays there. ``per_family=True`` selects no lane in a variant run (a lane
    that runs another lane's tests on another Python, ``NPU_SHIM_LANE_VARIANT=1``)."""
    specs = claimed_specs(item)
    for node in item.listchain()[::-1]:
        marks = [m for m in node.own_markers if m.name == "lanes"]
        if marks or node in specs:
            lanes = set()
            for mark in marks:
                if mark.kwargs:
                    raise pytest.UsageError("%s: pytest.mark.lanes takes no %s" % (
                        item.nodeid, ", ".join(sorted(mark.kwargs))))
                lanes.update(mark.args)
            for spec in specs.get(node, ()):
                if variant and json.loads(spec)[1].get("per_family"):
                    continue
                lanes.update(selections[spec]["lanes"])
            return lanes
    return {BASE_LANE}


ONCE_PER_STACK = ("engine", "machinery")


def once_per_stack_in_variant(item, variant):
    """A test marked ``engine`` or ``machinery`` in a Python-variant run (``NPU_SHIM_LANE_VARIANT=1``).
    A variant shows the shim on another interpreter with its base lane's tests. An engine test's
    subject is the stack (vllm-ascend's or sglang's start-up, model and backend), a machinery test's
    the project's own lane selection (this file's markers, run by every lane for its own selection
    on its own interpreter): the same on either Python, so each runs once, in its lane, and keeps a
    variant's CI time that of its unit tests."""
    return variant and any(item.get_closest_marker(name) is not None for name in ONCE_PER_STACK)


def patches_of(item):
    """The patch names of every ``patch`` marker on the test (module, class and function)."""
    names = []
    for marker in item.iter_markers("patch"):
        names.extend(name for name in marker.args if name not in names)
    return names


def marker_problems(items, lanes, patches):
    """One line per unknown lane or patch name (or empty marker) on ``items``."""
    kinds = (("lanes", "lane", lanes, "nox defines"), ("patch", "patch", patches, "BUILTIN_PATCHES"),
             ("claimed", "patch", patches, "BUILTIN_PATCHES"))
    problems = []
    for item in items:
        for marker_name, what, known, source in kinds:
            for marker in item.iter_markers(marker_name):
                if not marker.args:
                    problems.append("%s: pytest.mark.%s() names no %s" % (item.nodeid, marker_name, what))
                problems += ["%s: unknown %s %r in pytest.mark.%s (%s: %s)"
                             % (item.nodeid, what, name, marker_name, source, ", ".join(known))
                             for name in marker.args if name not in known]
    return problems


def pytest_collection_modifyitems(config, items):
    problems = marker_problems(items, defined_lanes(), builtin_patch_names())
    if problems:
        raise pytest.UsageError("bad test markers:\n  " + "\n  ".join(dict.fromkeys(problems)))
    specs = {item: claimed_specs(item) for item in items}
    selections = declared_lanes(tuple(sorted({spec for by_node in specs.values()
                                              for node_specs in by_node.values() for spec in node_specs})))
    problems = ["%s: %s" % (item.nodeid, selections[spec]["error"]) for item, by_node in specs.items()
                for node_specs in by_node.values() for spec in node_specs if "error" in selections[spec]]
    if problems:
        raise pytest.UsageError("bad pytest.mark.claimed:\n  " + "\n  ".join(dict.fromkeys(problems)))
    lane = os.environ.get("NPU_SHIM_LANE", BASE_LANE)
    variant = os.environ.get("NPU_SHIM_LANE_VARIANT") == "1"
    selected, deselected = [], []
    for item in items:
        wanted = lane in _lanes_of(item, selections, variant) and not once_per_stack_in_variant(item, variant)
        (selected if wanted else deselected).append(item)
    if deselected:
        config.hook.pytest_deselected(items=deselected)
        items[:] = selected
    # A test that sets up process-wide state and keeps it (sglang's one-rank process group, which
    # a test of a two-rank topology must not find) runs after the others.
    items.sort(key=lambda item: item.get_closest_marker("keeps_process_state") is not None)
    for item in items:
        item.user_properties.extend(("patch", name) for name in patches_of(item))


@pytest.fixture(autouse=True)
def float32_math(request):
    """Tests marked ``float32_math`` run inside ``float32_not_on_hardware()``: float32 against
    the float64 reference measures the arithmetic to ~1e-7, which half precision cannot;
    every other test (and one marked ``hardware_dtypes`` inside such a module) gets the dtypes
    the vendor documents for the op (bfloat16/float16 on A2, float16 on 310P) and fails on
    float32."""
    if request.node.get_closest_marker("float32_math") is None or \
            request.node.get_closest_marker("hardware_dtypes") is not None:
        yield
        return
    from npu_shim.emulation.dtypes import float32_not_on_hardware

    with float32_not_on_hardware():
        yield


@pytest.fixture(scope="session", autouse=True)
def neutral_working_directory(tmp_path_factory):
    """Every test runs with an empty directory as its working directory.

    ``python -c`` and ``python -m`` put the working directory first on ``sys.path``; started
    from the checkout, a test's subprocess would import the checkout's ``npu_shim`` instead of
    the installed one, and a packaging defect (a file the wheel leaves out) would go unseen.
    An empty directory does this on every Python the lanes run (``-P`` needs 3.11+) and for
    every subprocess, including those a test does not start itself. Tests that mean to run
    the checkout say so with ``PYTHONPATH=<checkout>`` (its root sitecustomize.py)."""
    neutral = str(tmp_path_factory.mktemp("cwd"))
    before = os.getcwd()
    os.chdir(neutral)
    try:
        yield neutral
    finally:
        os.chdir(before)


def clean_env(**extra):
    """The current environment without PYTHONPATH or NPU_SHIM* switches."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("NPU_SHIM")}
    env.update({k: v for k, v in extra.items() if v is not None})
    return env


@pytest.fixture
def make_env():
    """``make_env(**vars)``: a clean environment plus these variables."""
    return clean_env


@pytest.fixture
def run_python():
    """Run ``python -c code`` in a fresh interpreter; returns CompletedProcess. Unless ``cwd``
    is given, the interpreter starts in the empty working directory (neutral_working_directory),
    so it imports the installed ``npu_shim``."""
    import subprocess
    import sys

    def run(code, *, env=None, cwd=None, args=(), check=True, timeout=120):
        proc = subprocess.run(
            [sys.executable, "-c", code, *args],
            env=clean_env() if env is None else env,
            cwd=cwd,
            capture_output=True,
            text=True,
            timeout=timeout,
        )
        if check and proc.returncode != 0:
            raise AssertionError(
                "exit %d\n--- stdout\n%s\n--- stderr\n%s" % (proc.returncode, proc.stdout, proc.stderr)
            )
        return proc

    return run
