"""Emulated ``torch_npu.npu.memory``: the memory answers live in ``torch_npu.npu`` (re-exported
here as torch_npu has them), and an import placeholder for ``NPUPluggableAllocator``, which
vllm-ascend's sleep-mode allocator (``device_allocator.camem``) names in an annotation at import.
The emulated device has no pluggable allocator: building one refuses, naming it."""
from npu_shim.emulation.placeholders import placeholder_class as _placeholder_class
from torch_npu.npu import (empty_cache, max_memory_allocated, max_memory_reserved, mem_get_info,  # noqa: F401
                           memory_allocated, memory_reserved, memory_stats, reset_peak_memory_stats)

NPUPluggableAllocator = _placeholder_class("torch_npu.npu.memory.NPUPluggableAllocator")
