"""Emulated ``torch_npu.profiler``: PyTorch's own profiler, the host side only.

torch_npu's profiler is ``torch.profiler``'s interface with an ``NPU`` activity for device
kernels. The emulated device's kernels run on the host, so ``ProfilerActivity.NPU`` records
the host (CPU) activity: a trace has no device timeline. sglang swaps these in for
``torch.profiler``'s at import (``sglang.srt.utils.profile_utils``).
"""
import torch.profiler as _profiler

profile = _profiler.profile
schedule = _profiler.schedule
tensorboard_trace_handler = _profiler.tensorboard_trace_handler
record_function = _profiler.record_function


class ProfilerActivity:
    """torch_npu's activities, as torch's own values: ``NPU`` is the host's (see above)."""

    CPU = _profiler.ProfilerActivity.CPU
    NPU = _profiler.ProfilerActivity.CPU
