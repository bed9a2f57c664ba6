"""The host-sync counter sees every kind of device->host read, only for device
tensors (real or stand-in), and never inside the emulated torch_npu ops."""
import operator

import numpy as np
import pytest
import torch

from npu_shim import emulation
from npu_shim.testing import collect_host_syncs, count_host_syncs

emulation.install()
import torch_npu  # noqa: E402


def _dev(*values):
    """A CPU tensor (0-d for one value) to be marked as a device stand-in."""
    return torch.tensor(values[0] if len(values) == 1 else values)


@pytest.mark.parametrize("kind, read", [
    ("item", lambda t: t.item()),
    ("tolist", lambda t: t.tolist()),
    ("numpy", lambda t: t.numpy()),
    ("numpy", lambda t: np.asarray(t)),
    ("cpu", lambda t: t.cpu()),
    ("to", lambda t: t.to("cpu")),
    ("to", lambda t: t.to(torch.device("cpu"), torch.float32)),
    ("bool", lambda t: bool(t)),
    ("int", lambda t: int(t)),
    ("float", lambda t: float(t)),
    ("index", lambda t: operator.index(t)),
    ("index", lambda t: [10, 20, 30][t]),
    ("index", lambda t: torch.arange(5)[t]),
    ("index", lambda t: torch.arange(5).narrow(0, t, 1)),
    ("copy_", lambda t: torch.empty((), dtype=t.dtype).copy_(t)),
    ("shape", lambda t: torch.nonzero(t)),
])
def test_each_read_of_a_device_tensor_counts_once(kind, read):
    t = _dev(2)
    with count_host_syncs(device_tensors=[t]) as syncs:
        read(t)
    assert [e.kind for e in syncs.events] == [kind]
    assert "test_testing_syncs.py" in syncs.events[0].location


def test_slice_bounds_count_each_tensor_bound():
    cu = _dev(0, 3, 7)
    x = torch.randn(7, 2)
    with count_host_syncs(device_tensors=[cu]) as syncs:
        for i in range(1, len(cu)):
            x[cu[i - 1]:cu[i]]
            x[cu[i - 1]:cu[i]] = 0.0
    assert syncs.count == 8
    assert syncs.kinds() == {"index": 8}


def test_boolean_mask_indexing_is_a_shape_sync():
    m = _dev(True, False, True)
    with count_host_syncs(device_tensors=[m]) as syncs:
        torch.arange(3)[m]
    assert syncs.kinds() == {"shape": 1}


def test_host_tensors_are_free_and_device_ness_propagates():
    cu = _dev(0, 3, 7)
    host = torch.tensor([1, 2])
    with count_host_syncs(device_tensors=[cu]) as syncs:
        host.tolist()
        host.item() if host.numel() == 1 else host[0].item()
        lengths = torch.diff(cu)          # computed from a device tensor: device
        copied = lengths.to("cpu")        # one transfer
        copied.tolist()                   # free: already on the host
        (lengths * 2).max().item()        # another transfer
    assert [e.kind for e in syncs.events] == ["to", "item"]
    assert copied is not lengths


def test_upstream_pattern_diff_to_cpu_every_layer():
    cu = _dev(0, 5, 9, 20)
    with count_host_syncs(device_tensors=[cu]) as syncs:
        for _layer in range(27):
            torch.diff(cu).to("cpu")
            cu.to("cpu")
    assert syncs.count == 54  # the stand-in stays a device tensor after .to("cpu")


def test_cpu_is_device_counts_every_extraction_but_not_host_copies():
    with count_host_syncs(cpu_is_device=True) as syncs:
        t = torch.arange(4)
        t.sum().item()
        h = t.cpu()
        h.tolist()
        (h + 1).tolist()
    assert [e.kind for e in syncs.events] == ["item", "cpu"]


def test_nothing_counted_outside_the_block_and_for_unmarked_cpu():
    t = torch.tensor(3)
    with count_host_syncs() as syncs:
        t.item()
        int(t)
    t.item()
    assert syncs.count == 0


