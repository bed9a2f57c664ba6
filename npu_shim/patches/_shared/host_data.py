"""What counts as host data, and the lengths a tower builds from a host grid: one rule for every patch.

A device stand-in (:mod:`npu_shim.testing.syncs`) answers ``.device`` with ``cpu:0``: host data
is on ``cpu`` with no index, so the tests' device tensors are never taken for host ones.

    is_host(tensor)        a tensor on the host (``cpu``, no index)
    host_grid(grid)        a ``[t, h, w]`` grid the host holds (a list/tuple of integer triples, or a
                           2-D integer host tensor) as a 2-D int32 host tensor; None otherwise
    host_grid_tensor(grid) True for a 2-D integer ``[t, h, w]`` grid *tensor* on the host
    cu_seqlens_of(grid)    the int32 cumulative lengths ``[0, t*h*w per frame...]`` towers build from
                           a grid, as upstream builds them (``repeat_interleave(h * w, t)``, int32
                           ``cumsum``, a 0 in front), on the grid's device
"""

__all__ = ["is_host", "host_grid", "host_grid_tensor", "cu_seqlens_of"]


def is_host(tensor) -> bool:
    """True for a torch tensor on the host (device ``cpu`` with no index)."""
    import torch

    return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.device.index is None


def host_grid_tensor(grid_thw) -> bool:
    """True for a 2-D integer ``[t, h, w]`` grid tensor on the host."""
    return (is_host(grid_thw) and grid_thw.dim() == 2 and grid_thw.shape[1] == 3
            and not grid_thw.is_floating_point() and grid_thw.dtype is not _bool())


def host_grid(grid_thw):
    """``grid_thw`` as a 2-D int32 host tensor where the host holds it (a list or tuple of
    ``[t, h, w]`` integer triples, or a host grid tensor), else None."""
    import numbers

    import torch

    if isinstance(grid_thw, (list, tuple)):
        if not grid_thw or not all(
                isinstance(row, (list, tuple)) and len(row) == 3
                and all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in row)
                for row in grid_thw):
            return None
        return torch.tensor(grid_thw, dtype=torch.int32)
    if host_grid_tensor(grid_thw):
        return grid_thw if grid_thw.dtype == torch.int32 else grid_thw.to(torch.int32)
    return None


def cu_seqlens_of(grid_thw):
    """The int32 cumulative sequence lengths of ``grid_thw`` (a 2-D ``[t, h, w]`` tensor), a 0 in
    front: one sequence of ``h * w`` per frame, as the towers build them."""
    import torch

    lengths = torch.repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(
        dim=0, dtype=torch.int32)
    return torch.cat([lengths.new_zeros(1), lengths])


def _bool():
    import torch

    return torch.bool
