"""npu_shim.patches._shared.host_data: the one rule for "is this host data?" and the lengths a
tower builds from a host grid, on plain CPU torch (no upstream framework).

A device stand-in (:mod:`npu_shim.testing.syncs`, ``follow_placement``) answers ``.device`` with
``cpu:0``: it is never host data, whatever it holds; a tensor made with no device is. The
cumulative lengths are checked against the definition in Python integers (no float, no torch
op of the code under test in the reference).
"""
import numpy
import pytest
import torch

from npu_shim.patches._shared import host_data, host_record
from npu_shim.testing import count_host_syncs
from npu_shim.testing.syncs import DEVICE

INT_DTYPES = (torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64)


def lengths_by_definition(grid):
    """``[0, then the running total of h*w, once per frame of each [t, h, w] row]``, in Python ints."""
    out, total = [0], 0
    for t, h, w in grid:
        for _ in range(t):
            total += h * w
            out.append(total)
    return out


# ------------------------------------------------------------------ is_host, the stand-in rule

def test_a_tensor_made_on_the_host_is_host_data():
    assert host_data.is_host(torch.zeros(3))
    assert host_data.is_host(torch.zeros(3, device="cpu"))
    assert host_data.is_host(torch.zeros(0, dtype=torch.int32))


def test_a_device_stand_in_is_not_host_data():
    """Under the counter (placement followed) a device tensor answers ``cpu:0``: its type is
    "cpu", so a rule that looks at the type alone takes it for host data."""
    grid = torch.tensor([[1, 4, 4]])
    with count_host_syncs(device_tensors=[grid], follow_placement=True) as syncs:
        assert grid.device == DEVICE and grid.device.type == "cpu"
        made_there = torch.zeros(3, dtype=torch.int32, device=DEVICE)
        host = torch.zeros(3, dtype=torch.int32)
        assert not host_data.is_host(grid)
        assert not host_data.is_host(made_there)
        assert not host_data.is_host(grid + 1)             # computed from device data: device data
        assert host_data.is_host(host)
    assert syncs.count == 0, syncs.summary()               # the rule reads nothing


def test_what_is_not_a_tensor_or_not_on_the_cpu_is_not_a_host_tensor():
    assert not host_data.is_host(torch.zeros(3, device="meta"))
    for other in ([0, 1], (0, 1), numpy.zeros(2), None, 3):
        assert not host_data.is_host(other)


# ------------------------------------------------------------------ host_grid / host_grid_tensor

def test_host_grid_takes_lists_and_tuples_of_integer_triples_as_an_int32_host_tensor():
    for grid in ([[1, 8, 8], [2, 4, 12]], ((1, 8, 8), (2, 4, 12)), [(1, 8, 8), [2, 4, 12]],
                 [[numpy.int64(1), 8, numpy.int32(8)], [2, 4, 12]]):
        got = host_data.host_grid(grid)
        assert got.dtype == torch.int32 and host_data.is_host(got)
        assert got.tolist() == [[1, 8, 8], [2, 4, 12]]


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_host_grid_takes_every_integer_dtype(dtype):
    grid = torch.tensor([[1, 8, 8], [2, 4, 12]], dtype=dtype)
    assert host_data.host_grid_tensor(grid)
    got = host_data.host_grid(grid)
    assert got.dtype == torch.int32 and got.tolist() == [[1, 8, 8], [2, 4, 12]]
    if dtype == torch.int32:
        assert got is grid                                 # no copy where there is nothing to convert


def test_host_grid_refuses_what_is_not_an_integer_grid_on_the_host():
    refused = [
        [], (), [[1, 8]], [[1, 8, 8, 1]], [[1, 8, 8], [2, 4]],     # empty list, rows not triples
        [[1.0, 8, 8]], [[True, 8, 8]], [[1, 8, "8"]],               # not integers
        [[torch.tensor(1), 8, 8]],                                  # a tensor inside: may be device data
        [1, 8, 8],                                                  # one row, not a grid
        torch.tensor([[1.0, 8.0, 8.0]]), torch.tensor([[True, True, False]]),
        torch.tensor([1, 8, 8]), torch.zeros(2, 3, 1, dtype=torch.int64), torch.zeros(2, 2, dtype=torch.int64),
        torch.zeros(2, 3, dtype=torch.int64, device="meta"),
        numpy.array([[1, 8, 8]]), None,
    ]
    for grid in refused:
        assert host_data.host_grid(grid) is None, grid
    for grid in refused:
        if isinstance(grid, torch.Tensor):
            assert not host_data.host_grid_tensor(grid), grid
    assert not host_data.host_grid_tensor([[1, 8, 8]])             # a list is no grid tensor


def test_host_grid_refuses_a_device_stand_in_grid():
    grid = torch.tensor([[1, 8, 8], [2, 4, 12]])
    with count_host_syncs(device_tensors=[grid], follow_placement=True) as syncs:
        assert not host_data.host_grid_tensor(grid)
        assert host_data.host_grid(grid) is None
    assert syncs.count == 0, syncs.summary()


def test_an_empty_grid_tensor_is_a_host_grid_with_no_lengths():
    grid = torch.zeros(0, 3, dtype=torch.int64)
    assert host_data.host_grid(grid).shape == (0, 3)
    assert host_data.cu_seqlens_of(host_data.host_grid(grid)).tolist() == [0]


