"""Every path of this project that a doc or a docstring cites exists.

A test moved or renamed leaves its citations behind (``docs/reference.md`` is generated from the
patches' docstrings, so a stale path travels into it). The scan reads the docs, the README and the
project's code (docstrings and comments included) for paths under the project's own top-level
folders, and fails naming each one that is not in the checkout and where it is cited.

Not project paths, so not checked: upstream's test trees (``tests/ut/...``, ``tests/kernels/...``),
``docs/source/...`` (vllm-ascend's documentation tree) and
``docs/context/...`` (op-plugin's operator pages), which the text names with their repository; and
templates whose file part is a placeholder in capitals (``census-LANE.json``).
"""
import os
import re
import subprocess

import pytest

pytestmark = pytest.mark.lanes("base")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCANNED = ("README.md", "docs", "npu_shim", "lanes", "benchmarks", "noxfile.py", "setup.cfg", "sitecustomize.py",
           "tests/lanes", "tests/conftest.py", "tests/placeholders", ".ci")
# tests/ut/..., tests/kernels/... are upstream's test trees (vllm-ascend's, vLLM's), cited by their path there
CITED = re.compile(r"(?<![\w/.-])((?:tests/lanes/|tests/placeholders/|tests/test_|tests/conftest|npu_shim/|lanes/|"
                   r"benchmarks/|docs/|\.ci/)[\w./-]*\.(?:py|md|txt|json|cfg))\b")
UPSTREAMS_TREES = ("docs/source/", "docs/context/")
TEMPLATE = re.compile(r"/[^/]*[A-Z]{3,}[^/]*$")


def cited_paths(text):
    for match in CITED.finditer(text):
        path = match.group(1)
        if not path.startswith(UPSTREAMS_TREES) and not TEMPLATE.search(path):
            yield path


def scanned_files():
    listed = subprocess.run(["git", "ls-files", "-z", *SCANNED], cwd=REPO, capture_output=True, check=True).stdout
    for relative in filter(None, listed.decode().split("\0")):
        if relative.startswith("benchmarks/results/") or not relative.endswith((".py", ".md", ".txt", ".cfg")):
            continue                      # results are written by runs, and name the machine's paths
        yield relative


def test_every_cited_project_path_exists():
    missing = []
    for relative in scanned_files():
        with open(os.path.join(REPO, relative), encoding="utf-8") as handle:
            text = handle.read()
        missing += ["%s (cited in %s)" % (path, relative) for path in sorted(set(cited_paths(text)))
                    if not os.path.exists(os.path.join(REPO, path))]
    assert not missing, "project paths cited but not in the checkout:\n" + "\n".join(missing)


def test_the_scan_finds_a_missing_path_and_leaves_upstreams_alone():
    text = ("see tests/lanes/test_gone.py, docs/usage.md, op-plugin docs/context/page.md, "
            "vllm-ascend's docs/source/community/versioning_policy.md, its tests/ut/conftest.py "
            "and benchmarks/results/census-LANE.json")
    assert list(cited_paths(text)) == ["tests/lanes/test_gone.py", "docs/usage.md"]


RUNNER = re.compile(r"\b(nox|uv)(==[\w.]+)?(?=[\s&]|$)")


def runner_pins(text):
    """{tool: pin or ''} of the test runner's install command in ``text`` (``pip install nox uv``)."""
    for line in text.splitlines():
        if "pip install" in line and re.search(r"\bnox\b", line):
            command = line.split("pip install", 1)[1].split("&&")[0]
            return {match.group(1): match.group(2) or "" for match in RUNNER.finditer(command)}
    return {}


def test_the_readme_installs_the_runner_ci_runs():
    """The README's test command installs nox and uv at the versions .ci/run pins (an unpinned
    ``pip install nox uv`` takes whatever is newest: not the runner CI proved)."""
    with open(os.path.join(REPO, "README.md"), encoding="utf-8") as handle:
        readme = runner_pins(handle.read())
    with open(os.path.join(REPO, ".ci", "run"), encoding="utf-8") as handle:
        ci = runner_pins(handle.read())
    assert set(ci) == {"nox", "uv"} and all(ci.values()), ci
    assert readme == ci
    assert runner_pins("pip install nox uv && nox") == {"nox": "", "uv": ""}
