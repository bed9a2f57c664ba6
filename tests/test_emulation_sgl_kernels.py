"""npu_shim.emulation.sgl_kernels: sglang's NPU kernels emulated from their source's semantics.

Worked by hand here (a page size of 4, pages handed out in the free list's order); the comparison with
sglang's own pure-torch allocator on many batches is in tests/lanes/test_sgl_kernels_allocator.py.
"""
import pytest
import torch

from npu_shim.emulation.sgl_kernels import EMULATED, KernelLaunchError, alloc_extend_kernel


def _launch(pre, seq, last_loc, free, page_size, out_len, max_tokens=None, **kwargs):
    out = torch.full((out_len,), -7, dtype=torch.int64)
    alloc_extend_kernel[(len(pre),)](
        torch.tensor(pre), torch.tensor(seq), torch.tensor(last_loc), torch.tensor(free), out,
        1 << (len(pre) - 1).bit_length(), page_size, max_tokens or out_len, **kwargs)
    return out.tolist()


def test_alloc_extend_fills_the_partial_page_then_new_pages_in_free_list_order():
    # request 0: prefix 2 ending at slot 41 (page 10), 9 new tokens: slots 42, 43, then page 7 whole,
    # then 3 slots of page 3; request 1: no prefix, 3 tokens: the next free page (5)
    out = _launch(pre=[2, 0], seq=[11, 3], last_loc=[41, -1], free=[7, 3, 5, 9], page_size=4, out_len=12)
    assert out == [42, 43, 28, 29, 30, 31, 12, 13, 14, 20, 21, 22]


def test_alloc_extend_within_the_last_page_takes_no_new_page():
    out = _launch(pre=[5], seq=[7], last_loc=[21], free=[9], page_size=4, out_len=2)
    assert out == [22, 23]


def test_alloc_extend_part_two_is_bounded_by_the_kernels_loop():
    # max_num_extend_tokens 4 with BLOCK_SIZE 2: the loop covers offsets 0..3 of 8 whole-page slots
    out = _launch(pre=[0], seq=[8], last_loc=[-1], free=[2, 6], page_size=4, out_len=8, max_tokens=4,
                  BLOCK_SIZE=2)
    assert out == [8, 9, 10, 11, -7, -7, -7, -7]


def test_bad_launches_are_refused_by_name():
    name = "alloc_extend_kernel"
    with pytest.raises(TypeError, match=name):
        alloc_extend_kernel(torch.zeros(1))
    with pytest.raises(KernelLaunchError, match="free_pages is not contiguous"):
        out = torch.empty(3, dtype=torch.int64)
        alloc_extend_kernel[(1,)](torch.tensor([0]), torch.tensor([3]), torch.tensor([-1]),
                                  torch.tensor([[1, 2], [3, 4]]).t()[0], out, 1, 4, 3)
    with pytest.raises(KernelLaunchError, match="out_indices must be an integer tensor"):
        alloc_extend_kernel[(1,)](torch.tensor([0]), torch.tensor([3]), torch.tensor([-1]), torch.tensor([1]),
                                  torch.empty(3), 1, 4, 3)
    with pytest.raises(KernelLaunchError, match=r"reads free_pages\[1\]"):  # the pool is short
        _launch(pre=[0, 0], seq=[3, 3], last_loc=[-1, -1], free=[1], page_size=4, out_len=6)
    assert _launch(pre=[0], seq=[2], last_loc=[-1], free=[3], page_size=4, out_len=2) == [12, 13]
    out = torch.empty(2, dtype=torch.int64)
    alloc_extend_kernel[(1, 1)](torch.tensor([0]), torch.tensor([2]), torch.tensor([-1]), torch.tensor([3]), out,
                                1, 4, 2)  # a grid's trailing 1s are one program, as in Triton
    assert out.tolist() == [12, 13]
    with pytest.raises(KernelLaunchError, match="one-dimensional grids"):
        alloc_extend_kernel[(1, 2)](*([torch.zeros(1, dtype=torch.int64)] * 5), 1, 4, 1)


def test_only_the_emulated_kernels_are_handed_out():
    assert EMULATED == {"sgl_kernel_npu.mem_cache.allocator": {"alloc_extend_kernel": alloc_extend_kernel}}
