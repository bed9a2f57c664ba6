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
    host_ints(values)      True for a list or tuple of integers (Python or NumPy; no bools): numbers
                           the host holds, never a device tensor inside
    host_int32(data)       1-D host integers (a list/tuple, an integer NumPy array or an integer host
                           tensor) as an int32 host tensor of their own; None otherwise (a device
                           tensor, and float, complex or bool data: not lengths)
"""

__all__ = ["is_host", "host_grid", "host_grid_tensor", "cu_seqlens_of", "host_ints", "host_int32"]


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
    import torch

    if isinstance(grid_thw, (list, tuple)):
        if not grid_thw or not all(host_ints(row) and len(row) == 3 for row in grid_thw):
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


def host_ints(values) -> bool:
    """True for a list or tuple whose items are all integers (``numbers.Integral``: Python or NumPy
    integers), bools left out; a tensor among them (a device scalar above all) makes it False."""
    import numbers

    return isinstance(values, (list, tuple)) and all(
        isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in values)


def host_int32(data):
    """``data`` (host integers: a list or tuple, an integer NumPy array or an integer host tensor)
    as a 1-D int32 host tensor of its own (a copy); None for anything else: a device tensor (the
    stand-in rule of :func:`is_host`), float, complex or bool data (not lengths), or more than one
    dimension."""
    import numpy
    import torch

    if isinstance(data, (list, tuple)):
        if not host_ints(data):
            return None
        host = torch.tensor(data, dtype=torch.int32)
    elif isinstance(data, numpy.ndarray) and numpy.issubdtype(data.dtype, numpy.integer):
        host = torch.from_numpy(data).to(torch.int32, copy=True)
    elif is_host(data) and not (data.is_floating_point() or data.is_complex() or data.dtype == torch.bool):
        host = data.to(torch.int32, copy=True)
    else:
        return None
    return host if host.dim() == 1 else None


def _bool():
    import torch

    return torch.bool
