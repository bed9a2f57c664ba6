"""No release literal in tests outside the tests of the version machinery (issue 40, item 8).

A release written into a test (``"0.5.23"``, ``Version("0.24")``, ``version.startswith("0.22")``)
is a second home for a fact whose home is a family's fence, a ``claimed(...)`` marker (the lanes a
test runs on, ``pinned=`` for a test whose subject is one release's code: tests/conftest.py), the
installed version read through ``npu_shim.engine.guards.installed_version``, or a structural fact
read from upstream's code. This test reads every string constant of ``tests/`` and
``npu_shim/testing/`` (docstrings and comments are prose, not facts the tests act on) and fails
naming file:line for each release-like one outside a ``claimed(...)`` marker's arguments.
"""
import ast
import os
import re

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ROOTS = ("tests", os.path.join("npu_shim", "testing"))

_SUFFIX = r"((rc|a|b)\d+|\.post\d+|\.dev\d+)"
# 0.5.23, 0.30.0rc2, v0.13.0, 0.5.14.dev3, 0.24rc1, and PEP 440 ranges of them (">=0.5.13,<0.5.23");
# not four numbers (an IPv4 address) and not a bare "0.5" (a float), which counts only as the
# argument of Version(...), parse(...), .startswith(...) or vllm_version_is(...)
_RELEASE = r"v?\d+\.\d+\.\d+%s?|v?\d+\.\d+%s" % (_SUFFIX, _SUFFIX)
RELEASE = re.compile(r"(%s)|\s*(([<>=!~]=?|===?)\s*(%s)\s*,?\s*)+" % (_RELEASE, _RELEASE))
SHORT = re.compile(r"v?\d+\.\d+(\.\d+)*%s?" % _SUFFIX)
VERSION_CALLS = ("Version", "parse", "startswith", "vllm_version_is")

# The version machinery's own tests: their subject is how a release is read, compared, fenced
# or recorded, so releases (most of them toy ones) are their data.
ALLOWED = {
    "tests/test_machinery.py": "fences, guard_failure and admitting_families on toy releases",
    "tests/test_family_by_structure_engine.py": "select_family on dev/local releases of a toy dist",
    "tests/test_evidence.py": "the evidence record's merge of releases read per family",
    "tests/test_reference.py": "the reference tables' cell per release (read only / tested / not served)",
    "tests/test_report_counts.py": "lanes/report.py's rows of releases found per family",
    "tests/test_stats.py": "guards.installed_version from metadata and __version__",
    "tests/test_upstream_tests.py": "lanes/upstream_tests.py's tag windows (in_window)",
    "tests/test_emulation_paged.py": "the emulated CANN release reader and its per-release TND rule",
    "tests/lanes/test_sglang_vision_head_pad.py": "cann_decision / toolkit_version: the CANN release rule",
    "tests/test_release_literals.py": "this test's own examples",
    "tests/test_window.py": "Patch.window: fences joined into a window, on toy releases",
    "tests/test_retirement_guards.py": "guards.upstream_fixed: a window's upper bound against toy releases",
}

# Files with release literals still to convert: listed so that the gate holds every other file
# meanwhile; each entry goes when its file is converted, and an entry whose file has none left
# fails below. Empty since issue 40's conversions.
PENDING = set()


def _claimed_call(node):
    func = node.func
    return isinstance(func, ast.Attribute) and func.attr == "claimed"


def release_literals(path):
    """``[(line, text)]`` for the release-like string constants of the Python file ``path``."""
    with open(path, encoding="utf-8") as source:
        tree = ast.parse(source.read(), path)
    prose, exempt, short_ok = set(), set(), set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body \
                and isinstance(node.body[0], ast.Expr) and isinstance(node.body[0].value, ast.Constant):
            prose.add(id(node.body[0].value))
        if isinstance(node, ast.Call):
            inner = {id(n) for n in ast.walk(node) if n is not node}
            if _claimed_call(node):
                exempt |= inner
            func = node.func
            if (func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")) in VERSION_CALLS:
                short_ok |= inner
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                and id(node) not in prose and id(node) not in exempt:
            if RELEASE.fullmatch(node.value) or (id(node) in short_ok and SHORT.fullmatch(node.value)):
                found.append((node.lineno, node.value))
    return sorted(found)


def python_files():
    for root in ROOTS:
        for folder, _, names in os.walk(os.path.join(REPO, root)):
            for name in sorted(names):
                if name.endswith(".py"):
                    yield os.path.relpath(os.path.join(folder, name), REPO).replace(os.sep, "/")


def test_no_release_literal_outside_the_version_machinerys_tests():
    found = ["%s:%d: %r" % (path, line, text) for path in python_files()
             if path not in ALLOWED and path not in PENDING
             for line, text in release_literals(os.path.join(REPO, path))]
    assert not found, ("release literals in tests (read the fact from its home: a family's fence, "
                       "a claimed(...) marker, guards.installed_version, or upstream's code):\n  "
                       + "\n  ".join(found))


def test_the_lists_name_files_that_exist_and_pending_ones_that_still_need_it():
    for path in list(ALLOWED) + sorted(PENDING):
        assert os.path.isfile(os.path.join(REPO, path)), path
    converted = [path for path in sorted(PENDING) if not release_literals(os.path.join(REPO, path))]
    assert not converted, "no release literal left, take off PENDING: %s" % ", ".join(converted)


def test_the_scan_finds_what_it_is_for(tmp_path):
    sample = tmp_path / "sample.py"
    sample.write_text(
        '"""A docstring naming 0.5.23 is prose."""\n'
        'import pytest\n'
        'from packaging.version import Version\n'
        'pytestmark = pytest.mark.claimed("p", pinned={"sglang": ["0.5.23"], "vllm": ">=0.13"})\n'
        'A = "0.5.23"\n'
        'B = Version("0.24")\n'
        'C = version.startswith("0.22")\n'
        'D = {"vllm-ascend": "0.30.0rc2", "tag": "v0.13.0"}\n'
        'E = ">=0.5.13,<0.5.23"\n'
        'F = ("127.0.0.1", "0.5", "1.0 MiB", "8 heads")\n')
    assert [text for _, text in release_literals(str(sample))] == [
        "0.5.23", "0.24", "0.22", "0.30.0rc2", "v0.13.0", ">=0.5.13,<0.5.23"]
