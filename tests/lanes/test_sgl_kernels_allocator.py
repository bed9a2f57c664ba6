"""The emulated ``sgl_kernel_npu.mem_cache.allocator.alloc_extend_kernel`` against sglang's own pure-torch
allocator (``alloc_extend_naive``, the reference of the same algorithm), on the same inputs, through the
caller the engine uses (``NPUPagedTokenToKVPoolAllocator.alloc_extend``, which launches the kernel below
200 new pages), on batches of many shapes: prefixes ending mid-page and on a page edge, extends within the
last page, across pages, of zero tokens, page sizes 1, 16 and 128 (sglang's NPU default).

Runs on the lane that pins the newest sglang (the placeholder package on ``PYTHONPATH`` hands out the
emulation by name).
"""
import random

import pytest
import torch
from sglang_support import newest  # noqa: E402

pytestmark = pytest.mark.lanes(newest.LANE)


def _batch(rng, page_size, num_pages):
    """A batch as the scheduler hands it over: per request a prefix already in pages of its own
    (``last_loc``: its last slot, -1 for none), and a longer sequence."""
    bs = rng.randint(1, 9)
    pages = list(range(1, num_pages + 1))
    rng.shuffle(pages)
    pre, seq, last = [], [], []
    for _ in range(bs):
        p = rng.choice([0, rng.randint(1, 3 * page_size)])
        e = rng.choice([0, 1, rng.randint(1, page_size + 1), rng.randint(1, 4 * page_size)])
        if p == 0:
            last.append(-1)
        else:  # the prefix's last slot lies in one of its own pages, at position (p - 1) % page_size
            last.append(pages.pop() * page_size + (p - 1) % page_size)
        pre.append(p)
        seq.append(p + e)
    return pre, seq, last, torch.tensor(pages[:num_pages // 2], dtype=torch.int64)


@pytest.mark.parametrize("page_size", [1, 16, 128])
def test_the_kernel_allocates_what_sglangs_naive_allocator_does(page_size):
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive

    from npu_shim.emulation.sgl_kernels import alloc_extend_kernel

    rng = random.Random(page_size)
    for _ in range(60):
        pre, seq, last, free = _batch(rng, page_size, 64)
        n = sum(seq) - sum(pre)
        args = (torch.tensor(pre), torch.tensor(seq), torch.tensor(last), free)
        want = torch.full((n,), -1, dtype=torch.int64)
        alloc_extend_naive(*args, want, page_size, "cpu")
        got = torch.full((n,), -1, dtype=torch.int64)
        alloc_extend_kernel[(len(pre),)](*args, got, 1 << (len(pre) - 1).bit_length(), page_size, max(n, 1))
        assert got.tolist() == want.tolist(), (page_size, pre, seq, last, free.tolist())


def test_through_the_npu_allocator_the_engine_builds():
    """``NPUPagedTokenToKVPoolAllocator.alloc_extend`` (the engine's allocator on ``device="npu"``)
    imports the kernel from the placeholder package, which hands out the emulation; its indices and its
    free list after the call are those of sglang's naive allocator on the same pool."""
    from sglang.srt.hardware_backend.npu.allocator_npu import NPUPagedTokenToKVPoolAllocator
    from sglang.srt.mem_cache.allocator.paged import alloc_extend_naive

    page_size = 16
    allocator = NPUPagedTokenToKVPoolAllocator(64 * page_size, page_size, torch.float32, "cpu", None, False)
    rng = random.Random(1)
    for _ in range(20):
        allocator.clear()
        perm = torch.randperm(64, generator=torch.Generator().manual_seed(rng.randint(0, 99))) + 1
        allocator.free_pages = perm
        pre, seq, last, _ = _batch(rng, page_size, 64)
        last = [x if x < 0 else 65 * page_size + x for x in last]  # prefix slots outside the free pages
        n = sum(seq) - sum(pre)
        t = [torch.tensor(x) for x in (pre, seq, last)]
        want = torch.full((n,), -1, dtype=torch.int64)
        alloc_extend_naive(t[0], t[1], t[2], perm.clone(), want, page_size, "cpu")
        got = allocator.alloc_extend(t[0], t[0], t[1], t[1], t[2], n)
        assert got.dtype == torch.int32 and got.tolist() == want.tolist(), (pre, seq, last)
        new_pages = sum(-(-s // page_size) - -(-p // page_size) for p, s in zip(pre, seq))
        assert allocator.free_pages.tolist() == perm[new_pages:].tolist()


def test_the_placeholder_hands_out_only_the_emulated_kernels():
    """The import placeholder (tests/placeholders/sgl_kernel_npu) gives the emulation for the names it has,
    and keeps refusing every other kernel by name (a launch of one the engine's path never took)."""
    from sgl_kernel_npu import PlaceholderKernelError
    from sgl_kernel_npu.mem_cache.allocator import alloc_extend_kernel as handed_out
    from sgl_kernel_npu.mem_cache.kv_cache_store import store_kv_cache_prefix_valid_npu_triton

    from npu_shim.emulation.sgl_kernels import alloc_extend_kernel

    assert handed_out is alloc_extend_kernel
    with pytest.raises(PlaceholderKernelError, match="store_kv_cache_prefix_valid_npu_triton"):
        store_kv_cache_prefix_valid_npu_triton(None, None, None, None, None, None)
    from sgl_kernel_npu.mem_cache.allocator import alloc_decode_kernel
    with pytest.raises(PlaceholderKernelError, match=r"alloc_decode_kernel\[\(1,\)\]"):
        alloc_decode_kernel[(1,)]
