"""Emulated launches of vllm-ascend's Triton kernels (npu_shim/emulation/triton_kernels.py) against a
reference written from the kernel's definition, one token at a time (integers: exact)."""
import pytest
import torch

from npu_shim.emulation import triton_kernels

PAD = -1


def _reference(num_reqs, num_tokens, max_num_tokens, query_start_loc, positions, block_table, block_size, before):
    out = before.clone().tolist()
    qsl = query_start_loc.tolist()
    for r in range(num_reqs):
        for t in range(qsl[r], qsl[r + 1]):
            p = int(positions[t])
            out[t] = int(block_table[r, p // block_size]) * block_size + p % block_size
    for t in range(num_tokens, max_num_tokens):
        out[t] = PAD
    return out


def _launch(num_reqs, num_tokens, max_num_tokens, qsl, positions, table, block_size, slots, **overrides):
    constexprs = dict(KV_CACHE_BLOCK_SIZE=block_size, BLOCKS_PER_KV_BLOCK=1, TOTAL_CP_WORLD_SIZE=1, TOTAL_CP_RANK=0,
                      CP_KV_CACHE_INTERLEAVE_SIZE=1, PAD_ID=PAD, TILE_BLOCK_SIZE=1024, BLOCK_TABLE_WINDOW_SIZE=4,
                      IS_CIRCULAR=False)
    constexprs.update(overrides)
    triton_kernels.compute_slot_mapping[(num_reqs + 1,)](
        num_tokens, max_num_tokens, qsl, positions, table, table.stride(0), block_size, slots, **constexprs)


def test_compute_slot_mapping_prefill_decode_and_block_boundaries():
    block_size = 4
    # request 0: prefill of 6 tokens (crosses a block), request 1: decode at position 7 (last slot of
    # its second block), request 2: chunk at positions 8..10 (starts a third block)
    qsl = torch.tensor([0, 6, 7, 10, 10], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 0, 0], dtype=torch.int64)
    table = torch.tensor([[3, 9, 0, 0], [5, 2, 0, 0], [7, 1, 6, 0], [0, 0, 0, 0]], dtype=torch.int32)
    slots = torch.full((12,), 99, dtype=torch.int32)
    before = slots.clone()
    _launch(3, 10, 12, qsl, positions, table, block_size, slots)
    want = _reference(3, 10, 12, qsl, positions, table, block_size, before)
    assert slots.tolist() == want
    assert want[:6] == [12, 13, 14, 15, 36, 37] and want[6] == 11 and want[7:10] == [24, 25, 26]
    assert want[10:] == [PAD, PAD]


@pytest.mark.parametrize("overrides, word", [({"TOTAL_CP_WORLD_SIZE": 2}, "context parallelism"),
                                             ({"IS_CIRCULAR": True}, "circular")])
def test_compute_slot_mapping_refuses_what_it_does_not_emulate(overrides, word):
    qsl = torch.tensor([0, 1], dtype=torch.int32)
    table = torch.zeros(1, 2, dtype=torch.int32)
    with pytest.raises(triton_kernels.UnsupportedKernelError, match=word):
        _launch(1, 1, 1, qsl, torch.zeros(1, dtype=torch.int64), table, 4, torch.zeros(1, dtype=torch.int32),
                **overrides)


def _fused_launch(kernel, grid, num_tokens, max_num_tokens, qsl, positions, tables, slots, circular, **constexprs):
    addresses = lambda ts: torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64)  # noqa: E731
    kernel[grid](num_tokens, max_num_tokens, qsl, positions, addresses(tables), addresses(slots),
                 torch.tensor([t.stride(0) for t in tables], dtype=torch.int64),
                 torch.tensor([size for size, _ in circular], dtype=torch.int32),
                 torch.tensor([int(c) for _, c in circular], dtype=torch.int32), PAD_ID=PAD, HAS_CIRCULAR=True,
                 **constexprs)


@pytest.mark.parametrize("adaptive", [True, False], ids=["adaptive", "tiled"])
def test_fused_groups_write_every_group_through_its_addresses(adaptive):
    """Two KV-cache groups (block sizes 4 and 2, tables of different widths), three requests, and a
    third, circular group: each group's slots are the one-group reference's on its own table, the
    circular one's block 0 (PAD where the position is negative); the tail is PAD in every group."""
    qsl = torch.tensor([0, 6, 7, 10, 10], dtype=torch.int32)
    positions = torch.tensor([0, 1, 2, 3, 4, 5, 7, 8, 9, 10, 0, 0], dtype=torch.int64)
    tables = [torch.tensor([[3, 9, 0, 0], [5, 2, 0, 0], [7, 1, 6, 0], [0, 0, 0, 0]], dtype=torch.int32),
              torch.tensor([[1, 2, 3, 4, 5, 6], [7, 8, 9, 10, 11, 12], [13, 14, 15, 16, 17, 18],
                            [0] * 6], dtype=torch.int32),
              torch.tensor([[4, 0], [6, 0], [8, 0], [0, 0]], dtype=torch.int32)]
    circular = [(4, False), (2, False), (4, True)]
    slots = [torch.full((12,), 99, dtype=torch.int32) for _ in tables]
    before = [s.clone() for s in slots]
    if adaptive:
        _fused_launch(triton_kernels.compute_slot_mapping_fused_groups_adaptive, (3, 4), 10, 12, qsl, positions,
                      tables, slots, circular, SMALL_TILE_BLOCK_SIZE=16, SMALL_BLOCK_TABLE_WINDOW_SIZE=8,
                      LARGE_BLOCK_TABLE_WINDOW_SIZE=512)
    else:
        _fused_launch(triton_kernels.compute_slot_mapping_fused_groups, (3, 3 * 2 + 1), 10, 12, qsl, positions,
                      tables, slots, circular, TILE_BLOCK_SIZE=16, PARALLEL_TILES=2, BLOCK_TABLE_WINDOW_SIZE=8)
    for g in range(2):
        assert slots[g].tolist() == _reference(3, 10, 12, qsl, positions, tables[g], circular[g][0], before[g]), g
    assert slots[1][:6].tolist() == [2, 3, 4, 5, 6, 7]         # block size 2: its own table's blocks
    ring = [int(tables[2][r, 0]) * 4 + int(p) % 4 for r, (a, b) in enumerate([(0, 6), (6, 7), (7, 10)])
            for p in positions[a:b]]
    assert slots[2].tolist() == ring + [PAD, PAD]


def test_fused_groups_circular_pads_negative_positions():
    qsl = torch.tensor([0, 2], dtype=torch.int32)
    table = torch.tensor([[5, 0]], dtype=torch.int32)
    slots = torch.zeros(3, dtype=torch.int32)
    _fused_launch(triton_kernels.compute_slot_mapping_fused_groups_adaptive, (1, 2), 2, 3, qsl,
                  torch.tensor([-1, 6]), [table], [slots], [(4, True)], SMALL_TILE_BLOCK_SIZE=16,
                  SMALL_BLOCK_TABLE_WINDOW_SIZE=8, LARGE_BLOCK_TABLE_WINDOW_SIZE=512)
    assert slots.tolist() == [PAD, 22, PAD]

