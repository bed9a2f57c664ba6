"""Lets lane tests import their helper package ``sglang_support``, and holds the
fixtures the vision-tower tests share.

pytest runs in importlib mode (test basenames repeat across lanes), which does
not put test directories on ``sys.path``.
"""
import os
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)


@pytest.fixture
def lane_pins():
    """``lane_pins(*dists)``: ``{dist: version}`` the running lane's pin file pins
    (``NPU_SHIM_LANE``; ``npu_shim.reference.lane_table``), what the installed versions must be."""
    from npu_shim import reference

    pinned = reference.lane_table(os.path.dirname(os.path.dirname(HERE)))[os.environ["NPU_SHIM_LANE"]]
    return lambda *dists: {dist: pinned[dist] for dist in dists}


@pytest.fixture(params=["A2", "310P"])
def device_class(request, monkeypatch):
    """vllm-ascend's device class under test: A2, or 310P (the emulation's SoC set to a 310P
    for the test, so vllm-ascend's own SoC check takes its 310P path)."""
    if request.param == "310P":
        from npu_shim.testing.towers import DEVICE_CLASSES, SOC_310P, has_device_class

        if not has_device_class("310P"):
            from importlib.metadata import version

            pytest.skip("vllm-ascend %s has no 310P MMEncoderAttention class (%s)"
                        % (version("vllm-ascend"), DEVICE_CLASSES["310P"][0]))

        monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", SOC_310P)
    return request.param
