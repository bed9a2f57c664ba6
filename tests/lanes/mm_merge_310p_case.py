"""The set-up test_mm_merge_310p.py and test_mm_merge_310p_caller.py share for ``vllm.mm_merge_310p``:
the emulated 310P's SoC name, the merge's sizes (two items, 3 and 4 placeholder rows in 16) and the
import order a vllm-ascend worker has (emulation, shim, vLLM's modules, ``torch_npu``).
"""
import sys

from npu_shim.patches.vllm.mm_merge_310p import TARGET
from npu_shim.testing.towers import SOC_310P  # noqa: F401  (re-exported: the tests set it as NPU_SHIM_EMULATE_SOC)

HIDDEN = 64
SPANS = ((2, 5), (9, 13))          # two items: 3 and 4 placeholder rows in 16
ROWS = 16


def setup():
    """The emulation, the shim and vLLM's modules set up (:func:`npu_shim.testing.towers.setup`),
    ``torch_npu`` imported; returns the patch's target, ``vllm.model_executor.models.utils``."""
    from npu_shim.testing import towers

    towers.setup()                  # emulation first, then the shim, then vLLM's modules
    import torch_npu  # noqa: F401  (a vllm-ascend worker has it imported; the patch asks it the SoC)

    return sys.modules[TARGET]
