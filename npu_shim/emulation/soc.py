"""The Ascend SoC the emulation pretends to be.

Real torch_npu reports the SoC as an integer (``torch_npu.npu.get_soc_version()``,
older releases ``torch_npu._C._npu_get_soc_version()``) and a name
(``torch_npu.npu.get_device_name()``). vllm-ascend maps the integer to device
classes: 200-205 = 310P (Atlas inference series: no TND fusion attention, the
``_npu_flash_attention_unpad`` path), 220-225 = A2, 250-255 = A3, 260 = A5.

``NPU_SHIM_EMULATE_SOC`` picks the emulated SoC by name (e.g. ``Ascend310P3``
to exercise the 310P path); default ``Ascend910B1`` (an A2). Read on every call,
so a test can switch it with monkeypatch.setenv.
"""
import os

ENV = "NPU_SHIM_EMULATE_SOC"
DEFAULT_SOC = "Ascend910B1"

SOC_VERSIONS = {
    "Ascend910PremiumA": 100, "Ascend910ProA": 101, "Ascend910A": 102, "Ascend910ProB": 103,
    "Ascend910B": 104,
    "Ascend310P1": 200, "Ascend310P2": 201, "Ascend310P3": 202, "Ascend310P4": 203,
    "Ascend310P5": 204, "Ascend310P7": 205,
    "Ascend910B1": 220, "Ascend910B2": 221, "Ascend910B2C": 222, "Ascend910B3": 223,
    "Ascend910B4": 224, "Ascend910B4-1": 225,
    "Ascend310B1": 240, "Ascend310B2": 241, "Ascend310B3": 242, "Ascend310B4": 243,
    "Ascend910_9391": 250, "Ascend910_9392": 251, "Ascend910_9381": 252,
    "Ascend910_9382": 253, "Ascend910_9372": 254, "Ascend910_9362": 255,
    "Ascend950": 260,
}


def soc_name():
    name = os.environ.get(ENV, "").strip() or DEFAULT_SOC
    if name not in SOC_VERSIONS:
        raise ValueError(
            "%s=%r is not a known Ascend SoC; use one of %s"
            % (ENV, name, ", ".join(sorted(SOC_VERSIONS)))
        )
    return name


def soc_version():
    return SOC_VERSIONS[soc_name()]


def is_310p():
    return 200 <= soc_version() <= 205
