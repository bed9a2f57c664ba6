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

``compute_slot_mapping_fused_groups`` / ``compute_slot_mapping_fused_groups_adaptive``: the same
slot for every KV-cache group at once (``_compute_slot_mapping_fused_groups_kernel`` and its
``_adaptive`` sibling, launched by ``MultiGroupBlockTable.compute_slot_mapping`` when the model has
more than one group, e.g. full and sliding-window layers): program ``(g, j)`` reads group ``g``'s
block table and slot mapping through the int32 pointers whose addresses ``block_table_addrs[g]``
and ``slot_mapping_addrs[g]`` hold (``tl.cast(addr, tl.pointer_type(tl.int32))``; the emulated
device's memory is host memory, so an address names host memory here too), its row stride
``block_table_strides[g]`` and block size ``block_sizes[g]``; for each request and token:
``slot = table[r, p // block_size] * block_size + p % block_size``, with a circular group
(``is_circular[g]``, ``HAS_CIRCULAR``) block index 0 and ``PAD_ID`` where ``p < 0``; the last
program of each group pads ``[num_tokens, max_num_tokens)`` with ``PAD_ID``. The requests of
grid ``(G, P)``: ``P - 1`` (adaptive) or ``(P - 1) // PARALLEL_TILES`` (tiled); tiles and
windows only split the work.
"""
import ctypes

import torch

__all__ = ["EmulatedKernel", "UnsupportedKernelError", "compute_slot_mapping", "compute_slot_mapping_fused_groups",
           "compute_slot_mapping_fused_groups_adaptive"]


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


def _held(tensor):
    """The memory a kernel reads: a device tensor's held host tensor (no device->host transfer: the
    kernel runs on the device), a host tensor itself."""
    from npu_shim.emulation import device

    return device._unwrap(tensor)


def _int32_at(address, count):
    """``count`` int32 at ``address`` (a kernel's ``tl.cast(addr, tl.pointer_type(tl.int32))``), as a
    host tensor sharing that memory: writes go to whatever tensor owns it."""
    if count <= 0:
        return torch.empty(0, dtype=torch.int32)
    return torch.frombuffer((ctypes.c_int32 * count).from_address(address), dtype=torch.int32)


def _fused_groups(name, num_reqs, grid, num_tokens, max_num_tokens, query_start_loc, positions, block_table_addrs,
                  slot_mapping_addrs, block_table_strides, block_sizes, is_circular, has_circular, pad_id):
    groups = grid[0]
    addresses = [(int(b), int(s)) for b, s in zip(_held(block_table_addrs)[:groups].tolist(),
                                                     _held(slot_mapping_addrs)[:groups].tolist())]
    strides = _held(block_table_strides)[:groups].tolist()
    sizes = _held(block_sizes)[:groups].tolist()
    circular = _held(is_circular)[:groups].tolist() if has_circular else [0] * groups
    starts = _held(query_start_loc)[:num_reqs + 1].to(torch.int64)
    pos = _held(positions)[:num_tokens].to(torch.int64)
    token = torch.arange(num_tokens, dtype=torch.int64)
    req = torch.searchsorted(starts, token, right=True) - 1
    inside = (req >= 0) & (token < starts[num_reqs]) if num_reqs else torch.zeros(num_tokens, dtype=torch.bool)
    req = req.clamp(0, max(num_reqs - 1, 0))
    for g in range(groups):
        (table_address, slots_address), stride, size = addresses[g], int(strides[g]), int(sizes[g])
        if stride <= 0 or size <= 0:
            raise UnsupportedKernelError("%s: group %d has row stride %d and block size %d" % (name, g, stride, size))
        slots = _int32_at(slots_address, max_num_tokens)
        if num_reqs:
            table = _int32_at(table_address, num_reqs * stride).view(num_reqs, stride)
            block_index = torch.zeros_like(pos) if circular[g] else torch.where(inside, pos // size, 0)
            value = table[req, block_index].to(torch.int64) * size + pos % size
            if circular[g]:
                value = torch.where(pos < 0, pad_id, value)
            head = slots[:num_tokens]
            head.copy_(torch.where(inside, value.to(torch.int32), head))
        slots[num_tokens:max_num_tokens].fill_(pad_id)


def _compute_slot_mapping_fused_groups(grid, num_tokens, max_num_tokens, query_start_loc, positions, block_table_addrs,
                                       slot_mapping_addrs, block_table_strides, block_sizes, is_circular, *,
                                       HAS_CIRCULAR, PAD_ID, TILE_BLOCK_SIZE, PARALLEL_TILES, BLOCK_TABLE_WINDOW_SIZE):
    name = "vllm_ascend _compute_slot_mapping_fused_groups_kernel"
    if (grid[1] - 1) % PARALLEL_TILES:
        raise UnsupportedKernelError("%s: grid %r is not num_reqs * PARALLEL_TILES (%d) + 1"
                                     % (name, grid, PARALLEL_TILES))
    _fused_groups(name, (grid[1] - 1) // PARALLEL_TILES, grid, num_tokens, max_num_tokens, query_start_loc, positions,
                  block_table_addrs, slot_mapping_addrs, block_table_strides, block_sizes, is_circular, HAS_CIRCULAR,
                  PAD_ID)


def _compute_slot_mapping_fused_groups_adaptive(grid, num_tokens, max_num_tokens, query_start_loc, positions,
                                                block_table_addrs, slot_mapping_addrs, block_table_strides,
                                                block_sizes, is_circular, *, HAS_CIRCULAR, PAD_ID,
                                                SMALL_TILE_BLOCK_SIZE, SMALL_BLOCK_TABLE_WINDOW_SIZE,
                                                LARGE_BLOCK_TABLE_WINDOW_SIZE):
    _fused_groups("vllm_ascend _compute_slot_mapping_fused_groups_adaptive_kernel", grid[1] - 1, grid, num_tokens,
                  max_num_tokens, query_start_loc, positions, block_table_addrs, slot_mapping_addrs,
                  block_table_strides, block_sizes, is_circular, HAS_CIRCULAR, PAD_ID)


compute_slot_mapping_fused_groups = EmulatedKernel(
    "vllm_ascend.ops.triton.compute_slot_mapping._compute_slot_mapping_fused_groups_kernel",
    _compute_slot_mapping_fused_groups)
compute_slot_mapping_fused_groups_adaptive = EmulatedKernel(
    "vllm_ascend.ops.triton.compute_slot_mapping._compute_slot_mapping_fused_groups_adaptive_kernel",
    _compute_slot_mapping_fused_groups_adaptive)
