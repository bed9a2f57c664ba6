"""The few ``torch_npu._C`` entry points upstream code reads (SoC probing, weak tensors), and
import placeholders (npu_shim.emulation.placeholders) for names read at import time only."""
from npu_shim.emulation import soc as _soc
from npu_shim.emulation.placeholders import placeholder_class as _placeholder_class
from npu_shim.emulation.weak_ref import weak_ref_tensor as _weak_ref_tensor  # noqa: F401

# vllm_ascend.compilation.acl_graph annotates GraphParams.handles with it (graph capture).
_NPUTaskGroupHandle = _placeholder_class("torch_npu._C._NPUTaskGroupHandle")


def _npu_get_soc_version():
    return _soc.soc_version()


def _distributed_c10d_module():
    """``torch_npu._C._distributed_c10d``: vllm-ascend's netloader imports ``ProcessGroupHCCL`` from it
    at import time (registered with vLLM's model loaders). A placeholder class: the emulated device's
    hccl is one-rank gloo (``torch.distributed``'s ``hccl`` backend), and building torch_npu's own
    process group class (or its ``Options``) refuses, naming it."""
    import sys
    import types

    module = types.ModuleType(__name__ + "._distributed_c10d")
    module.ProcessGroupHCCL = _placeholder_class("torch_npu._C._distributed_c10d.ProcessGroupHCCL")
    module.ProcessGroupHCCL.Options = _placeholder_class("torch_npu._C._distributed_c10d.ProcessGroupHCCL.Options")
    sys.modules[module.__name__] = module
    return module


_distributed_c10d = _distributed_c10d_module()
