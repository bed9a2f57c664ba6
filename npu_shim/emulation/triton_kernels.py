"""Emulated launches of vllm-ascend's Triton kernels that its model runner calls unconditionally.

Why: vllm-ascend 0.30 computes the KV-cache slot of every scheduled token with a Triton kernel
(``vllm_ascend.ops.triton.compute_slot_mapping._compute_slot_mapping_kernel``, launched by
``vllm_ascend.worker.block_table.BlockTable.compute_slot_mapping`` as
``kernel[(num_reqs + 1,)](...)``); on the NPU box triton-ascend compiles it. Without Triton,
vLLM's placeholder ``triton.jit`` leaves the plain function, which cannot be launched, so no
step runs. Here a kernel is a launchable object (``kernel[grid](*args, **kwargs)``) whose body is
written in PyTorch from the kernel's documented semantics (its source's comments and
arguments), run on the device tensors as the kernel runs on device memory: no device->host read.
A configuration the emulation does not implement is refused by name (UnsupportedKernelError).

``compute_slot_mapping``: for request ``r < num_reqs`` (``grid[0] - 1``) and each token ``t`` in
``[query_start_loc[r], query_start_loc[r + 1])`` with position ``p = positions[t]``:
``slot_mapping[t] = block_table[r, p // block_size] * block_size + p % block_size``; the last
program writes ``PAD_ID`` to ``slot_mapping[num_tokens:max_num_tokens]`` ("pad remaining slots for
CUDA graph compatibility"). Implemented without context parallelism (``TOTAL_CP_WORLD_SIZE == 1``)
and without circular (sliding-window ring) caches.
"""
import torch

__all__ = ["EmulatedKernel", "UnsupportedKernelError", "compute_slot_mapping"]


class UnsupportedKernelError(NotImplementedError):
    """A Triton kernel configuration the emulation does not implement; the message names it."""


class EmulatedKernel:
    """``kernel[grid](*args, **kwargs)`` -> ``body(grid, *args, **kwargs)``."""

    def __init__(self, name, body):
        self.name = name
        self._body = body

    def __getitem__(self, grid):
        if callable(grid):
            raise UnsupportedKernelError("%s: a grid computed from meta-parameters is not emulated" % self.name)
        grid = tuple(grid) if isinstance(grid, (tuple, list)) else (grid,)

        def launch(*args, **kwargs):
            return self._body(grid, *args, **kwargs)
        return launch

    def __repr__(self):
        return "EmulatedKernel(%s)" % self.name


def _compute_slot_mapping(grid, num_tokens, max_num_tokens, query_start_loc, positions, block_table,
                          block_table_stride, block_size, slot_mapping, *, KV_CACHE_BLOCK_SIZE,
                          BLOCKS_PER_KV_BLOCK, TOTAL_CP_WORLD_SIZE, TOTAL_CP_RANK, CP_KV_CACHE_INTERLEAVE_SIZE,
                          PAD_ID, TILE_BLOCK_SIZE, BLOCK_TABLE_WINDOW_SIZE, IS_CIRCULAR=False):
    name = "vllm_ascend _compute_slot_mapping_kernel"
    if TOTAL_CP_WORLD_SIZE != 1:
        raise UnsupportedKernelError("%s: context parallelism (TOTAL_CP_WORLD_SIZE=%d) is not emulated"
                                     % (name, TOTAL_CP_WORLD_SIZE))
    if IS_CIRCULAR:
        raise UnsupportedKernelError("%s: a circular KV cache is not emulated" % name)
    if block_table_stride != block_table.stride(0):
        raise UnsupportedKernelError("%s: block_table_stride %d is not block_table's row stride %d"
                                     % (name, block_table_stride, block_table.stride(0)))
    num_reqs = grid[0] - 1
    starts = query_start_loc[:num_reqs + 1].to(torch.int64)
    token = torch.arange(num_tokens, device=positions.device, dtype=torch.int64)
    # the request each token belongs to; tokens past the last request's end are not written
    req = torch.searchsorted(starts, token, right=True) - 1
    inside = (req >= 0) & (token < starts[num_reqs])
    req = req.clamp(0, max(num_reqs - 1, 0))
    pos = positions[:num_tokens].to(torch.int64)
    block_index = torch.where(inside, pos // block_size, 0)
    block_number = block_table[req, block_index].to(torch.int64)
    slots = block_number * block_size + pos % block_size
    head = slot_mapping[:num_tokens]
    head.copy_(torch.where(inside, slots.to(slot_mapping.dtype), head))
    slot_mapping[num_tokens:max_num_tokens].fill_(PAD_ID)


compute_slot_mapping = EmulatedKernel("vllm_ascend.ops.triton.compute_slot_mapping._compute_slot_mapping_kernel",
                                      _compute_slot_mapping)
