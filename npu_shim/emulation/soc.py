"""The Ascend SoC the emulation pretends to be.

Real torch_npu reports the SoC as an integer (``torch_npu.npu.get_soc_version()``,
older releases ``torch_npu._C._npu_get_soc_version()``) and a name
(``torch_npu.npu.get_device_name()``). vllm-ascend maps the integer to device
classes: 200-205 = 310P (Atlas inference series: no TND fusion attention, the
``_npu_flash_attention_unpad`` path), 220-225 = A2, 250-255 = A3, 260 = A5.

``NPU_SHIM_EMULATE_SOC`` picks the emulated SoC by name (e.g. ``Ascend310P3``
to exercise the 310P path); default ``Ascend910B1`` (an A2). Read on every call,
so a test can switch it with monkeypatch.setenv.

The CANN release the emulated ops behave as, where the vendor's rules differ by
release: ``NPU_SHIM_EMULATE_CANN`` (``8.5.0``, ``8.3.RC1``, ``9.0.0``, ...; default
``8.5.0``, the release the evidence for the FIA TND head-dim rule names), read on
every call too. Real torch_npu reports it as ``torch_npu.npu.utils.get_cann_version()``
(also ``torch_npu.utils.get_cann_version``; ``""`` below CANN 8.1.RC1), which the
emulated package answers from here.
"""
import os

ENV = "NPU_SHIM_EMULATE_SOC"
DEFAULT_SOC = "Ascend910B1"
CANN_ENV = "NPU_SHIM_EMULATE_CANN"
DEFAULT_CANN = "8.5.0"

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


def parse_cann(text):
    """(major, minor) of a CANN version string in torch_npu's documented formats (a.b.c,
    a.b.RCd, a.b.Tg, a.b.RCd.alphaf); None if it is not one."""
    parts = (text or "").strip().split(".")
    if len(parts) == 4 and parts[3].startswith("alpha") and parts[3][5:].isdigit():
        parts = parts[:3]
    if len(parts) != 3 or not (parts[0].isdigit() and parts[1].isdigit()):
        return None
    third = parts[2]
    for prefix in ("RC", "T"):
        if third.startswith(prefix):
            third = third[len(prefix):]
            break
    return (int(parts[0]), int(parts[1])) if third.isdigit() else None


def cann_version():
    """The emulated CANN release, as torch_npu's ``get_cann_version()`` spells it."""
    text = os.environ.get(CANN_ENV, "").strip() or DEFAULT_CANN
    if parse_cann(text) is None:
        raise ValueError("%s=%r is not a CANN version; use the form torch_npu reports, e.g. 8.5.0, "
                         "8.3.RC1 or 9.0.0" % (CANN_ENV, text))
    return text
