"""host_cu_seqlens: one device->host transfer per distinct tensor, re-read after an
in-place change, free for host input, never shared between tensors."""
import gc

import numpy as np
import pytest
import torch

from npu_shim.kernels import host_cu_seqlens
from npu_shim.kernels import seqlens as seqlens_module
from npu_shim.testing import count_host_syncs


def test_one_sync_for_27_layers():
    cu = torch.tensor([0, 5, 9, 20], dtype=torch.int32)
    with count_host_syncs(device_tensors=[cu]) as syncs:
        results = {host_cu_seqlens(cu) for _layer in range(27)}
    assert results == {(0, 5, 9, 20)}
    assert syncs.count == 1 and syncs.events[0].kind == "tolist"


def test_in_place_change_is_seen_and_costs_one_more_sync():
    cu = torch.tensor([0, 5, 9, 20])
    with count_host_syncs(device_tensors=[cu]) as syncs:
        assert host_cu_seqlens(cu) == (0, 5, 9, 20)
        cu[2] = 7
        assert host_cu_seqlens(cu) == (0, 5, 7, 20)
        assert host_cu_seqlens(cu) == (0, 5, 7, 20)
    assert syncs.count == 2


def test_a_new_tensor_is_read_again_even_with_equal_values():
    a = torch.tensor([0, 3, 8])
    b = torch.tensor([0, 3, 8])
    with count_host_syncs(device_tensors=[a, b]) as syncs:
        host_cu_seqlens(a)
        host_cu_seqlens(b)
        host_cu_seqlens(a)
    assert syncs.count == 2


def test_two_tensors_never_share_a_value():
    """The upstream 0.15.0rc1 cache was one module global: a second encoder read the
    first one's lengths. Here each tensor has its own entry."""
    a = torch.tensor([0, 3, 8])
    b = torch.tensor([0, 2, 2, 10])
    with count_host_syncs(device_tensors=[a, b]) as syncs:
        for _ in range(10):
            assert host_cu_seqlens(a) == (0, 3, 8)
            assert host_cu_seqlens(b) == (0, 2, 2, 10)
    assert syncs.count == 2


def test_dead_tensor_ids_are_never_confused():
    for i in range(300):  # CPython reuses the ids of freed tensors
        t = torch.tensor([0, i, i + 1])
        assert host_cu_seqlens(t) == (0, i, i + 1)
        del t
    gc.collect()


def test_entries_die_with_their_tensor():
    t = torch.tensor([0, 4])
    host_cu_seqlens(t)
    before = len(seqlens_module._cache)
    del t
    gc.collect()
    assert len(seqlens_module._cache) == before - 1


@pytest.mark.parametrize("host", [
    [0, 2, 5], (0, 2, 5), np.array([0, 2, 5], dtype=np.int32), torch.tensor([0, 2, 5])])
def test_host_input_costs_no_sync(host):
    with count_host_syncs() as syncs:
        for _ in range(27):
            assert host_cu_seqlens(host) == (0, 2, 5)
    assert syncs.count == 0


def test_inference_tensors_are_cached_too():
    with torch.inference_mode():
        cu = torch.tensor([0, 4, 6])
    with count_host_syncs(device_tensors=[cu]) as syncs:
        for _ in range(27):
            assert host_cu_seqlens(cu) == (0, 4, 6)
    assert syncs.count == 1


@pytest.mark.parametrize("bad, word", [
    (torch.tensor([[0, 1]]), "1-D"),
    (torch.tensor([0.0, 1.0]), "integer"),
    (torch.tensor([1, 2]), "start at 0"),
    (torch.tensor([0, 5, 3]), "non-decreasing"),
    (torch.tensor([], dtype=torch.int64), "empty"),
    ([0, 2.5], "integers"),
    ([0, [1]], "1-D"),
])
def test_invalid_values_raise_a_clear_error(bad, word):
    with pytest.raises(ValueError, match=word):
        host_cu_seqlens(bad)


def test_tensor_elements_in_a_list_are_refused():
    with pytest.raises(TypeError, match="host sync"):
        host_cu_seqlens([0, torch.tensor(3)])