# ------------------------------------------------------------------ cu_seqlens_of

GRIDS = [
    [[1, 8, 8]],
    [[1, 8, 8], [2, 4, 12]],
    [[3, 2, 5], [1, 1, 1], [4, 6, 2]],
    [[2, 7, 3], [0, 5, 5], [1, 9, 4]],          # a row with no frame adds no sequence
    [[1, 64, 92], [5, 28, 28]],
]


@pytest.mark.parametrize("grid", GRIDS, ids=str)
@pytest.mark.parametrize("dtype", (torch.int32, torch.int64), ids=str)
def test_cu_seqlens_of_is_the_definition(grid, dtype):
    got = host_data.cu_seqlens_of(torch.tensor(grid, dtype=dtype))
    assert got.dtype == torch.int32 and got.dim() == 1 and host_data.is_host(got)
    assert got.tolist() == lengths_by_definition(grid)


def test_cu_seqlens_of_a_host_grid_reads_nothing_and_stays_on_the_host():
    grid = host_data.host_grid([[2, 4, 6], [1, 3, 3]])
    with count_host_syncs(follow_placement=True) as syncs:
        got = host_data.cu_seqlens_of(grid)
        assert host_data.is_host(got)
    assert syncs.count == 0 and syncs.h2d_count == 0, syncs.summary()
    assert got.tolist() == lengths_by_definition([[2, 4, 6], [1, 3, 3]])


def test_cu_seqlens_of_a_device_grid_stays_on_the_device():
    """Built where the grid is (a device grid gives device lengths, as upstream's own line does):
    host lengths come only through :func:`host_grid` first."""
    grid = torch.tensor([[2, 4, 6], [1, 3, 3]])
    with count_host_syncs(device_tensors=[grid], follow_placement=True):
        got = host_data.cu_seqlens_of(grid)
        assert not host_data.is_host(got)


# ------------------------------------------------------------------ host_ints / host_int32

def test_host_ints():
    assert host_data.host_ints([0, 5, numpy.int64(9)]) and host_data.host_ints((1,)) and host_data.host_ints([])
    for refused in ([0, True], [0, 1.0], [0, torch.tensor(3)], numpy.array([0, 1]), torch.tensor([0, 1]),
                    "012", None):
        assert not host_data.host_ints(refused), refused


@pytest.mark.parametrize("dtype", INT_DTYPES, ids=str)
def test_host_int32_copies_integer_host_tensors(dtype):
    data = torch.tensor([0, 5, 9], dtype=dtype)
    got = host_data.host_int32(data)
    assert got.dtype == torch.int32 and got.tolist() == [0, 5, 9] and host_data.is_host(got)
    got[0] = 7
    assert data[0] == 0                                   # a copy of its own, int32 or not


def test_host_int32_takes_lists_and_integer_numpy_arrays():
    assert host_data.host_int32([0, 5, numpy.int64(9)]).tolist() == [0, 5, 9]
    assert host_data.host_int32((0, 5)).dtype == torch.int32
    assert host_data.host_int32([]).tolist() == []
    array = numpy.array([0, 5], dtype=numpy.int64)
    got = host_data.host_int32(array)
    assert got.dtype == torch.int32 and got.tolist() == [0, 5]
    got[0] = 3
    assert array[0] == 0


def test_host_int32_refuses_floats_bools_device_data_and_more_than_one_dimension():
    for refused in ([0.0, 3.0], [True, 3], [0, torch.tensor(5)], numpy.array([0.0, 3.0]),
                    numpy.array([True, False]), torch.tensor([0.0, 3.0]), torch.tensor([True, False]),
                    torch.tensor([1 + 2j]), torch.tensor([[0, 5]]), numpy.array([[0, 5]]),
                    torch.empty(3, dtype=torch.int32, device="meta"), None, 5):
        assert host_data.host_int32(refused) is None, refused
    stand_in = torch.tensor([0, 5], dtype=torch.int32)
    with count_host_syncs(device_tensors=[stand_in], follow_placement=True) as syncs:
        assert host_data.host_int32(stand_in) is None
    assert syncs.count == 0, syncs.summary()


# ------------------------------------------------------------------ host_record's hook follows the rule

def test_keep_at_next_copy_arms_host_tensors_only():
    """A device tensor's next ``.to`` must not keep it as "host values" on its copy: under the
    old rule (``device.type == "cpu"``) a stand-in got the hook, and the tensor ``.to`` returned
    carried device data as if the host held it."""
    host = torch.tensor([0, 16, 40], dtype=torch.int32)
    assert host_record.keep_at_next_copy(host) is True      # armed (what vllm.qwen2_5_vl_host_lengths counts)
    assert host_record.HOOK in host.__dict__
    host.__dict__.pop(host_record.HOOK)
    stand_in = torch.tensor([0, 16, 40], dtype=torch.int32)
    with count_host_syncs(device_tensors=[stand_in], follow_placement=True) as syncs:
        assert host_record.keep_at_next_copy(stand_in) is False
        assert host_record.HOOK not in stand_in.__dict__
        copy = stand_in.to(DEVICE, non_blocking=True)
        assert host_record.take(copy) is None               # old rule: the stand-in itself, as "host" values
    assert syncs.count == 0, syncs.summary()
