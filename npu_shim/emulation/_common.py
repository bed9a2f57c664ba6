"""Argument checking and tensor layouts shared by the emulated torch_npu ops.

The emulation's rule: an argument it does not implement raises
``NotImplementedError`` naming the argument; an argument that the documented op
would reject raises ``ValueError`` naming the documented constraint. It never
quietly computes something else.
"""
import math
import operator

import torch
from torch.utils.weak import WeakIdKeyDictionary

from npu_shim.emulation import dtypes

INT_MAX = 2147483647
COMPRESSED_MASK_SIZE = 2048


def not_implemented(op, name, detail=""):
    msg = "%s: argument %r is not implemented by the npu-shim emulation" % (op, name)
    if detail:
        msg += " (%s)" % detail
    return NotImplementedError(msg)


def reject_set(op, **args):
    """Raise for the first argument that is not None (features the emulation lacks)."""
    for name, value in args.items():
        if value is not None:
            raise not_implemented(op, name)


def as_int(op, name, value):
    """An integer argument: Python ints, NumPy integers and integer 0-d tensors are
    accepted; 3.5, "3", True or a float tensor are refused, never truncated."""
    if not isinstance(value, bool):
        try:
            return operator.index(value)
        except TypeError:
            pass
    raise TypeError("%s: %s must be an integer, got %r (%s)" % (op, name, value, type(value).__name__))


def host_ints(values, op="torch_npu op", name="lengths"):
    """A list of Python ints from a list/tuple/array/tensor of integers (emulation-internal)."""
    if values is None:
        return None
    if isinstance(values, torch.Tensor):
        values = values.tolist()
    elif hasattr(values, "tolist"):
        values = values.tolist()
    elif isinstance(values, int):
        values = [values]
    if not isinstance(values, (list, tuple)):
        values = [values]   # a 0-d array or tensor
    return [as_int(op, name, x) for x in values]


def check_float_inputs(op, **tensors):
    """Each tensor in a dtype ``op`` takes on the emulated SoC (npu_shim.emulation.dtypes,
    from the vendor's documentation), all of one dtype."""
    dtypes.check(op, **tensors)
    dtype = None
    for name, t in tensors.items():
        if dtype is None:
            dtype = t.dtype
        elif t.dtype != dtype:
            raise ValueError("%s: query, key and value must share one dtype" % op)


def check_heads(op, num_heads, num_kv_heads, max_ratio=None):
    if num_heads <= 0 or num_kv_heads <= 0 or num_heads % num_kv_heads:
        raise ValueError(
            "%s: the number of query heads (%d) must be a positive multiple of the "
            "number of key/value heads (%d)" % (op, num_heads, num_kv_heads)
        )
    if max_ratio is not None and num_heads // num_kv_heads > max_ratio:
        raise ValueError("%s: num_heads / num_key_value_heads must be <= %d" % (op, max_ratio))


def per_batch_lengths(op, name, values, batch, default):
    """Documented rule for actual_seq_lengths(_kv) in batch layouts: one value is
    used for every batch; otherwise the first ``batch`` values; None = full."""
    if values is None:
        return [default] * batch
    values = host_ints(values, op, name)
    if len(values) == 1:
        values = values * batch
    if len(values) < batch:
        raise ValueError(
            "%s: %s has %d values for %d batches (pass 1 or >= batch values)"
            % (op, name, len(values), batch)
        )
    values = values[:batch]
    for v in values:
        if v < 0 or v > default:
            raise ValueError("%s: %s value %d is outside [0, %d]" % (op, name, v, default))
    return values


def cumulative_segments(op, name, cum, total):
    """(start, end) pairs from cumulative lengths (no leading 0), as TND uses them.

    Trailing zeros mark batches that do not take part (documented for
    npu_fusion_attention TND); they are dropped. Otherwise values must be
    non-decreasing and end at or before ``total``.
    """
    cum = host_ints(cum, op, name)
    if not cum:
        raise ValueError("%s: %s is required with input_layout='TND'" % (op, name))
    last = len(cum)
    while last > 0 and cum[last - 1] == 0:
        last -= 1
    cum = cum[:last]
    segments = []
    start = 0
    for end in cum:
        if end < start:
            raise ValueError(
                "%s: %s must be cumulative (non-decreasing), got %r" % (op, name, cum)
            )
        segments.append((start, end))
        start = end
    if start > total:
        raise ValueError(
            "%s: %s ends at %d but the tensor has only %d tokens" % (op, name, start, total)
        )
    return segments


