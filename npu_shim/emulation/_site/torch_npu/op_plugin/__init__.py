"""Emulated ``torch_npu.op_plugin``: only what vllm-ascend imports from it (``atb._atb_ops``)."""
