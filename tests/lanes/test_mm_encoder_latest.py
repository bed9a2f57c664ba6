"""Patch ``vllm.mm_encoder_attn`` on the newest stack (lane latest-vllm).

0.23.0rc1 and later rewrote ``forward_oot`` around
``npu_fused_infer_attention_score`` and honour ``self.scale``; no adapter of
this branch serves that family yet, so the patch skips with every adapter's
reason, and each adapter's structural check refuses this shape too (widening
a fence by mistake could not apply an adapter to code it was not written for).

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


def test_skipped_while_no_adapter_serves_this_release(latest):
    """Until an adapter for this family exists, the patch skips, naming every adapter's reason."""
    from npu_shim.patches.vllm_mm_encoder_attn import ADAPTERS

    _, version, before, after = latest
    assert before["state"] == "pending" or before["state"] == after["state"]
    assert after["state"] == "skipped", after
    assert after["adapter"] is None
    assert after["reason"].startswith("structural check: no adapter accepts AscendMMEncoderAttention: ")
    for name in ADAPTERS:
        assert "%s: vllm-ascend %s outside " % (name, version) in after["reason"]
    assert after["versions"] == {"vllm-ascend": version}


def test_upstream_methods_untouched(latest):
    module = latest[0]
    cls = module.AscendMMEncoderAttention
    for name in ("__init__", "forward_oot"):
        assert vars(cls)[name].__code__.co_filename == module.__file__


def test_structural_check_refuses_this_shape(latest):
    """Not only the versions: no adapter's structural check accepts the real class."""
    from npu_shim.patch import TargetMismatch
    from npu_shim.patches.mm_encoder import load_adapters
    from npu_shim.patches.vllm_mm_encoder_attn import ADAPTERS

    cls = latest[0].AscendMMEncoderAttention
    assert "self.scale," in importlib.util.find_spec(TARGET).loader.get_source(TARGET)
    for adapter in load_adapters(ADAPTERS):
        with pytest.raises(TargetMismatch):
            adapter.check(cls)
