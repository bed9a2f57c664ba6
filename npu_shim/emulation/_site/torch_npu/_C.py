"""The few ``torch_npu._C`` entry points upstream code reads (SoC probing, weak tensors), and
import placeholders (npu_shim.emulation.placeholders) for names read at import time only."""
from npu_shim.emulation import soc as _soc
from npu_shim.emulation.placeholders import placeholder_class as _placeholder_class
from npu_shim.emulation.weak_ref import weak_ref_tensor as _weak_ref_tensor  # noqa: F401

# vllm_ascend.compilation.acl_graph annotates GraphParams.handles with it (graph capture).
_NPUTaskGroupHandle = _placeholder_class("torch_npu._C._NPUTaskGroupHandle")


def _npu_get_soc_version():
    return _soc.soc_version()


class _ProcessGroupHCCL:
    """``torch_npu._C._distributed_c10d.ProcessGroupHCCL``: its ``Options`` only, the settings sglang
    hands ``init_process_group(backend="hccl", pg_options=...)``. The emulated ``hccl`` is one-rank gloo
    (npu_shim.emulation.device), which takes no options: the settings are kept and read by nobody."""

    class Options:
        def __init__(self):
            self.hccl_config = {}
            self.is_high_priority_stream = False


class _DistributedC10d:
    ProcessGroupHCCL = _ProcessGroupHCCL


_distributed_c10d = _DistributedC10d()
