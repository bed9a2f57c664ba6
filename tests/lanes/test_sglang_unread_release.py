"""Open windows: the newest sglang's code reported as the next release (one nobody has read)
gets every family it gets now, structure deciding, and ``npu-shim status`` says that release was
not read yet; strict mode refuses it.

Runs on the lane that pins the newest sglang (read from the pin files). A shadowing
``.dist-info`` first on ``sys.path`` gives the installed code another version:
``importlib.metadata`` reports the first distribution it finds. Each interpreter imports every
target the way the lane gate does (``npu-shim status --json --import``, lanes/report.py).
"""
import json
import os

import pytest
from reported_as import run_reported_as  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)
from sglang_support import newest  # noqa: E402
from packaging.version import Version

from npu_shim import evidence

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLACEHOLDERS = os.path.join(ROOT, "tests", "placeholders")
NEWEST, RELEASE = newest.LANE, newest.RELEASE
NEXT = "%d.%d.%d" % (Version(RELEASE).major, Version(RELEASE).minor, Version(RELEASE).micro + 1)

pytestmark = pytest.mark.lanes(NEWEST)

STATUS = """
import json, sys
from npu_shim.testing.towers import targets_importable
from npu_shim.cli import main
with targets_importable():
    main(["status", "--json", "--import"])
"""

STRICT = """
import importlib, sys
import npu_shim
from npu_shim.patch import PatchError
from npu_shim.testing.towers import targets_importable
with targets_importable():
    try:
        importlib.import_module(sys.argv[1])
    except PatchError as exc:
        print("PatchError: %s" % exc)
"""


def fresh(code, tmp_path, version=None, args=(), **env):
    return run_reported_as("sglang", code, tmp_path, version, args, path=[PLACEHOLDERS], **env)


def status(tmp_path, version=None):
    out = fresh(STATUS, tmp_path, version)
    lines = out.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("["))
    return {row["name"]: row for row in json.loads("\n".join(lines[start:])) if row["name"].startswith("sglang.")}


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    now = status(tmp_path_factory.mktemp("now"))
    later = status(tmp_path_factory.mktemp("next"), NEXT)
    return now, later


def test_the_next_release_with_the_newest_code_gets_every_family_it_gets_now(rows):
    """Defect caught: a family whose structural check proves the shape is fenced below the next
    release (a window closed at the newest release read), so the next release, with the very
    same code, is left unpatched."""
    now, later = rows
    applied = {name: row["family"] for name, row in now.items() if row["state"] == "applied"}
    assert len(applied) >= 6, now
    for name, row in now.items():
        assert later[name]["versions"]["sglang"] == NEXT, later[name]
        assert (later[name]["state"], later[name]["family"]) == (row["state"], row["family"]), (name, row, later[name])
        assert "not read yet" not in row["reason"], row
    for name, family in applied.items():
        note = "applied by structure; sglang %s not read yet (newest read for family %s: %s)" % (
            NEXT, family, evidence.read(name, family)[-1])
        assert later[name]["reason"] == "sglang %s; %s" % (NEXT, note), later[name]
        assert later[name]["release"] == NEXT and later[name]["read_as"] == [], later[name]


def test_strict_mode_refuses_a_release_not_read_yet(rows, tmp_path):
    now, _ = rows
    name = sorted(name for name, row in now.items() if row["state"] == "applied")[0]
    family = now[name]["family"]
    refused = fresh(STRICT, tmp_path, NEXT, args=(now[name]["target"],), NPU_SHIM_STRICT="1", NPU_SHIM_ENABLE=name)
    assert ("PatchError: patch %r on %s: family %s accepts the code, but sglang %s not read yet"
            % (name, now[name]["target"], family, NEXT)) in refused, refused
    allowed = fresh(STRICT, tmp_path, None, args=(now[name]["target"],), NPU_SHIM_STRICT="1", NPU_SHIM_ENABLE=name)
    assert "PatchError" not in allowed, allowed
