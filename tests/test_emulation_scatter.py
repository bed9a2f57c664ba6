"""The emulated ``torch_npu.npu_scatter_nd_update_`` (sglang's NPU KV pool writes with it)."""
import pytest
import torch


@pytest.fixture(scope="module")
def torch_npu():
    from npu_shim import emulation

    emulation.install()
    import torch_npu

    return torch_npu


def test_writes_the_addressed_slots_in_place_both_spellings(torch_npu):
    for op in (torch_npu.npu_scatter_nd_update_, torch.ops.npu.npu_scatter_nd_update_):
        cache = torch.zeros(10, 1, 2, 3)
        loc = torch.tensor([7, 2, 5], dtype=torch.int32)
        updates = torch.randn(3, 1, 2, 3)
        out = op(cache, loc.view(-1, 1), updates)
        expected = torch.zeros(10, 1, 2, 3)
        expected[[7, 2, 5]] = updates
        assert torch.equal(cache, expected)
        assert out.data_ptr() == cache.data_ptr()


def test_two_index_dims(torch_npu):
    cache = torch.zeros(4, 5, 3)
    torch_npu.npu_scatter_nd_update_(cache, torch.tensor([[1, 4], [3, 0]]), torch.ones(2, 3))
    assert cache.sum() == 6 and cache[1, 4].eq(1).all() and cache[3, 0].eq(1).all()


@pytest.mark.parametrize("indices, updates, message", [
    (torch.tensor([[1], [1]]), torch.ones(2, 1, 2, 3), "repeated coordinates"),
    (torch.tensor([[10]]), torch.ones(1, 1, 2, 3), "outside input"),
    (torch.tensor([[-1]]), torch.ones(1, 1, 2, 3), "outside input"),
    (torch.tensor([[1]]), torch.ones(1, 2, 3), "updates"),
    (torch.tensor([[1.0]]), torch.ones(1, 1, 2, 3), "int32 or int64"),
])
def test_bad_input_is_refused_with_the_reason(torch_npu, indices, updates, message):
    with pytest.raises(ValueError, match=message):
        torch_npu.npu_scatter_nd_update_(torch.zeros(10, 1, 2, 3), indices, updates)
