"""Emulation of ``torch_npu._npu_reshape_and_cache`` (ATB ReshapeAndCache) and
``torch_npu.npu_scatter_pa_kv_cache`` (aclnnScatterPaKvCache, "Norm" mode): the two ops
vllm-ascend writes its paged KV cache with (``DeviceOperator.reshape_and_cache``: the
first up to 0.24.0rc1, the second from 0.27.1rc1; both share :func:`_scatter_tokens`).

Documented behaviour implemented (vllm-ascend's call sites):
``_npu_reshape_and_cache(key, value, key_cache, value_cache, slot_indices)``
writes token t of ``key`` (T, Nkv, D) and ``value`` (T, Nkv, Dv) into the caches
(num_blocks, block_size, Nkv, D|Dv) at slot ``slot_indices[t]`` =
``block * block_size + offset``, in place. Negative slots (vLLM's padding slot
id -1) are skipped, as vLLM's own reshape_and_cache kernels do; a slot past the
cache raises.

On 310P a FRACTAL_NZ cache (one ``torch_npu.empty_with_format(..., acl_format=29)`` made, the
format recorded by :mod:`npu_shim.emulation.formats`) of shape (num_blocks, Nkv * D / 16,
block_size, 16): the layout of CANN ATB's reshape_and_cache inference demo ("当前仅支持Atlas
推理系列产品 ... kvCache shape改为:[block_num, head_size * head_num / 16, block_size, 16]。kvCache
数据格式改为:ACL_FORMAT_FRACTAL_NZ", CANN 8.1.RC1 ATB API), the (block_size, Nkv * D) rows of a
block in FRACTAL_NZ (:func:`npu_shim.emulation.formats.nz_to_nd`): element d of token slot s's
hidden row at ``[s // block_size, d // 16, s % block_size, d % 16]``; vllm-ascend 0.30's 310P
runner makes it (``vllm_ascend/_310p/model_runner_310p.py``, ``_allocate_kv_cache_tensors``). An NZ
cache on A2 is refused (NotImplementedError).
"""
import torch

from npu_shim.emulation import dtypes, formats, soc

NZ = formats.NZ

OP = "_npu_reshape_and_cache"
SCATTER_OP = "npu_scatter_pa_kv_cache"


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
    if NZ in (formats.acl_format_of(key_cache), formats.acl_format_of(value_cache)):
        _scatter_tokens_nz(key, value, key_cache, value_cache, slot_indices)
        return
    if key_cache.dim() != 4 or value_cache.dim() != 4:
        raise ValueError("%s: caches must be (num_blocks, block_size, Nkv, D)" % OP)
    if key_cache.shape[2:] != key.shape[1:] or value_cache.shape[2:] != value.shape[1:]:
        raise ValueError("%s: cache heads/dims %s / %s do not match key/value %s / %s"
                         % (OP, tuple(key_cache.shape[2:]), tuple(value_cache.shape[2:]),
                            tuple(key.shape[1:]), tuple(value.shape[1:])))
    if key_cache.shape[:2] != value_cache.shape[:2]:
        raise ValueError("%s: key and value caches have different (num_blocks, block_size)" % OP)
    _scatter_tokens(OP, key, value, key_cache, value_cache, slot_indices)


def _scatter_tokens(OP, key, value, key_cache, value_cache, slot_indices):
    """Write token t of key/value at slot ``slot_indices[t]`` of (num_blocks, block_size, ...)
    caches; negative slots are skipped, a slot past the cache raises."""
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
    # (block, offset) of each slot, written through the caches' own strides: an engine's cache may be
    # a strided view (vLLM's (num_blocks, 2, block_size, ...) buffer split into key and value)
    block_size = key_cache.shape[1]
    if bool(keep.all()):
        chosen_slots, k_rows, v_rows = slots, key, value
    else:
        chosen = keep.nonzero().squeeze(1)
        chosen_slots, k_rows, v_rows = slots[chosen], key[chosen.to(key.device)], value[chosen.to(value.device)]
    blocks, offsets = chosen_slots // block_size, chosen_slots % block_size
    key_cache.index_put_((blocks, offsets), k_rows.to(key_cache.dtype))
    value_cache.index_put_((blocks, offsets), v_rows.to(value_cache.dtype))


def nz_cache_hidden(op, cache, name, hidden):
    """Check a 310P FRACTAL_NZ KV cache (num_blocks, hidden / 16, block_size, 16) for ``hidden`` =
    Nkv * D; returns its block size."""
    if not soc.is_310p():
        raise NotImplementedError("%s: a FRACTAL_NZ %s on %s (A2) is not emulated (the NZ cache is 310P's)"
                                  % (op, name, soc.soc_name()))
    if formats.acl_format_of(cache) != NZ:
        raise ValueError("%s: key and value caches must share one format (one is FRACTAL_NZ)" % op)
    c = formats.NZ_CUBE
    if cache.dim() != 4 or cache.shape[3] != c or cache.shape[1] * c != hidden or cache.shape[2] % c:
        raise ValueError("%s: a FRACTAL_NZ %s must be (num_blocks, Nkv*D/16=%s, block_size (a multiple of 16), 16), "
                         "got %s" % (op, name, hidden / c, tuple(cache.shape)))
    return cache.shape[2]


