"""The ops of vllm-ascend 0.30's 310P decoder path against float64: ``torch_npu.empty_with_format`` and
the FRACTAL_NZ reading (npu_shim.emulation.formats), ``_npu_flash_attention`` with a NORM mask (ND and
NZ), ``_npu_reshape_and_cache`` into and ``_npu_paged_attention`` out of the 310P FRACTAL_NZ KV cache
(num_blocks, Nkv * D / 16, block_size, 16).

The NZ layout is spelled out here element by element from its definition (an ND (rows, cols) matrix,
padded to 16, stored as (cols / 16, rows, 16) with element [i, j] at [j // 16, i, j % 16]), not by the
emulation's helper, and the attention outputs are compared with the float64 definition of attention
(npu_shim.testing.attention_f64).
"""

import pytest
import torch

from npu_shim import emulation
from npu_shim.testing import attention_f64, dense_segments

emulation.install()
import torch_npu  # noqa: E402

from npu_shim.testing.towers import SOC_310P  # noqa: E402

pytestmark = pytest.mark.float32_math

NZ, ND = 29, 2
# max |out - float64|, float32 inputs: measured 1.2e-6 (CPU torch); atol only
TOL = 1e-5


def close(got, want):
    from npu_shim.testing.errors import within

    diff = (got.double() - want).abs()
    within("emulation 310P ATB attention vs float64", diff.max().item() if diff.numel() else 0.0, TOL, "float32")
    torch.testing.assert_close(got.double(), want, atol=TOL, rtol=0)


@pytest.fixture
def soc_310p(monkeypatch):
    monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", SOC_310P)


