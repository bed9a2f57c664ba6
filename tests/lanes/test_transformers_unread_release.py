"""Open windows on transformers: ``transformers.attn_check``'s window no longer stops at the next
major release nobody read. The lane's transformers code reported as the major release after every
release read (one nobody has read) gets the patch, its structural check deciding (the method takes
the requested name first), and ``npu-shim status`` says that release was not read yet; strict mode
refuses it.

Runs on the lane that pins the newest transformers among the lanes the patch claims (read from the
pin files and the declaration). A shadowing ``.dist-info`` first on ``sys.path`` gives the
installed code another version: ``importlib.metadata`` reports the first distribution it finds.
Each interpreter imports the patch's target the way the lane gate does (``npu-shim status --json
--import``, lanes/report.py). The control (the same next release with code of another shape,
refused by structure) is tests/lanes/test_vllm_ascend_unread_release.py's.
"""
import importlib
import json
import os

import pytest
from reported_as import run_reported_as  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)
from packaging.version import Version

from npu_shim import evidence
from npu_shim.patches import BUILTIN_PATCHES
from npu_shim.reference import claimed_lanes, lane_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIST = "transformers"
NAME = "transformers.attn_check"
FAMILY = importlib.import_module(dict(BUILTIN_PATCHES)[NAME]).PATCH.families[-1].name   # the newest family
_TABLE = lane_table(ROOT)
NEWEST = max(claimed_lanes(ROOT)[NAME], key=lambda lane: (Version(_TABLE[lane][DIST]), lane))
NEXT = "%d.0.0" % (max(Version(r) for r in evidence.read(NAME, FAMILY) + [_TABLE[NEWEST][DIST]]).major + 1)

pytestmark = [pytest.mark.lanes(NEWEST), pytest.mark.patch(NAME)]

STATUS = """
from npu_shim.testing.towers import targets_importable
from npu_shim.cli import main
with targets_importable():
    main(["status", "--json", "--import"])
"""

STRICT = """
import importlib, sys
from npu_shim.patch import PatchError
from npu_shim.testing.towers import targets_importable
try:
    with targets_importable():
        importlib.import_module(sys.argv[1])
except PatchError as exc:
    print("PatchError: %s" % exc)
"""


def fresh(code, tmp_path, version=None, args=(), **env):
    return run_reported_as(DIST, code, tmp_path, version, args, NPU_SHIM_ENABLE=NAME, **env)


def row(tmp_path, version=None):
    lines = fresh(STATUS, tmp_path, version).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("["))
    return next(r for r in json.loads("\n".join(lines[start:])) if r["name"] == NAME)


def test_the_next_major_release_with_this_code_gets_the_patch_and_says_not_read_yet(tmp_path_factory):
    """Defect caught: the window closed at the next major release (``<6``) only because no such
    release was read, so it, with code the structural check accepts, is left unpatched."""
    now = row(tmp_path_factory.mktemp("now"))
    later = row(tmp_path_factory.mktemp("next"), NEXT)
    assert (now["state"], now["family"]) == ("applied", FAMILY), now
    assert "not read yet" not in now["reason"], now
    assert later["versions"][DIST] == NEXT, later
    assert (later["state"], later["family"]) == ("applied", FAMILY), later
    assert later["reason"].endswith("applied by structure; %s %s not read yet (newest read for family %s: %s)"
                                    % (DIST, NEXT, FAMILY, evidence.read(NAME, FAMILY)[-1])), later


def test_strict_mode_refuses_a_release_not_read_yet(tmp_path):
    target = "transformers.modeling_utils"
    refused = fresh(STRICT, tmp_path, NEXT, args=(target,), NPU_SHIM_STRICT="1")
    assert ("PatchError: patch %r on %s: family %s accepts the code, but %s %s not read yet"
            % (NAME, target, FAMILY, DIST, NEXT)) in refused, refused
    allowed = fresh(STRICT, tmp_path, None, args=(target,), NPU_SHIM_STRICT="1")
    assert "PatchError" not in allowed, allowed
