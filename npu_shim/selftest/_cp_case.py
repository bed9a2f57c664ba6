"""Inputs the sglang context-parallel selftests share: a batch of sequences with
cached prefixes, a paged KV cache with shuffled pages, and the zigzag split.

Everything is built on the host in float32 from one ``torch.Generator``; the
selftests move what they need to the device.
"""
import random

__all__ = ["random_batch", "shuffled_paged_cache", "zigzag_block_sizes", "zigzag_layout"]


def random_batch(extend_lens, prefix_lens, heads, kv_heads, head_dim, gen):
    """Per sequence: q of its new tokens, k/v of its prefix and new tokens."""
    import torch

    seq_lens = [p + n for p, n in zip(prefix_lens, extend_lens)]
    q = [torch.randn(n, heads, head_dim, generator=gen) for n in extend_lens]
    k = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in seq_lens]
    v = [torch.randn(n, kv_heads, head_dim, generator=gen) for n in seq_lens]
    return q, k, v


def shuffled_paged_cache(k, v, page_size, gen):
    """``(k_cache, v_cache, block_table)``: each sequence's K/V in pages taken in shuffled
    order (slot = page * page_size + offset); slots no sequence owns hold large garbage,
    so reading one shows in the result."""
    import torch

    kv_heads, head_dim = k[0].shape[1:]
    pages = [-(-ks.shape[0] // page_size) for ks in k]
    free = list(range(1, sum(pages) + 3))
    random.Random(0).shuffle(free)
    slots = (len(free) + 1) * page_size
    k_cache = 1e3 * torch.randn(slots, kv_heads, head_dim, generator=gen)
    v_cache = 1e3 * torch.randn(slots, kv_heads, head_dim, generator=gen)
    block_table = torch.zeros(len(k), max(pages), dtype=torch.int32)
    for s, (ks, vs) in enumerate(zip(k, v)):
        owned = [free.pop() for _ in range(pages[s])]
        block_table[s, :len(owned)] = torch.tensor(owned, dtype=torch.int32)
        positions = torch.arange(ks.shape[0])
        where = torch.tensor(owned)[positions // page_size] * page_size + positions % page_size
        k_cache[where], v_cache[where] = ks, vs
    return k_cache, v_cache, block_table


def zigzag_block_sizes(length, cp_size):
    """The ``2 * cp_size`` zigzag blocks of a sequence of ``length`` new tokens."""
    segments = 2 * cp_size
    return [length // segments + (1 if i < length % segments else 0) for i in range(segments)]


def zigzag_layout(lengths, rank, cp_size):
    """(sequence, new-token index) of each of ``rank``'s real local tokens: its blocks
    ``rank`` and ``2 * cp_size - 1 - rank`` of every sequence, in that order."""
    layout = []
    for block in (rank, 2 * cp_size - 1 - rank):
        for s, n in enumerate(lengths):
            sizes = zigzag_block_sizes(n, cp_size)
            layout.extend((s, sum(sizes[:block]) + i) for i in range(sizes[block]))
    return layout
