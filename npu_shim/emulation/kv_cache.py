"""Emulation of ``torch_npu._npu_reshape_and_cache`` (ATB ReshapeAndCache).

Documented behaviour implemented (vllm-ascend's call sites):
``_npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)``
writes token t of ``key`` (T, Nkv, D) and ``value`` (T, Nkv, Dv) into the caches
(num_blocks, block_size, Nkv, D|Dv) at slot ``slot_indices[t]`` =
``block * block_size + offset``, in place. Negative slots (vLLM's padding slot
id -1) are skipped, as vLLM's own reshape_and_cache kernels do; a slot past the
cache raises.
"""
import torch

from npu_shim.emulation import dtypes

OP = "_npu_reshape_and_cache"


def _npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices):
    dtypes.check(OP, key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    if len({key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}) != 1:
        # ATB ReshapeAndCacheOperation: "key、value、keyCache、valueCache…的数据类型都必须完全一致".
        raise ValueError("%s: key, value, key_cache and value_cache must share one dtype, got "
                         "%s / %s / %s / %s" % (OP, key.dtype, value.dtype, key_cache.dtype,
                                                value_cache.dtype))
    if key.dim() != 3 or value.dim() != 3 or key.shape[0] != value.shape[0]:
        raise ValueError("%s: key/value must be (T, Nkv, D), got %s / %s"
                         % (OP, tuple(key.shape), tuple(value.shape)))
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError("%s: caches must be (num_blocks, block_size, Nkv, D)" % OP)
    if key_cache.shape[2:] != key.shape[1:] or value_cache.shape[2:] != value.shape[1:]:
        raise ValueError("%s: cache heads/dims %s / %s do not match key/value %s / %s"
                         % (OP, tuple(key_cache.shape[2:]), tuple(value_cache.shape[2:]),
                            tuple(key.shape[1:]), tuple(value.shape[1:])))
    if key_cache.shape[:2] != value_cache.shape[:2]:
        raise ValueError("%s: key and value caches have different (num_blocks, block_size)" % OP)
    slots = slot_indices.reshape(-1)
    if slots.shape[0] != key.shape[0]:
        raise ValueError("%s: %d slots for %d tokens" % (OP, slots.shape[0], key.shape[0]))
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError("%s: slot_indices must be int32 or int64" % OP)
    slots = slots.to(device=key_cache.device, dtype=torch.long)
    capacity = key_cache.shape[0] * key_cache.shape[1]
    if int(slots.max()) >= capacity if slots.numel() else False:
        raise ValueError("%s: a slot index is past the cache (capacity %d)" % (OP, capacity))
    keep = slots >= 0
    flat_k = key_cache.view(capacity, *key_cache.shape[2:])
    flat_v = value_cache.view(capacity, *value_cache.shape[2:])
    if bool(keep.all()):
        flat_k.index_copy_(0, slots, key.to(key_cache.dtype))
        flat_v.index_copy_(0, slots, value.to(value_cache.dtype))
    else:
        chosen = keep.nonzero().squeeze(1)
        flat_k.index_copy_(0, slots[chosen], key[chosen.to(key.device)].to(key_cache.dtype))
        flat_v.index_copy_(0, slots[chosen], value[chosen.to(value.device)].to(value_cache.dtype))
