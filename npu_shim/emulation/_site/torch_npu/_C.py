"""The few ``torch_npu._C`` entry points upstream code reads (SoC probing)."""
from npu_shim.emulation import soc as _soc


def _npu_get_soc_version():
    return _soc.soc_version()
