"""Emulated ``torch_npu.multiprocessing``: only what importing sglang needs (``reductions``)."""
from . import reductions  # noqa: F401
