"""Emulation of ``torch_npu.npu_scatter_nd_update_`` (in-place ScatterNdUpdate).

Documented behaviour implemented (Ascend Extension for PyTorch,
``npu_scatter_nd_update_(input, indices, updates)``): ``indices`` is an integer
tensor ``(..., K)`` of coordinates into the first ``K`` dimensions of
``input``; ``updates`` has shape ``indices.shape[:-1] + input.shape[K:]``;
each addressed slice of ``input`` is overwritten by its update, in place, and
``input`` is returned. sglang's NPU KV pool (``ASCEND_USE_FIA=1``) writes a
layer's cache ``(slots, 1, heads, dim)`` with ``indices = loc.view(-1, 1)``.
Repeated coordinates are not supported by the op (the result is undefined
there); the emulation raises. Negative or out-of-range coordinates raise.
"""
import torch

from npu_shim.emulation import dtypes

OP = "npu_scatter_nd_update_"


def npu_scatter_nd_update_(input, indices, updates):
    dtypes.check(OP, input=input, updates=updates)
    if input.dtype != updates.dtype:
        # op-plugin docs: updates' "数据类型需要与input一致".
        raise ValueError("%s: updates has dtype %s, input %s; they must match"
                         % (OP, updates.dtype, input.dtype))
    if indices.dtype not in (torch.int32, torch.int64):
        raise ValueError("%s: indices must be int32 or int64, got %s" % (OP, indices.dtype))
    if indices.dim() < 1 or not 1 <= indices.shape[-1] <= input.dim():
        raise ValueError("%s: indices %s must end in K <= input.dim() = %d"
                         % (OP, tuple(indices.shape), input.dim()))
    depth = indices.shape[-1]
    expected = tuple(indices.shape[:-1]) + tuple(input.shape[depth:])
    if tuple(updates.shape) != expected:
        raise ValueError("%s: updates %s, expected %s (indices.shape[:-1] + input.shape[K:])"
                         % (OP, tuple(updates.shape), expected))
    coords = indices.reshape(-1, depth).to(device=input.device, dtype=torch.long)
    bounds = torch.tensor(input.shape[:depth], device=input.device)
    if coords.numel() and bool(((coords < 0) | (coords >= bounds)).any()):
        raise ValueError("%s: an index is outside input's first %d dims %s"
                         % (OP, depth, tuple(input.shape[:depth])))
    strides = torch.tensor([int(torch.tensor(input.shape[i + 1:depth]).prod()) for i in range(depth)],
                           device=input.device)
    flat_index = (coords * strides).sum(dim=1)
    if flat_index.unique().numel() != flat_index.numel():
        raise ValueError("%s: repeated coordinates (the op's result is undefined there)" % OP)
    flat = input.view(-1, *input.shape[depth:])
    flat.index_copy_(0, flat_index, updates.reshape(-1, *input.shape[depth:]).to(input.dtype))
    return input
