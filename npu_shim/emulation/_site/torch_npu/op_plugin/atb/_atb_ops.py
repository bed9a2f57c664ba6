"""Emulated ``torch_npu.op_plugin.atb._atb_ops``.

torch_npu's ``_register_atb_extensions()`` loads the Ascend Transformer Boost (ATB) operator
library and registers its ops under ``torch.ops.atb``; vllm-ascend's worker calls it at start-up on
hardware that has ATB. The emulation registers no ATB op: the call succeeds, and a later
``torch.ops.atb.<op>`` fails in torch's own lookup, naming the op (never a silent CPU path).
"""

_registered = []


def _register_atb_extensions():
    """Register the ATB extensions: none are emulated (see the module docstring)."""
    _registered.append(True)
