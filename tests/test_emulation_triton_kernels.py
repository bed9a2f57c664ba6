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