@pytest.mark.parametrize("spelling", ["torch_npu", "torch.ops.npu"])
def test_emulated_op_internals_are_invisible(spelling):
    q = torch.randn(10, 2, 16, dtype=torch.bfloat16)   # a dtype the op takes
    cu = [4, 10]
    op = torch_npu.npu_fusion_attention if spelling == "torch_npu" else torch.ops.npu.npu_fusion_attention
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    with count_host_syncs(device_tensors=[q, mask], cpu_is_device=True) as syncs:
        out = op(q, q, q, 2, "TND", scale=0.25, atten_mask=mask, sparse_mode=3,
                 actual_seq_qlen=cu, actual_seq_kvlen=cu)[0]
    assert syncs.count == 0
    with count_host_syncs(device_tensors=[q]) as syncs:
        out = torch_npu.npu_fusion_attention(q, q, q, 2, "TND", scale=0.25,
                                             actual_seq_qlen=cu, actual_seq_kvlen=cu)[0]
        out.sum().item()  # the op's output is a device tensor
    assert syncs.kinds() == {"item": 1}


def test_summary_and_repr():
    t = _dev(1)
    with count_host_syncs(device_tensors=[t]) as syncs:
        t.item()
        t.item()
    assert syncs.summary() == "2 host syncs: item x2"
    assert "item" in repr(syncs)


# ------------------------------------------- reads only the dispatcher shows


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
@pytest.mark.parametrize("kind, read", [
    ("item", lambda t: t.item()),
    ("int", lambda t: int(t)),
    ("index", lambda t: torch.arange(9)[t:]),
    ("scalar", lambda t: torch.arange(t)),
    ("scalar", lambda t: torch.ones(2).repeat(t)),
    ("scalar", lambda t: torch.full((2,), 1.0).new_zeros(t)),
    ("scalar", lambda t: torch.nn.functional.pad(torch.ones(2), (0, t))),
    ("shape", lambda t: torch.repeat_interleave(torch.ones(1), t)),
    ("shape", lambda t: torch.arange(3).repeat_interleave(t.expand(3))),
])
def test_each_scalar_read_counts_once_in_either_mode(inference, kind, read):
    with torch.inference_mode(inference):
        t = _dev(2)
        with count_host_syncs(device_tensors=[t]) as syncs:
            read(t)
    assert [e.kind for e in syncs.events] == [kind]


def test_inference_mode_item_is_seen_as_aten_item_and_counted_once():
    from torch.utils._python_dispatch import TorchDispatchMode

    class Seen(TorchDispatchMode):
        ops = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.ops.append(func)
            return func(*args, **(kwargs or {}))

    with torch.inference_mode():
        t = torch.tensor(3)
        with Seen():
            t.item()
        assert Seen.ops == [torch.ops.aten.item.default]   # not _local_scalar_dense
        with count_host_syncs(device_tensors=[t]) as syncs:
            t.item()
            torch.arange(t)
    assert syncs.kinds() == {"item": 1, "scalar": 1}


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_data_dependent_shapes(inference):
    with torch.inference_mode(inference):
        t = _dev(1, 2, 2, 5)
        with count_host_syncs(device_tensors=[t]) as syncs:
            torch.unique(t)
            t.unique_consecutive()
            t[t > 1]
            torch.masked_select(t, t > 1)
            t.nonzero()
            torch.where(t > 1)
            torch.repeat_interleave(t, t)
            torch.repeat_interleave(t, t, output_size=10)   # size given: no read
    assert [e.kind for e in syncs.events] == ["shape"] * 7


# -------------------------------------------------- placement, host->device


def test_device_of_a_stand_in_is_the_stand_in_device_and_placement_follows():
    from npu_shim.testing.syncs import DEVICE

    cu = _dev(0, 3, 7)
    with count_host_syncs(device_tensors=[cu]) as syncs:
        assert cu.device == torch.device("cpu")                   # off by default
    with count_host_syncs(device_tensors=[cu], follow_placement=True) as syncs:
        assert cu.device == DEVICE and torch.arange(3).device == torch.device("cpu")
        made = torch.zeros(3, dtype=torch.long, device=cu.device)    # allocated there
        moved = torch.tensor([1, 2, 3]).to(cu.device, non_blocking=True)
        (made + moved).tolist()
        moved.to("cpu").tolist()
    assert [e.kind for e in syncs.events] == ["tolist", "to"]
    assert syncs.h2d_count == 0


def test_device_modules_place_their_parameters_on_the_device():
    layer = torch.nn.Linear(2, 2)
    with count_host_syncs(device_modules=[layer]) as syncs:
        out = layer(torch.ones(1, 2))
        out.sum().item()
        host = torch.from_numpy(np.arange(3))                     # host data stays host
        host.sum().item()
        on_device = host.to(layer.weight.device, non_blocking=True)
        on_device.max().item()
    assert [e.kind for e in syncs.events] == ["item", "item"]
    assert syncs.h2d_count == 0


