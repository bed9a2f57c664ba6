"""The few ``torch_npu._C`` entry points upstream code reads (SoC probing, weak tensors), and
import placeholders (npu_shim.emulation.placeholders) for names read at import time only."""
from npu_shim.emulation import soc as _soc
from npu_shim.emulation.placeholders import placeholder_class as _placeholder_class
from npu_shim.emulation.weak_ref import weak_ref_tensor as _weak_ref_tensor  # noqa: F401

# vllm_ascend.compilation.acl_graph annotates GraphParams.handles with it (graph capture).
_NPUTaskGroupHandle = _placeholder_class("torch_npu._C._NPUTaskGroupHandle")


def _npu_get_soc_version():
    return _soc.soc_version()


class _HcclOptions:
    """``torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options``: the options of an HCCL process
    group (torch_npu's guide "pg_options": ``options = ...ProcessGroupHCCL.Options()``,
    ``options.hccl_config = {"hccl_buffer_size": 200}``, then
    ``init_process_group(backend="hccl", pg_options=options)``). ``hccl_config`` is kept as set
    (``hccl_buffer_size``, ``group_name``, QoS, ``hccl_op_expansion_mode``): the emulated device's
    hccl is one-rank gloo, which has no buffers, streams or QoS to configure, so nothing reads it.
    ``is_high_priority_stream`` and ``global_ranks_in_group`` are the base options' fields, at
    their defaults."""

    def __init__(self, is_high_priority_stream=False):
        self.hccl_config = {}
        self.is_high_priority_stream = bool(is_high_priority_stream)
        self.global_ranks_in_group = []

    def __repr__(self):
        return "ProcessGroupHCCL.Options(hccl_config=%r) (npu-shim emulation)" % (self.hccl_config,)


def _distributed_c10d_module():
    """``torch_npu._C._distributed_c10d``: vllm-ascend imports ``ProcessGroupHCCL`` from it at import
    time (its netloader) and builds ``ProcessGroupHCCL.Options`` for every process group its
    ``GroupCoordinator`` opens (``create_hccl_pg_options``). ``ProcessGroupHCCL`` itself is a
    placeholder class (building one refuses, naming it): the emulated device's ``hccl`` backend of
    ``torch.distributed`` is one-rank gloo. Its ``Options`` are real (:class:`_HcclOptions`)."""
    import sys
    import types

    module = types.ModuleType(__name__ + "._distributed_c10d")
    module.ProcessGroupHCCL = _placeholder_class("torch_npu._C._distributed_c10d.ProcessGroupHCCL")
    _HcclOptions.__name__ = _HcclOptions.__qualname__ = "Options"
    module.ProcessGroupHCCL.Options = _HcclOptions
    sys.modules[module.__name__] = module
    return module


_distributed_c10d = _distributed_c10d_module()