def _scatter_tokens_nz(key, value, key_cache, value_cache, slot_indices):
    t, nkv, d = key.shape
    if tuple(value.shape) != (t, nkv, d):
        raise ValueError("%s: with a FRACTAL_NZ cache key and value must both be (T, Nkv, D); got %s / %s"
                         % (OP, tuple(key.shape), tuple(value.shape)))
    block_size = nz_cache_hidden(OP, key_cache, "key_cache", nkv * d)
    if nz_cache_hidden(OP, value_cache, "value_cache", nkv * d) != block_size or \
            key_cache.shape[0] != value_cache.shape[0]:
        raise ValueError("%s: key and value caches differ in (num_blocks, block_size)" % OP)
    slots = slot_indices.reshape(-1)
    if slots.shape[0] != t:
        raise ValueError("%s: %d slots for %d tokens" % (OP, slots.shape[0], t))
    if slots.dtype not in (torch.int32, torch.int64):
        raise ValueError("%s: slot_indices must be int32 or int64" % OP)
    slots = slots.to(device=key_cache.device, dtype=torch.long)
    if slots.numel() and int(slots.max()) >= key_cache.shape[0] * block_size:
        raise ValueError("%s: a slot index is past the cache (capacity %d)" % (OP, key_cache.shape[0] * block_size))
    keep = slots >= 0
    chosen = keep.nonzero().squeeze(1)
    slots = slots[chosen]
    tiles = key_cache.shape[1]
    blocks, offsets = (slots // block_size).unsqueeze(1), (slots % block_size).unsqueeze(1)
    tile = torch.arange(tiles, device=key_cache.device).unsqueeze(0)
    for rows, cache in ((key, key_cache), (value, value_cache)):
        rows = rows[chosen.to(rows.device)].reshape(-1, tiles, formats.NZ_CUBE).to(cache.dtype)
        cache.index_put_((blocks, tile, offsets), rows)


def npu_scatter_pa_kv_cache(key, value, key_cache, value_cache, slot_mapping, *,
                            compress_lens=None, compress_seq_offsets=None, seq_lens=None,
                            cache_mode="Norm"):
    """``torch_npu.npu_scatter_pa_kv_cache``, scenario 2 of aclnnScatterPaKvCache only.

    Follows the CANN ops-transformer page aclnnScatterPaKvCache (README of
    attention/scatter_pa_kv_cache, "场景二"): key (T, N, Dk), value (T, N, Dv), key_cache
    (num_blocks, block_size, N, Dk), value_cache (num_blocks, block_size, N, Dv),
    slot_mapping (T,), cacheMode "Norm"; "其中k_head_size与v_head_size可以不同,也可以相同"
    (the key and value head dims may differ). Atlas A2/A3 dtypes: "数据类型仅支持FLOAT16、
    BFLOAT16、INT8", caches "数据类型和格式与key一致"; key and value may differ in dtype only
    in the PA_NZ scenario, so here all four share one. Slots < 0 are skipped (op-plugin's
    test_scatter_pa_kv_cache golden: ``if slot < 0: continue``). All tensors are device
    tensors (no host argument). In place; returns None.

    Not implemented (NotImplementedError): the compress scenarios (compress_lens,
    compress_seq_offsets, seq_lens), cache_mode "PA_NZ" and every other mode.
    """
    from npu_shim.emulation import _common as C

    C.reject_set(SCATTER_OP, compress_lens=compress_lens,
                 compress_seq_offsets=compress_seq_offsets, seq_lens=seq_lens)
    if cache_mode != "Norm":
        raise C.not_implemented(SCATTER_OP, "cache_mode", "only 'Norm' (scenario 2), got %r"
                                % (cache_mode,))
    dtypes.check(SCATTER_OP, key=key, value=value, key_cache=key_cache, value_cache=value_cache)
    if len({key.dtype, value.dtype, key_cache.dtype, value_cache.dtype}) != 1:
        raise ValueError("%s: key, value and both caches must share one dtype in 'Norm' mode, got "
                         "%s / %s / %s / %s" % (SCATTER_OP, key.dtype, value.dtype,
                                                key_cache.dtype, value_cache.dtype))
    if key.dim() != 3 or value.dim() != 3 or key.shape[:2] != value.shape[:2]:
        raise ValueError("%s: key/value must be (T, N, Dk) / (T, N, Dv), got %s / %s"
                         % (SCATTER_OP, tuple(key.shape), tuple(value.shape)))
    if key_cache.dim() != 4 or value_cache.dim() != 4 or \
            key_cache.shape[:3] != value_cache.shape[:3]:
        raise ValueError("%s: caches must be (num_blocks, block_size, N, Dk|Dv) with one "
                         "(num_blocks, block_size, N), got %s / %s"
                         % (SCATTER_OP, tuple(key_cache.shape), tuple(value_cache.shape)))
    if key_cache.shape[2:] != key.shape[1:] or value_cache.shape[2:] != value.shape[1:]:
        raise ValueError("%s: cache heads/dims %s / %s do not match key/value %s / %s"
                         % (SCATTER_OP, tuple(key_cache.shape[2:]), tuple(value_cache.shape[2:]),
                            tuple(key.shape[1:]), tuple(value.shape[1:])))
    if slot_mapping.dim() != 1:
        raise ValueError("%s: slot_mapping must be 1-D (T,), got %s"
                         % (SCATTER_OP, tuple(slot_mapping.shape)))
    _scatter_tokens(SCATTER_OP, key, value, key_cache, value_cache, slot_mapping)