# ----------------------------------------------------------------------- layouts


def split_hidden(op, x, heads, what):
    h = x.shape[-1]
    if heads <= 0 or h % heads:
        raise ValueError("%s: %s hidden size %d is not divisible by %d heads" % (op, what, h, heads))
    return x.unflatten(-1, (heads, h // heads))


def to_bsnd(op, x, layout, heads, what):
    """A (B, S, N, D) view of a query/key/value tensor in ``layout``."""
    expected = {"BSH": 3, "SBH": 3, "BSND": 4, "BNSD": 4}[layout]
    if x.dim() != expected:
        raise ValueError(
            "%s: %s must be %d-D for input_layout=%r, got shape %s"
            % (op, what, expected, layout, tuple(x.shape))
        )
    if layout == "BSND":
        return x
    if layout == "BNSD":
        return x.permute(0, 2, 1, 3)
    if layout == "BSH":
        return split_hidden(op, x, heads, what)
    return split_hidden(op, x.permute(1, 0, 2), heads, what)  # SBH


def alloc_out_bsnd(layout, b, s, n, dv, like):
    """Allocate the output in ``layout`` (head dim ``dv``) and return (out, BSND view)."""
    opts = dict(dtype=like.dtype, device=like.device)
    if layout == "BSND":
        out = torch.empty((b, s, n, dv), **opts)
        return out, out
    if layout in ("BNSD", "BNSD_BSND"):
        if layout == "BNSD_BSND":
            out = torch.empty((b, s, n, dv), **opts)
            return out, out
        out = torch.empty((b, n, s, dv), **opts)
        return out, out.permute(0, 2, 1, 3)
    if layout == "BSH":
        out = torch.empty((b, s, n * dv), **opts)
        return out, out.view(b, s, n, dv)
    out = torch.empty((s, b, n * dv), **opts)  # SBH
    return out, out.view(s, b, n, dv).permute(1, 0, 2, 3)


# ------------------------------------------------------------- compressed masks

_verified_masks = WeakIdKeyDictionary()


def check_compressed_mask(op, mask, sparse_mode):
    """sparse_mode 2/3/4 take the optimised 2048x2048 lower-triangular mask
    (True above the diagonal). The op derives the causal/band pattern from the
    mode, so the mask's content must be exactly that; a different one would be a
    silent precision bug on hardware, so the emulation refuses it."""
    if mask is None:
        raise ValueError(
            "%s: sparse_mode=%d requires atten_mask, the compressed %dx%d "
            "lower-triangular mask (torch.triu(torch.ones(2048, 2048, dtype=torch.bool), 1))"
            % (op, sparse_mode, COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE)
        )
    size = COMPRESSED_MASK_SIZE
    if mask.shape not in ((size, size), (1, size, size), (1, 1, size, size)):
        raise ValueError(
            "%s: sparse_mode=%d requires a (2048, 2048) compressed atten_mask "
            "(or (1, 2048, 2048) / (1, 1, 2048, 2048)), got shape %s"
            % (op, sparse_mode, tuple(mask.shape))
        )
    version = None if mask.is_inference() else mask._version
    if version is not None and _verified_masks.get(mask) == version:
        return
    expected = torch.ones((size, size), dtype=torch.bool, device=mask.device).triu_(1)
    got = mask.reshape(size, size)
    got = got if got.dtype == torch.bool else got != 0
    if not torch.equal(got, expected):
        raise ValueError(
            "%s: sparse_mode=%d: atten_mask must be the compressed lower-triangular "
            "mask, True strictly above the diagonal (torch.triu(ones(2048, 2048), 1))"
            % (op, sparse_mode)
        )
    if version is not None:
        _verified_masks[mask] = version


def band_limit(tokens):
    """pre/next tokens as a Band bound: the INT_MAX-ish defaults mean unbounded."""
    return None if tokens >= INT_MAX - 10000 else int(tokens)


# ------------------------------------------------------------------ paged KV


class PagedRows:
    """Rows 0..length of one sequence stored in a paged cache, fetched per slice.

    ``cache`` is viewed as (num_blocks, block_size, Nkv, D); ``block_ids`` is this
    sequence's row of the block table (a tensor, read on its own device, no host
    transfer). Slicing gathers only the blocks the slice touches, so the engine's
    column chunks bound the memory of the gather too.
    """

    def __init__(self, cache, block_ids, block_size, length):
        self.cache = cache
        self.block_ids = block_ids
        self.block_size = block_size
        self.shape = (length, cache.shape[2], cache.shape[3])

    def __getitem__(self, rows):
        if not isinstance(rows, slice) or rows.step not in (None, 1):
            raise TypeError("PagedRows supports contiguous slices only")
        start, stop, _ = rows.indices(self.shape[0])
        stop = max(start, stop)
        bs = self.block_size
        b0, b1 = start // bs, -(-stop // bs)
        ids = self.block_ids[b0:b1]
        if ids.device != self.cache.device:
            ids = ids.to(self.cache.device)
        flat = self._rows_of(self.cache.index_select(0, ids.long()))
        return flat[start - b0 * bs: stop - b0 * bs]

    def _rows_of(self, blocks):
        """Gathered blocks as (blocks * block_size, Nkv, D)."""
        return blocks.reshape(-1, self.shape[1], self.shape[2])


def paged_cache_view(op, cache, what, block_size, num_kv_heads, allow_bnsd):
    """(num_blocks, block_size, Nkv, D) view of a paged K or V cache.

    Documented layouts: (num_blocks, block_size, H) and, for BNSD/TND queries,
    (num_blocks, Nkv, block_size, D).
    """
    if block_size <= 0:
        raise ValueError("%s: block_size must be positive with block_table" % op)
    if cache.dim() == 3:
        if cache.shape[1] != block_size:
            raise ValueError(
                "%s: paged %s has shape %s; expected (num_blocks, block_size=%d, H)"
                % (op, what, tuple(cache.shape), block_size)
            )
        return split_hidden(op, cache, num_kv_heads, what)
    if cache.dim() == 4 and allow_bnsd:
        if cache.shape[1] != num_kv_heads or cache.shape[2] != block_size:
            raise ValueError(
                "%s: paged %s has shape %s; documented 4-D layout is "
                "(num_blocks, num_kv_heads=%d, block_size=%d, D)"
                % (op, what, tuple(cache.shape), num_kv_heads, block_size)
            )
        return cache.permute(0, 2, 1, 3)
    raise ValueError(
        "%s: paged %s has shape %s; documented layouts are (num_blocks, block_size, H)%s"
        % (op, what, tuple(cache.shape),
           " or (num_blocks, num_kv_heads, block_size, D)" if allow_bnsd else "")
    )


def check_block_table(op, block_table, batch, kv_lengths, block_size, num_blocks=None,
                      lengths_name="actual_seq_lengths_kv"):
    for i, n in enumerate(kv_lengths):
        if n < 0:
            raise ValueError("%s: %s[%d] = %d is negative" % (op, lengths_name, i, n))
    if block_table.dim() != 2:
        raise ValueError("%s: block_table must be 2-D (batch, max_blocks)" % op)
    if block_table.dtype not in (torch.int32, torch.int64):
        raise ValueError("%s: block_table must be int32 (int64 accepted)" % op)
    if block_table.shape[0] < batch:
        raise ValueError(
            "%s: block_table has %d rows for %d sequences" % (op, block_table.shape[0], batch)
        )
    need = max((math.ceil(n / block_size) for n in kv_lengths), default=0)
    if block_table.shape[1] < need:
        raise ValueError(
            "%s: block_table has %d columns; the longest sequence needs %d blocks"
            % (op, block_table.shape[1], need)
        )
    if num_blocks is not None and need:
        # Only the blocks each sequence reads must exist; the rest of a row is padding.
        used = torch.arange(block_table.shape[1], device=block_table.device).unsqueeze(0) < \
            torch.tensor([math.ceil(n / block_size) for n in kv_lengths],
                         device=block_table.device).unsqueeze(1)
        rows = block_table[:batch]
        bad = used & ((rows < 0) | (rows >= num_blocks))
        if bool(bad.any()):
            row, col = (int(i) for i in bad.nonzero()[0])
            raise ValueError("%s: block_table[%d, %d] = %d is not a block of the cache "
                             "(num_blocks = %d)" % (op, row, col, int(rows[row, col]), num_blocks))
