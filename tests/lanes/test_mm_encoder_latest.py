"""Patch ``vllm.mm_encoder_attn`` on the newest stack (lane latest): skipped, with its reason.

vllm-ascend 0.18.0 .. 0.22.1rc1 receive host ``sequence_lengths`` computed once
per encoder forward (``AscendMMEncoderAttention.maybe_compute_seq_lens``);
0.23.0rc1 and later rewrote ``forward_oot`` around
``npu_fused_infer_attention_score`` and honour ``self.scale``. The patch's
version guard (``vllm-ascend >=0.13,<0.18``) keeps it off, and its structural
check refuses this shape too, so widening the guard by mistake could not apply
it to code it was not written for.

The target is imported the way the 0.13/0.15 lanes do it (see
``import_target_without_ops_init``): ``vllm_ascend/ops/__init__.py`` imports
compiled Ascend ops, so an empty package module with the real ``__path__``
stands for ``vllm_ascend.ops`` and the real submodule file is imported from it.
torch_npu is npu-shim's emulation; ``VLLM_PLUGINS`` (the lanes set ``npu_shim``;
empty if unset) keeps vLLM off the vllm-ascend platform plugin.
"""
import importlib
import importlib.metadata
import importlib.util
import os

import pytest

pytestmark = pytest.mark.lanes("latest", "latest-vllm")

TARGET = "vllm_ascend.ops.mm_encoder_attention"
PATCH_NAME = "vllm.mm_encoder_attn"


def import_target_without_ops_init():
    """See the module docstring: real submodule, ``vllm_ascend/ops/__init__.py`` not run."""
    os.environ.setdefault("VLLM_PLUGINS", "")  # the lanes use "npu_shim"; never "ascend"
    from npu_shim.testing.isolation import import_vllm_ascend_ops_module

    return import_vllm_ascend_ops_module()


def _row():
    import npu_shim

    return next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)


@pytest.fixture(scope="module")
def latest():
    import npu_shim
    from npu_shim import emulation
    from packaging.version import Version

    emulation.install()
    npu_shim.install()
    version = importlib.metadata.version("vllm-ascend")
    assert Version(version) >= Version("0.18"), "lane latest must pin vllm-ascend 0.18 or later"
    before = _row()
    module = import_target_without_ops_init()
    return module, version, before, _row()


def test_skipped_by_its_version_guard_with_the_reason(latest):
    _, version, before, after = latest
    reason = ("vllm-ascend %s is outside >=0.13,<0.18 (0.18.0+ take host sequence lengths from vLLM "
              "(Qwen-VL encoders); 0.23.0rc1+ rewrote forward_oot)" % version)
    for row in (before, after):
        assert row["state"] == "skipped", row
        assert row["reason"] == reason
        assert row["versions"] == {"vllm-ascend": version}


def test_upstream_methods_untouched(latest):
    module = latest[0]
    cls = module.AscendMMEncoderAttention
    for name in ("__init__", "forward_oot"):
        assert vars(cls)[name].__code__.co_filename == module.__file__


def test_structural_check_refuses_this_shape(latest):
    """Not only the version: the real class no longer has the shape the patch replaces."""
    from npu_shim.patch import NotNeeded, TargetMismatch
    from npu_shim.patches.vllm_mm_encoder_attn import PATCH

    module = latest[0]
    cls = module.AscendMMEncoderAttention
    if "maybe_compute_seq_lens" in vars(cls):       # 0.18.0 .. 0.22.1rc1
        with pytest.raises(NotNeeded, match="precomputes host sequence_lengths"):
            PATCH.check(module)
    else:                                           # 0.23.0rc1 and later
        assert "_npu_flash_attention_unpad" not in cls.forward_oot.__code__.co_names
        assert "self.scale," in importlib.util.find_spec(TARGET).loader.get_source(TARGET)
        with pytest.raises(TargetMismatch, match="no longer calls torch_npu._npu_flash_attention_unpad"):
            PATCH.check(module)
