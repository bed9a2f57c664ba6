"""Paged KV-cache cases for the emulated paged-attention ops' tests."""
import torch


def paged_kv(kv_lens, nkv, d, dv, block_size, dtype, seed=0):
    """Per-sequence K ``(n, nkv, d)`` and V ``(n, nkv, dv)``, and caches ``(num_blocks, block_size, nkv,
    d or dv)`` holding them through a shuffled int32 block table ``(batch, max blocks + 1)``; the other
    blocks, and the table's padding, hold garbage. Returns ``(k, v, k_cache, v_cache, block_table)``."""
    g = torch.Generator().manual_seed(seed)
    k = [torch.randn(n, nkv, d, generator=g).to(dtype) for n in kv_lens]
    v = [torch.randn(n, nkv, dv, generator=g).to(dtype) for n in kv_lens]
    need = [-(-n // block_size) for n in kv_lens]
    total = sum(need) + 2
    order = torch.randperm(total, generator=g).tolist()
    table = torch.zeros(len(kv_lens), max(need) + 1, dtype=torch.int32)
    kc = torch.randn(total, block_size, nkv, d, generator=g).to(dtype)
    vc = torch.randn(total, block_size, nkv, dv, generator=g).to(dtype)
    for i, n in enumerate(kv_lens):
        ids, order = order[:need[i]], order[need[i]:]
        table[i, :need[i]] = torch.tensor(ids, dtype=torch.int32)
        for j, blk in enumerate(ids):
            rows = slice(j * block_size, min(n, (j + 1) * block_size))
            kc[blk, :rows.stop - rows.start] = k[i][rows]
            vc[blk, :rows.stop - rows.start] = v[i][rows]
    return k, v, kc, vc, table