@pytest.mark.parametrize("inference", [False, True], ids=["grad-mode", "inference-mode"])
def test_blocking_host_to_device_copies_are_counted_apart(inference):
    from npu_shim.testing.syncs import DEVICE

    with torch.inference_mode(inference):
        anchor = _dev(0)
        host = torch.arange(4)
        with count_host_syncs(device_tensors=[anchor], follow_placement=True) as syncs:
            dev = anchor.device
            a = host.to(dev)                                       # blocking
            host.to(dev, non_blocking=True)                        # not
            host.to(device=dev, dtype=torch.int32)                 # blocking
            torch.tensor([1, 2], device=dev)                       # blocking
            torch.as_tensor(np.arange(2), device=dev)              # blocking
            anchor.new_tensor([1, 2])                              # blocking
            a.copy_(host)                                          # blocking
            a.copy_(host, non_blocking=True)                       # not
            host.to(anchor)                                        # blocking
            torch.empty(3, device=DEVICE)                          # an allocation, no copy
    assert syncs.count == 0
    assert syncs.h2d_count == 7
    assert {e.kind for e in syncs.h2d_events} == {"h2d"}
    assert "blocking host->device" in syncs.summary()


def test_emulated_op_body_is_invisible_to_the_dispatch_layer_too():
    q = torch.randn(10, 2, 16, dtype=torch.bfloat16)   # a dtype the op takes
    with torch.inference_mode():
        with count_host_syncs(device_tensors=[q], cpu_is_device=True) as syncs:
            torch_npu.npu_fusion_attention(q, q, q, 2, "TND", scale=0.25,
                                           actual_seq_qlen=[4, 10], actual_seq_kvlen=[4, 10])
    assert syncs.count == 0 and syncs.h2d_count == 0


def test_cpu_is_device_with_placement_keeps_host_made_tensors_on_the_host():
    layer = torch.nn.Linear(2, 2)
    with count_host_syncs(cpu_is_device=True, follow_placement=True) as syncs:
        host = torch.arange(4)
        host.sum().item()                                         # made on the host: free
        layer.weight.sum().item()                                 # made outside: device
        torch.arange(4, device=layer.weight.device).sum().item()  # placed on the device
    assert syncs.kinds() == {"item": 2}


def test_to_with_copy_is_followed_like_any_to():
    """``Tensor.to(..., copy=...)`` (vLLM 0.31's multimodal input norm passes it) is placement
    like any ``.to``: a read when it leaves the device, a blocking copy when it arrives."""
    anchor = _dev(0, 3)
    host = torch.arange(3)
    with count_host_syncs(device_tensors=[anchor], follow_placement=True) as syncs:
        same = anchor.to(torch.float32, copy=False)                # stays on the device
        host.to(anchor.device, copy=True)                          # blocking copy to the device
        host.to(anchor.device, non_blocking=True, copy=True)       # not blocking
        same.to("cpu", copy=True)                                  # a read
    assert [e.kind for e in syncs.events] == ["to"]
    assert syncs.h2d_count == 1


def test_to_the_device_of_a_tensor_already_there_returns_the_tensor_itself():
    """On a device, ``t.to(t.device)`` (``non_blocking`` or not, same dtype) is ``t`` itself:
    what code attached to ``t`` (vLLM's towers move a ``cu_seqlens`` they copied once more) is
    still there. The stand-in does the same; a dtype change, ``copy=True`` or a host tensor
    still gives a new tensor."""
    cu = _dev(0, 3, 7).to(torch.int32)
    with count_host_syncs(device_tensors=[cu], follow_placement=True) as syncs:
        assert cu.to(device=cu.device, non_blocking=True) is cu
        assert cu.to(cu.device) is cu and cu.to(cu.device, torch.int32) is cu
        assert cu.to(cu) is cu
        widened = cu.to(cu.device, torch.int64)
        copied = cu.to(cu.device, copy=True)
        assert widened is not cu and copied is not cu
        (widened + copied).tolist()                                   # both on the device
        host = torch.arange(3)
        assert host.to(cu.device, non_blocking=True) is not host
    assert [e.kind for e in syncs.events] == ["tolist"]
    assert syncs.h2d_count == 0


