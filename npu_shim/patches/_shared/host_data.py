"""What counts as host data for a tower patch that takes its numbers from the host.

A device stand-in (:mod:`npu_shim.testing.syncs`) answers ``.device`` with ``cpu:0``: host data
is on ``cpu`` with no index, so the tests' device tensors are never taken for host ones.
"""

__all__ = ["host_grid_tensor"]


def host_grid_tensor(grid_thw):
    """True for a 2-D integer ``[t, h, w]`` grid tensor on the host."""
    import torch

    return (isinstance(grid_thw, torch.Tensor) and grid_thw.dim() == 2 and grid_thw.shape[1] == 3
            and grid_thw.device.type == "cpu" and grid_thw.device.index is None
            and not grid_thw.is_floating_point())