def nz_by_definition(nd):
    """(1, cols / 16, rows, 16) of an ND (rows, cols) matrix, both padded to 16 with zeros, one element at a time."""
    rows, cols = nd.shape
    pr, pc = -(-rows // 16) * 16, -(-cols // 16) * 16
    out = torch.zeros(1, pc // 16, pr, 16, dtype=nd.dtype)
    for i in range(rows):
        for j in range(cols):
            out[0, j // 16, i, j % 16] = nd[i, j]
    return out


def causal_additive(size, dtype=torch.float16):
    mask = torch.zeros(size, size, dtype=dtype)
    return mask.masked_fill(torch.ones(size, size, dtype=torch.bool).triu(1), float("-inf"))


def test_empty_with_format_records_the_format():
    t = torch_npu.empty_with_format((3, 4, 32, 16), dtype=torch.float16, acl_format=NZ)
    assert (tuple(t.shape), t.dtype, t.device.type) == ((3, 4, 32, 16), torch.float16, "cpu")
    assert torch_npu.get_npu_format(t) == NZ
    assert torch_npu.get_npu_format(torch_npu.empty_with_format((2, 3))) == ND
    assert torch_npu.get_npu_format(torch.zeros(2)) == ND
    assert torch_npu.get_npu_format(torch_npu.npu_format_cast(torch.zeros(1, 2, 16, 16), NZ)) == NZ
    with pytest.raises(ValueError, match="acl_format 7"):
        torch_npu.empty_with_format((2,), acl_format=7)
    with pytest.raises(NotImplementedError, match="pin_memory"):
        torch_npu.empty_with_format((2,), pin_memory=True)
    with pytest.raises(NotImplementedError, match="layout"):
        torch_npu.empty_with_format((2,), layout=torch.sparse_coo)


def test_nz_reading_inverts_the_definition():
    from npu_shim.emulation.formats import nz_to_nd

    nd = torch.randn(13, 30, generator=torch.Generator().manual_seed(0))
    back = nz_to_nd("test", "mask", nz_by_definition(nd))
    assert back.shape == (16, 32)
    assert torch.equal(back[:13, :30], nd) and not back[13:].any() and not back[:, 30:].any()
    with pytest.raises(NotImplementedError, match="FRACTAL_NZ of shape"):
        nz_to_nd("test", "mask", torch.zeros(2, 2, 16, 16))


def _qkv(total, n, nkv, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(total, n, d, generator=g), torch.randn(total, nkv, d, generator=g),
            torch.randn(total, nkv, d, generator=g))


@pytest.mark.parametrize("lengths, rows", [([5, 11, 16], 32), ([5, 11, 7], 32)],
                         ids=["lengths-sum-to-rows", "rows-rounded-up-to-16"])
def test_flash_attention_nz_causal_mask_on_310p(soc_310p, lengths, rows):
    """vllm-ascend's 310P prefill: the causal 0/-inf mask of the model length, NZ-laid out as
    vllm_ascend.utils.nd_to_nz_2d makes it, cast to FRACTAL_NZ; causal within each segment."""
    n, nkv, d, scale = 4, 2, 32, 0.3
    q, k, v = _qkv(rows, n, nkv, d)
    mask = torch_npu.npu_format_cast(nz_by_definition(causal_additive(64)), NZ)
    out = torch.full((rows, n, d), 7.0)
    torch_npu._npu_flash_attention(query=q, key=k, value=v, mask=mask, seq_len=torch.tensor(lengths, dtype=torch.int32),
                                   scale_value=scale, num_heads=n, num_kv_heads=nkv, out=out)
    total = sum(lengths)
    want = attention_f64(q[:total], k[:total], v[:total], dense_segments(lengths), scale=scale, causal=True)
    close(out[:total], want)
    assert torch.equal(out[total:], torch.full_like(out[total:], 7.0))  # padding rows are not written


def test_flash_attention_nd_masks_on_a2():
    """ND masks: one [S, S] for every segment, and one per segment ([batch, S, S]), read top-left."""
    n, nkv, d, scale = 4, 4, 64, 0.125
    lengths = [6, 9]
    q, k, v = _qkv(sum(lengths), n, nkv, d, seed=1)
    g = torch.Generator().manual_seed(2)
    per = torch.zeros(2, 20, 20)
    per.masked_fill_(torch.rand(2, 20, 20, generator=g) < 0.3, float("-inf"))
    per[:, torch.arange(20), torch.arange(20)] = 0    # every row keeps its diagonal
    for mask, allowed in ((causal_additive(20, torch.float32), None),
                          (per, lambda seg, sq, skv: per[seg, :sq, :skv] == 0)):
        out = torch.empty(sum(lengths), n, d)
        torch_npu._npu_flash_attention(q, k, v, mask, torch.tensor(lengths), scale, n, nkv, out)
        want = attention_f64(q, k, v, dense_segments(lengths), scale=scale, causal=allowed is None, allowed=allowed)
        close(out, want)


@pytest.mark.parametrize("mask, on_310p, exc, words", [
    (torch.full((32, 32), -100.0), False, NotImplementedError, "other than 0 and -inf"),
    (torch.zeros(2, 1, 32), False, NotImplementedError, "vector mask"),
    (torch.zeros(8, 8), False, ValueError, "smaller than the longest segment"),
    ("nz", False, NotImplementedError, "FRACTAL_NZ mask on"),
], ids=["finite-additive", "vector", "too-small", "nz-on-a2"])
def test_flash_attention_refusals(monkeypatch, mask, on_310p, exc, words):
    if on_310p:
        monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", SOC_310P)
    if isinstance(mask, str):
        mask = torch_npu.npu_format_cast(nz_by_definition(causal_additive(32, torch.float32)), NZ)
    q, k, v = _qkv(16, 2, 2, 16)
    with pytest.raises(exc, match=words):
        torch_npu._npu_flash_attention(q, k, v, mask, torch.tensor([6, 10]), 0.25, 2, 2, torch.empty(16, 2, 16))


def test_flash_attention_310p_rows_past_the_rounding_are_refused(soc_310p):
    q, k, v = _qkv(48, 2, 2, 16)
    mask = torch_npu.npu_format_cast(nz_by_definition(causal_additive(64)), NZ)
    with pytest.raises(ValueError, match="rounded up"):
        torch_npu._npu_flash_attention(q, k, v, mask, torch.tensor([6, 10]), 0.25, 2, 2, torch.empty(48, 2, 16))


def _nz_caches(num_blocks, nkv, d, block_size, seed=3):
    g = torch.Generator().manual_seed(seed)
    caches = []
    for _ in range(2):
        cache = torch_npu.empty_with_format((num_blocks, nkv * d // 16, block_size, 16), dtype=torch.float32,
                                            acl_format=NZ)
        cache.copy_(torch.randn(cache.shape, generator=g))   # garbage where nothing is written
        caches.append(cache)
    return caches


def test_reshape_and_cache_writes_the_310p_nz_layout(soc_310p):
    nkv, d, block_size, num_blocks = 2, 32, 16, 5
    key_cache, value_cache = _nz_caches(num_blocks, nkv, d, block_size)
    g = torch.Generator().manual_seed(4)
    key, value = torch.randn(6, nkv, d, generator=g), torch.randn(6, nkv, d, generator=g)
    slots = torch.tensor([17, 3, -1, 79, 40, 16], dtype=torch.int32)
    before = key_cache.clone()
    torch_npu._npu_reshape_and_cache(key, value, key_cache, value_cache, slots)
    written = set()
    for t, slot in enumerate(slots.tolist()):
        if slot < 0:
            continue
        block, offset = divmod(slot, block_size)
        for h in range(nkv):
            for j in range(d):
                col = h * d + j
                assert key_cache[block, col // 16, offset, col % 16] == key[t, h, j]
                assert value_cache[block, col // 16, offset, col % 16] == value[t, h, j]
        written.add((block, offset))
    untouched = [(b, o) for b in range(num_blocks) for o in range(block_size) if (b, o) not in written]
    for b, o in untouched:
        assert torch.equal(key_cache[b, :, o], before[b, :, o])


@pytest.mark.parametrize("block_size", [16, 128])
def test_paged_attention_reads_the_310p_nz_cache(soc_310p, block_size):
    """Decode over NZ caches written by the emulated reshape_and_cache through a shuffled block table."""
    n, nkv, d, scale = 4, 2, 64 if block_size == 128 else 32, 0.2
    kv_lens = [5, block_size + 3, 2 * block_size]
    need = [-(-x // block_size) for x in kv_lens]
    num_blocks = sum(need) + 2
    key_cache, value_cache = _nz_caches(num_blocks, nkv, d, block_size)
    g = torch.Generator().manual_seed(5)
    order = torch.randperm(num_blocks, generator=g)
    block_table = torch.zeros(len(kv_lens), max(need), dtype=torch.int32)
    ks, vs, used = [], [], 0
    for i, length in enumerate(kv_lens):
        ids = order[used:used + need[i]]
        used += need[i]
        block_table[i, :need[i]] = ids.to(torch.int32)
        k, v = torch.randn(length, nkv, d, generator=g), torch.randn(length, nkv, d, generator=g)
        pos = torch.arange(length)
        slots = (ids[pos // block_size] * block_size + pos % block_size).to(torch.int32)
        torch_npu._npu_reshape_and_cache(k, v, key_cache, value_cache, slots)
        ks.append(k)
        vs.append(v)
    query = torch.randn(len(kv_lens), n, d, generator=g)
    out = torch.empty_like(query)
    torch_npu._npu_paged_attention(query=query, key_cache=key_cache, value_cache=value_cache, num_kv_heads=nkv,
                                   num_heads=n, scale_value=scale, block_table=block_table,
                                   context_lens=torch.tensor(kv_lens, dtype=torch.int32), out=out)
    want = torch.cat([attention_f64(query[i:i + 1], ks[i], vs[i], [0, 1], [0, kv_lens[i]], scale=scale)
                      for i in range(len(kv_lens))])
    close(out, want)


def test_nz_cache_refused_on_a2():
    key_cache, value_cache = _nz_caches(2, 2, 16, 16)
    with pytest.raises(NotImplementedError, match="FRACTAL_NZ key_cache on"):
        torch_npu._npu_reshape_and_cache(torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), key_cache, value_cache,
                                         torch.tensor([0], dtype=torch.int32))
    with pytest.raises(NotImplementedError, match="FRACTAL_NZ key_cache on"):
        torch_npu._npu_paged_attention(torch.zeros(1, 2, 16), key_cache, value_cache, 2, 2, 1.0,
                                       torch.zeros(1, 1, dtype=torch.int32), torch.tensor([1], dtype=torch.int32),
                                       torch.zeros(1, 2, 16))
