"""Inputs the sglang context-parallel selftests share: a batch of sequences with
cached prefixes, a paged KV cache with shuffled pages, and the zigzag split.

The inputs are drawn on the host in float32 from one ``torch.Generator``;
``ascend_layer_case`` moves the cache to the device and builds the layer, the
backend and the float64 reference the selftests compare against.
"""
import random
import time
from types import SimpleNamespace

__all__ = ["ascend_layer_case", "extend_forward_batch", "run_cp_fia", "random_batch", "shuffled_paged_cache", "zigzag_block_sizes",
           "zigzag_layout"]


def ascend_layer_case(module, extend_lens, prefix_lens, heads, kv_heads, head_dim, page_size,
                      device, dtype):
    """One attention layer on sglang's ``AscendAttnBackend`` (of ``module``) over a random
    batch: host ``q`` (per sequence), ``seq_lens``, the paged ``k_cache``/``v_cache`` and
    ``block_table`` on ``device``, a ``RadixAttention`` ``layer``, the ``backend`` and the
    float64 causal ``reference`` output of each sequence's new tokens.

    The backend is made with ``object.__new__`` and given what the CP FIA methods read
    (``page_size``, ``device``, ``forward_metadata.block_tables``, ``fia_mask``): its
    ``__init__`` needs a whole ``ModelRunner``.
    """
    import torch
    from sglang.srt.layers.radix_attention import RadixAttention

    from npu_shim.testing import attention_f64

    gen = torch.Generator().manual_seed(0)
    q, k, v = random_batch(extend_lens, prefix_lens, heads, kv_heads, head_dim, gen)
    k_cache, v_cache, block_table = shuffled_paged_cache(k, v, page_size, gen)
    layer = RadixAttention(num_heads=heads, head_dim=head_dim, scaling=head_dim ** -0.5,
                           num_kv_heads=kv_heads, layer_id=0)
    block_table = block_table.to(device)
    backend = object.__new__(module.AscendAttnBackend)
    backend.page_size, backend.device = page_size, device
    backend.forward_metadata = module.ForwardMetadata(block_tables=block_table)
    backend.fia_mask = module.AscendAttnMaskBuilder.generate_mask_flag(2048).to(device)
    reference = [attention_f64(qs.to(dtype), ks.to(dtype), vs.to(dtype), [0, qs.shape[0]],
                               [0, ks.shape[0]], scale=layer.scaling, causal=True)
                 for qs, ks, vs in zip(q, k, v)]
    return SimpleNamespace(
        device=device, q=q, seq_lens=[p + n for p, n in zip(prefix_lens, extend_lens)], layer=layer,
        backend=backend, k_cache=k_cache.to(device, dtype), v_cache=v_cache.to(device, dtype),
        block_table=block_table, reference=reference)


def extend_forward_batch(extend_lens, seq_lens, metadata):
    """sglang's ``ForwardBatch`` of one extend (prefill) step over the batch, carrying the
    CP ``metadata``; nothing is written to a cache (no ``out_cache_loc``)."""
    import torch
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=len(extend_lens),
        input_ids=torch.zeros(sum(extend_lens), dtype=torch.int64),
        req_pool_indices=torch.arange(len(extend_lens)), seq_lens=torch.tensor(seq_lens),
        out_cache_loc=torch.zeros(0, dtype=torch.int64), seq_lens_sum=sum(seq_lens),
        attn_cp_metadata=metadata)


def run_cp_fia(module, case, local_q, forward_batch, more_device_tensors=()):
    """One ``AscendAttnBackend.do_cp_attn_fia`` call on ``case``: ``(out, host syncs, seconds)``.

    The syncs are counted with q, the caches, the block table, the mask and
    ``more_device_tensors`` treated as device tensors."""
    import torch

    from npu_shim.testing import count_host_syncs

    device_tensors = [local_q, case.k_cache, case.v_cache, case.block_table, case.backend.fia_mask]
    started = time.perf_counter()
    with count_host_syncs(device_tensors=device_tensors + list(more_device_tensors)) as counter:
        out = module.AscendAttnBackend.do_cp_attn_fia(case.backend, local_q, case.k_cache, case.v_cache,
                                                      case.layer, forward_batch)
    if case.device != "cpu":
        torch.npu.synchronize()
    return out, counter.count, time.perf_counter() - started


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
