"""Open windows on vllm-ascend: the newest vllm-ascend's code reported as the next release (one
nobody has read) gets every family it gets now, structure deciding, and ``npu-shim status`` says
that release was not read yet; strict mode refuses it. The control: the same next release with
code of another shape (one edit anchor gone) is refused by structure, not applied.

Runs on the lane that pins the newest vllm-ascend inside the MiMo patches' window (read from the
pin files and the declarations: the lane where ``vllm.ascend_attention_v_head_dim`` applies). A
shadowing ``.dist-info`` first on ``sys.path`` gives the installed code another version:
``importlib.metadata`` reports the first distribution it finds. Each interpreter imports every
target the way the lane gate does (``npu-shim status --json --import``, lanes/report.py). The
control's other shape is made at test time from the installed wheel's own ``vllm_ascend/utils.py``
(``calc_split_factor``'s ``total / num`` made ``total // num``), loaded in its place by a finder
first on ``sys.meta_path``: nothing of upstream's is copied into the repository.
"""
import importlib
import importlib.util
import json
import os

import pytest
from reported_as import run_reported_as  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)
from packaging.version import Version

from npu_shim import evidence
from npu_shim.engine.guards import window_admits
from npu_shim.patches import BUILTIN_PATCHES
from npu_shim.reference import lane_table, variant_lanes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
DIST = "vllm-ascend"
# The patches of vLLM's MiMo layers with V != K on vllm-ascend: the case (a next
# vllm-ascend with this release's code refused MiMo layers while their fences stopped below it).
MIMO = ("vllm.ascend_attention_v_head_dim", "vllm.ascend_kv_split_exact", "vllm.ascend_qkv_v_head_size")
CONTROL = "vllm.ascend_kv_split_exact"


def _patch(name):
    return importlib.import_module(dict(BUILTIN_PATCHES)[name]).PATCH


_LANES = {lane: pins for lane, pins in lane_table(ROOT).items()
          if DIST in pins and lane not in variant_lanes(ROOT) and window_admits(_patch(MIMO[0]), pins)}
NEWEST = max(_LANES, key=lambda lane: (Version(_LANES[lane][DIST]), lane))
RELEASE = Version(_LANES[NEWEST][DIST])
NEXT = "%d.%d.0rc1" % (RELEASE.major, RELEASE.minor + 1)

pytestmark = [pytest.mark.lanes(NEWEST), pytest.mark.patch(*MIMO)]

# A finder that loads vllm_ascend.utils from argv[1] (the other shape), when given.
SHAPE = """
import importlib.abc, importlib.util, sys
class OtherShape(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name == "vllm_ascend.utils":
            return importlib.util.spec_from_file_location(name, sys.argv[1])
        return None
if len(sys.argv) > 1 and sys.argv[1]:
    sys.meta_path.insert(0, OtherShape())
"""

STATUS = SHAPE + """
from npu_shim.testing.towers import targets_importable
from npu_shim.cli import main
with targets_importable():
    main(["status", "--json", "--import"])
"""

STRICT = SHAPE + """
import importlib
from npu_shim.patch import PatchError
from npu_shim.testing.towers import targets_importable
try:    # the target may be imported by the block itself (vllm_ascend.utils, by the ops package)
    with targets_importable():
        importlib.import_module(sys.argv[2])
except PatchError as exc:
    print("PatchError: %s" % exc)
"""


def fresh(code, tmp_path, version=None, args=("",), **env):
    return run_reported_as(DIST, code, tmp_path, version, args, **env)


def status(tmp_path, version=None, shape=""):
    lines = fresh(STATUS, tmp_path, version, args=(shape,)).splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith("["))
    return {row["name"]: row for row in json.loads("\n".join(lines[start:]))
            if any(_patch(row["name"]).family_dist(f) == DIST for f in _patch(row["name"]).families)}


def other_shape(tmp_path):
    """The installed ``vllm_ascend/utils.py`` with ``calc_split_factor``'s split made ``//``."""
    package = importlib.util.find_spec("vllm_ascend").submodule_search_locations[0]
    with open(os.path.join(package, "utils.py"), encoding="utf-8") as handle:
        text = handle.read()
    assert text.count("total / num") == 1, "calc_split_factor's split is not the one this control edits"
    path = tmp_path / "utils.py"
    path.write_text(text.replace("total / num", "total // num"))
    return str(path)


@pytest.fixture(scope="module")
def rows(tmp_path_factory):
    now = status(tmp_path_factory.mktemp("now"))
    later = status(tmp_path_factory.mktemp("next"), NEXT)
    return now, later


def test_the_next_release_with_the_newest_code_gets_every_family_it_gets_now(rows):
    """Defect caught: a family whose structural check proves the shape is fenced below the next
    release (vllm-ascend's MiMo fences stopped at the release after the newest read), so the next
    release, with the very same code, is left unpatched."""
    now, later = rows
    applied = {name: row["family"] for name, row in now.items() if row["state"] == "applied"}
    assert set(MIMO) <= set(applied), now
    for name, row in now.items():
        assert later[name]["versions"][DIST] == NEXT, later[name]
        assert (later[name]["state"], later[name]["family"]) == (row["state"], row["family"]), (name, row, later[name])
        assert "not read yet" not in row["reason"], row
    for name, family in applied.items():
        note = "applied by structure; %s %s not read yet (newest read for family %s: %s)" % (
            DIST, NEXT, family, evidence.read(name, family)[-1])
        assert later[name]["reason"].endswith(note), later[name]
        assert later[name]["release"] == NEXT and later[name]["read_as"] == [], later[name]


def test_strict_mode_refuses_a_release_not_read_yet(rows, tmp_path):
    now, _ = rows
    family, target = now[CONTROL]["family"], now[CONTROL]["target"]
    refused = fresh(STRICT, tmp_path, NEXT, args=("", target), NPU_SHIM_STRICT="1", NPU_SHIM_ENABLE=CONTROL)
    assert ("PatchError: patch %r on %s: family %s accepts the code, but %s %s not read yet"
            % (CONTROL, target, family, DIST, NEXT)) in refused, refused
    allowed = fresh(STRICT, tmp_path, None, args=("", target), NPU_SHIM_STRICT="1", NPU_SHIM_ENABLE=CONTROL)
    assert "PatchError" not in allowed, allowed


def test_the_next_release_with_code_of_another_shape_is_refused_by_structure(rows, tmp_path):
    """The control: the open fence admits the next release, the structural check decides. Defect
    caught: a family applied on a version alone (a check that cannot fail), which would edit
    code it was not written for."""
    now, _ = rows
    shape = other_shape(tmp_path)
    row = status(tmp_path, NEXT, shape)[CONTROL]
    assert (row["state"], row["family"]) == ("skipped", None), row
    assert row["reason"].startswith("structural check: ") and "'total / num'" in row["reason"], row
    assert "not read yet" not in row["reason"], row
    assert now[CONTROL]["state"] == "applied", now[CONTROL]
