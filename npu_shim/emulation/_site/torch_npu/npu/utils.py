"""``torch_npu.npu.utils`` of the emulated torch_npu: the CANN version only.

``get_cann_version(module="CANN")`` reports the emulated CANN release
(``NPU_SHIM_EMULATE_CANN``, default 8.5.0; npu_shim.emulation.soc) for "CANN" and
"" for the other modules, as the real one does for a module it does not know.
"""
from npu_shim.emulation import soc as _soc

__all__ = ["get_cann_version"]


def get_cann_version(module="CANN"):
    return _soc.cann_version() if module == "CANN" else ""
