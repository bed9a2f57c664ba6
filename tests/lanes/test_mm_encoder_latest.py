"""Patch ``vllm.mm_encoder_attn`` on the newest vllm-ascend wheel (lane latest-vllm).

vllm-ascend 0.26.0rc1 (with vllm 0.26.0) still copies ``cu_seqlens`` to the
host in every encoder layer; the patch applies there with the family in ``mm_encoder/v023.py``
(which serves 0.23.0rc1 and every later release of that shape). What the
family does is tested in ``test_mm_encoder_fia.py``; this module checks what
``npu-shim status`` reports and that importing the target works with the shim
installed.

The target is imported the way the other lanes do it (see
``npu_shim.testing.isolation``): ``vllm_ascend/ops/__init__.py`` imports
compiled Ascend ops. torch_npu is npu-shim's emulation; ``VLLM_PLUGINS`` (the
lanes set ``npu_shim``; empty if unset) keeps vLLM off the vllm-ascend platform
plugin.
"""
import importlib.metadata
import os

import pytest

pytestmark = [pytest.mark.claimed("vllm.mm_encoder_attn", implemented_in="npu_shim.patches.vllm_ascend.mm_encoder.v023"),
              pytest.mark.patch("vllm.mm_encoder_attn")]

PATCH_NAME = "vllm.mm_encoder_attn"


def claimed_family(name):
    """The family the declaration claims for the installed release (imported here: importing
    npu_shim installs it, which collection must not do)."""
    from npu_shim.testing.claims import claimed_family as claimed

    return claimed(name)


def _row():
    import npu_shim

    return next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)


@pytest.fixture(scope="module")
def latest():
    import npu_shim
    from npu_shim import emulation
    from npu_shim.testing.isolation import import_vllm_ascend_ops_module

    os.environ.setdefault("VLLM_PLUGINS", "")  # the lanes use "npu_shim"; never "ascend"
    emulation.install()
    npu_shim.install()
    version = importlib.metadata.version("vllm-ascend")
    before = _row()
    module = import_vllm_ascend_ops_module()
    return module, version, before, _row()


def test_applied_with_the_v023_family(latest):
    _, version, before, after = latest
    assert before["state"] in ("pending", "applied")   # applied when another module imported it first
    assert after["state"] == "applied", after
    assert after["family"] == claimed_family(PATCH_NAME).name
    assert claimed_family(PATCH_NAME).implementation.endswith(".v023")
    assert after["reason"] == "vllm-ascend %s" % version
    assert after["versions"] == {"vllm-ascend": version}


def test_cli_status_names_the_family(latest, capsys):
    """``npu-shim status`` (the table) and ``--json`` name the family."""
    import json

    from npu_shim import cli

    assert cli.main(["status", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out) if r["name"] == PATCH_NAME)
    assert row["state"] == "applied" and row["family"] == claimed_family(PATCH_NAME).name, row
    assert cli.main(["status"]) == 0
    line = next(l for l in capsys.readouterr().out.splitlines() if l.startswith(PATCH_NAME))
    assert line.split()[1:3] == ["applied", claimed_family(PATCH_NAME).name], line


def test_only_forward_oot_replaced(latest):
    module = latest[0]
    cls = module.AscendMMEncoderAttention
    assert vars(cls)["__init__"].__code__.co_filename == module.__file__
    assert vars(cls)["forward_oot"].__code__.co_filename != module.__file__
    assert vars(cls)["forward_oot"].__wrapped_upstream__.__code__.co_filename == module.__file__
