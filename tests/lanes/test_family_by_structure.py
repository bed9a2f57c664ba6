"""The family choice by structure: every family's check accepts only its own release's code,
and a development or local version string does not change which family applies.

Runs on every lane that pins vllm-ascend (read from the pin files): each holds one release's
real code, so together the lanes run every family's check against every release the lanes
stand for. The checks must look at upstream's code, not a replacement. In a lane,
``lanes/report.py`` computes the matrix in the interpreter of its ``npu-shim status --import``
gate, after the status (``family_matrix.checks_of_originals``: the shim uninstalled, each
original restored, any replacement left in place reported as a problem) and names the file in
``$FAMILY_MATRIX_JSON``; without it (pytest run by hand) the targets are imported in a fresh
interpreter (``npu_shim.testing.family_matrix checks``) with ``NPU_SHIM=0``.
A shadowing ``.dist-info`` first on ``sys.path`` gives the installed code another version:
``importlib.metadata`` reports the first distribution it finds.
"""
import json
import os
import subprocess
import sys

import pytest

from npu_shim.reference import lane_table

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
pytestmark = pytest.mark.lanes(*sorted(lane for lane, pins in lane_table(ROOT).items() if "vllm-ascend" in pins))

DEV_VERSION = "0.19.1rc2.dev1265+g1a2b3c4"      # what an image built from main reported
NOTE = "family chosen by structure: vllm-ascend %s is a development build" % DEV_VERSION
# The patches whose families the matrix must tell apart in every lane; every
# other patch may not have two families accepting one release's code either.
ENCODER = ("vllm.mm_encoder_attn", "vllm.mm_encoder_attn_310p")


def window_admits_dev_version(name):
    """Whether patch ``name``'s window on vllm-ascend (Patch.window: its families' fences where
    every family is fenced on it) admits DEV_VERSION."""
    import importlib

    from npu_shim.engine.guards import in_window
    from npu_shim.patches import BUILTIN_PATCHES

    patch = importlib.import_module(dict(BUILTIN_PATCHES)[name]).PATCH
    return "vllm-ascend" not in patch.requires or in_window(patch, "vllm-ascend", DEV_VERSION)


def fresh(what, tmp_path, shadow=None, **env):
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NPU_SHIM")}
    environ.update(env)
    if shadow:
        dist, version = shadow
        info = tmp_path / ("%s-%s.dist-info" % (dist.replace("-", "_"), version))
        info.mkdir()
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (dist, version))
        environ["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-P", "-m", "npu_shim.testing.family_matrix", what], env=environ,
                          cwd=str(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def matrix(tmp_path_factory):
    path = os.environ.get("FAMILY_MATRIX_JSON")
    if not path:
        return fresh("checks", tmp_path_factory.mktemp("checks"), NPU_SHIM="0")
    with open(path, encoding="utf-8") as handle:
        computed = json.load(handle)
    assert "error" not in computed, "the lane's status interpreter could not compute the matrix:\n" + computed["error"]
    assert not computed["problems"], computed["problems"]
    return computed["checks"]


def accepting(entry):
    return [name for name, outcome in entry["results"].items() if outcome == "accept"]


def test_every_check_accepts_only_its_own_releases_code(matrix):
    rows = []
    for name, entry in sorted(matrix.items()):
        if not entry["window"]:
            continue
        rows.append("%s: %s" % (name, ", ".join("%s=%s" % (f, o.split(":")[0]) for f, o in entry["results"].items())))
        assert not [o for o in entry["results"].values() if o.startswith("error")], (name, entry)
        assert len(accepting(entry)) <= 1, (name, entry)
        assert set(accepting(entry)) <= set(entry["admitted"]), (name, entry)
    print("\n".join(rows))
    for name in ENCODER:
        if name in matrix and matrix[name]["window"]:
            assert accepting(matrix[name]) == matrix[name]["admitted"], (name, matrix[name])


# The shadow tests start interpreters that import every target (about 40 s a lane); the
# choice they test is the engine's, the same on every release, so they run on two lanes:
# vllm-ascend 0.26.0rc1's (whose code a development image reported as 0.19.1rc2.dev1265
# carried) and the newest lane of the open-ended encoder family; the matrix above runs on
# every lane.
SHADOW = [pytest.mark.claimed("vllm.mm_encoder_attn", pinned={"vllm-ascend": ("0.26.0rc1",)}),
          pytest.mark.claimed("vllm.mm_encoder_attn", per_family=True,
                              implemented_in="npu_shim.patches.vllm_ascend.mm_encoder.v023")]


@SHADOW[0]
@SHADOW[1]
def test_a_development_version_gets_the_releases_family(tmp_path):
    (tmp_path / "release").mkdir()
    (tmp_path / "dev").mkdir()
    released = fresh("status", tmp_path / "release", NPU_SHIM_EMULATE="1")
    shadowed = fresh("status", tmp_path / "dev", shadow=("vllm-ascend", DEV_VERSION), NPU_SHIM_EMULATE="1")
    fenced = [name for name in ENCODER if released[name]["state"] == "applied"]
    assert fenced, released
    for name, row in released.items():
        if not window_admits_dev_version(name):
            # a patch whose window starts above the development build (vllm.encoder_acl_graph_refs:
            # the encoder ACL graph came in 0.22.1rc1): the window rules it out, structure is not asked
            assert shadowed[name]["state"] == "skipped" and "is outside" in shadowed[name]["reason"], \
                (name, shadowed[name])
            continue
        assert (shadowed[name]["state"], shadowed[name]["family"]) == (row["state"], row["family"]), \
            (name, row, shadowed[name])
    for name in fenced:
        assert NOTE in shadowed[name]["reason"], shadowed[name]
        assert "chosen by structure" not in released[name]["reason"], released[name]


@SHADOW[0]
@SHADOW[1]
def test_the_switch_reads_a_development_version_as_a_release(tmp_path):
    (tmp_path / "dev").mkdir()
    shadowed = fresh("status", tmp_path / "dev", shadow=("vllm-ascend", DEV_VERSION), NPU_SHIM_EMULATE="1",
                     NPU_SHIM_FAMILY_BY_STRUCTURE="0")
    for name in ENCODER:
        assert "chosen by structure" not in shadowed[name]["reason"], shadowed[name]
