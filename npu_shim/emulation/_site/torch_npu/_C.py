"""The few ``torch_npu._C`` entry points upstream code reads (SoC probing, weak tensors)."""
from npu_shim.emulation import soc as _soc
from npu_shim.emulation.weak_ref import weak_ref_tensor as _weak_ref_tensor  # noqa: F401


def _npu_get_soc_version():
    return _soc.soc_version()