# The calibration of benchmarks/bench_cuda_syncs.py: single operations on a device tensor, each
# with what CUDA's sync-debug mode reported for it on an H100 (benchmarks/results/cuda-syncs.txt,
# column "cuda"), as (device->host reads, blocking host->device copies) on the CPU stand-in.
# Two where the counter knowingly differs from CUDA, checked below as the counter's rule:
# ``t.repeat_interleave(t)`` (CUDA synchronises twice, computing the output size; one read of
# data is what any device must make, so it counts one) and ``t.to("cpu", non_blocking=True)``
# (CUDA does not report it; the host cannot use the values before the copy lands, so it counts
# as the read it becomes).
CALIBRATED_ON_CUDA = [
    ("t[3].item()", lambda t, d: t[3].item(), (1, 0)),
    ("t.tolist()", lambda t, d: t.tolist(), (1, 0)),
    ("t.cpu()", lambda t, d: t.cpu(), (1, 0)),
    ("int(t.sum())", lambda t, d: int(t.sum()), (1, 0)),
    ("t.nonzero()", lambda t, d: t.nonzero(), (1, 0)),
    ("t[t > 5]", lambda t, d: t[t > 5], (1, 0)),
    ("torch.equal(t, t.clone())", lambda t, d: torch.equal(t, t.clone()), (1, 0)),
    ("t.reshape(t[2], t[6])", lambda t, d: t.reshape(t[2], t[6]), (2, 0)),
    ("t[torch.arange(3)]", lambda t, d: t[torch.arange(3)], (0, 1)),
    ("torch.arange(t[3]).to(d)", lambda t, d: torch.arange(t[3]).to(d), (1, 1)),
    ("torch.tensor([1, 2], device=d)", lambda t, d: torch.tensor([1, 2], device=d), (0, 1)),
    ("torch.tensor([1, 2]).to(d, non_blocking=True)",
     lambda t, d: torch.tensor([1, 2]).to(d, non_blocking=True), (0, 0)),
    ("t + 1", lambda t, d: t + 1, (0, 0)),
]
COUNTER_RULE_NOT_CUDA = [
    ("t.repeat_interleave(t)", lambda t, d: t.repeat_interleave(t), (1, 0)),        # CUDA: 2
    ("t.to('cpu', non_blocking=True)", lambda t, d: t.to("cpu", non_blocking=True), (1, 0)),  # CUDA: 0
]


@pytest.mark.parametrize("body, expected", [pytest.param(body, expected, id=name)
                                            for name, body, expected in CALIBRATED_ON_CUDA + COUNTER_RULE_NOT_CUDA])
def test_single_operations_count_what_a_cuda_device_reports(body, expected):
    from npu_shim.testing.syncs import DEVICE

    t = torch.arange(12, dtype=torch.int32)
    with count_host_syncs(device_tensors=[t]) as syncs:
        body(t, DEVICE)
    assert (syncs.count, syncs.h2d_count) == expected, (syncs.events, syncs.h2d_events)


def test_a_factory_sized_by_a_device_scalar_is_a_host_tensor_under_placement():
    from npu_shim.testing.syncs import DEVICE

    t = torch.arange(12, dtype=torch.int32)
    with count_host_syncs(device_tensors=[t], follow_placement=True) as syncs:
        positions = torch.arange(t[3])
        positions.to(DEVICE)
    assert [e.kind for e in syncs.events] == ["scalar"] and syncs.h2d_count == 1


def test_a_host_tensor_shaped_by_device_scalars_stays_on_the_host():
    """vLLM's Ernie4.5-VL rot_pos_emb: ``torch.arange(h).reshape(h // 2, 2, ...)`` with ``h`` from
    the device grid reads the sizes and leaves a host tensor, which ``.to(device)`` copies
    (blocking): CUDA reports that copy (benchmarks/results/cuda-syncs.txt, ernie45_vl.py:462)."""
    from npu_shim.testing.syncs import DEVICE

    grid = torch.tensor([[1, 4, 6]])
    with count_host_syncs(device_tensors=[grid], follow_placement=True) as syncs:
        _, h, w = grid[0]
        positions = torch.arange(h).unsqueeze(1).expand(-1, w).reshape(h // 2, 2, w // 2, 2)
        positions.to(DEVICE)
    assert syncs.h2d_count == 1, syncs.h2d_events
    assert syncs.count == 4, syncs.events      # h (arange), w (expand), h // 2 and w // 2 (reshape)


def test_collected_counts_keep_one_counter_per_block():
    """collect_host_syncs: each block counts reads of the tensors it is handed, and its counter is kept."""
    counters = []
    around = collect_host_syncs(counters)
    device = torch.ones(3)
    with around((device,)):
        device.sum().item()
    with around(()):
        device.sum().item()                     # not a device stand-in in this block
    assert [c.count for c in counters] == [1, 0]
