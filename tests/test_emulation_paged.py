"""Paged ops: npu_fused_infer_attention_score, npu_incre_flash_attention and
_npu_reshape_and_cache, with shuffled block tables, against the float64 reference."""
import pytest
import torch

from npu_shim import emulation
from npu_shim.testing import attention_f64, dense_segments

emulation.install()
import torch_npu  # noqa: E402

# The emulation's (and the kernels') arithmetic against float64: float32 inputs, which the
# real ops reject, on purpose (see tests/conftest.py float32_math); the dtype rules are
# tests/test_emulation_dtypes.py's.
pytestmark = pytest.mark.float32_math

# max |out - float64|, atol only (rtol 0); measured worst (base lane, CPU torch 2.13):
# float32 7.8e-6 (Dqk 192 / Dv 128 at scale 0.2: logits of about 3 sigma), bfloat16 7.8e-3
# (no float16 case here)
TOL = {torch.float32: 1.6e-5, torch.bfloat16: 1.6e-2}


def recorded(comparison, got, want, dtype):
    """The max |got - want| of a check, recorded for the tolerance table (npu_shim.testing.errors)."""
    from npu_shim.testing.errors import within

    diff = (got.double() - want).abs()
    within(comparison, diff.max().item() if diff.numel() else 0.0, TOL[dtype], dtype)
MASK2048 = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def close(got, want, dtype=torch.float32):
    recorded("emulation FIA/IFA paged vs float64", got, want, dtype)
    torch.testing.assert_close(got.double(), want, atol=TOL[dtype], rtol=0)


class PagedKV:
    """Per-sequence K/V written into paged caches through a shuffled block table."""

    def __init__(self, kv_lens, nkv, d, dv, block_size, dtype=torch.float32, seed=0):
        g = torch.Generator().manual_seed(seed)
        self.kv_lens = kv_lens
        self.block_size = block_size
        self.k = [torch.randn(n, nkv, d, generator=g).to(dtype) for n in kv_lens]
        self.v = [torch.randn(n, nkv, dv, generator=g).to(dtype) for n in kv_lens]
        need = [-(-n // block_size) for n in kv_lens]
        total = sum(need) + 3  # a few unused blocks
        order = torch.randperm(total, generator=g)
        self.block_table = torch.zeros(len(kv_lens), max(need) + 1, dtype=torch.int32)
        self.k_cache = torch.randn(total, block_size, nkv, d, generator=g).to(dtype)  # garbage
        self.v_cache = torch.randn(total, block_size, nkv, dv, generator=g).to(dtype)
        used = 0
        for i, n in enumerate(kv_lens):
            ids = order[used:used + need[i]]
            used += need[i]
            self.block_table[i, :need[i]] = ids.to(torch.int32)
            for j, blk in enumerate(ids.tolist()):
                rows = slice(j * block_size, min(n, (j + 1) * block_size))
                width = rows.stop - rows.start
                self.k_cache[blk, :width] = self.k[i][rows]
                self.v_cache[blk, :width] = self.v[i][rows]

    def packed(self):
        return torch.cat(self.k), torch.cat(self.v), dense_segments(self.kv_lens)

    def bsh(self):
        return self.k_cache.flatten(2), self.v_cache.flatten(2)

    def bnsd(self):
        return self.k_cache.permute(0, 2, 1, 3).contiguous(), self.v_cache.permute(0, 2, 1, 3).contiguous()


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fia_tnd_paged_chunked_prefill_dv_differs(block_size, dtype):
    kv_lens = [40, 1, 300, 17]
    q_lens = [7, 1, 300, 0]   # chunked prefill, decode-like, full prefill, nothing new
    paged = PagedKV(kv_lens, 2, 192, 128, block_size, dtype, seed=block_size)   # TND's Dqk 192 / Dv 128
    cq = dense_segments(q_lens)
    q = torch.randn(cq[-1], 8, 192).to(dtype)
    k_cache, v_cache = paged.bsh()
    out, lse = torch.ops.npu.npu_fused_infer_attention_score(
        q, k_cache, v_cache, block_table=paged.block_table, block_size=block_size, num_heads=8,
        num_key_value_heads=2, input_layout="TND", atten_mask=MASK2048, sparse_mode=3,
        next_tokens=0, scale=0.2, actual_seq_lengths=cq[1:], actual_seq_lengths_kv=kv_lens,
        softmax_lse_flag=True)
    k, v, ckv = paged.packed()
    want, want_lse = attention_f64(q, k, v, cq, ckv, scale=0.2, causal=True, return_lse=True)
    assert out.shape == (cq[-1], 8, 128) and lse.shape == (cq[-1], 8, 1)
    close(out, want, dtype)
    from npu_shim.testing.errors import within
    # measured worst 6.8e-6 (float32), 3.1e-6 (bfloat16: the statistics are float32 either way), Dqk 192
    within("emulation FIA log-sum-exp vs float64", (lse[..., 0].double() - want_lse).abs().max(), 1.4e-5, dtype)
    torch.testing.assert_close(lse[..., 0].double(), want_lse, atol=1.4e-5, rtol=0)


def test_fia_tnd_paged_bnsd_cache_layout_and_no_lse():
    paged = PagedKV([20, 33], 2, 64, 64, 16, seed=3)
    q = torch.randn(9, 4, 64)
    k_cache, v_cache = paged.bnsd()
    out, lse = torch_npu.npu_fused_infer_attention_score(
        q, k_cache, v_cache, block_table=paged.block_table, block_size=16, num_heads=4,
        num_key_value_heads=2, input_layout="TND", atten_mask=MASK2048, sparse_mode=3,
        scale=0.25, actual_seq_lengths=[4, 9], actual_seq_lengths_kv=[20, 33])
    k, v, ckv = paged.packed()
    close(out, attention_f64(q, k, v, [0, 4, 9], ckv, scale=0.25, causal=True))
    assert lse.shape == (1,) and lse.item() == 0


def test_fia_tnd_contiguous_kv_is_cumulative_and_sparse0_is_full():
    cq, ckv = dense_segments([3, 5]), dense_segments([6, 5])
    q, k, v = torch.randn(8, 2, 64), torch.randn(11, 2, 64), torch.randn(11, 2, 64)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k, v, num_heads=2, input_layout="TND", scale=0.3, actual_seq_lengths=cq[1:],
        actual_seq_lengths_kv=ckv[1:])
    close(out, attention_f64(q, k, v, cq, ckv, scale=0.3))


@pytest.mark.parametrize("cann, dqk, dv, takes", [
    ("8.5.0", 64, 64, True), ("8.5.0", 128, 128, True), ("8.5.0", 192, 192, True), ("8.5.0", 192, 128, True),
    ("8.5.0", 72, 72, False), ("8.5.0", 80, 80, False), ("8.5.0", 32, 32, False), ("8.5.0", 256, 256, False),
    ("8.5.0", 128, 64, False), ("9.0.0", 72, 72, False), ("8.3.RC1", 64, 64, True),
    ("8.2.RC1", 192, 128, True), ("8.2.RC1", 192, 192, True), ("8.2.RC1", 128, 128, False),
    ("8.2.RC1", 64, 64, False),
])
def test_fia_tnd_head_dims_follow_the_emulated_cann(monkeypatch, cann, dqk, dv, takes):
    """TND head dims by CANN release: from 8.3 D in {64, 128, 192} (or 192 / 128), CANN's words
    quoted in vllm-ascend PR #9632 and FlagOS sglang-plugin-FL for CANN 8.5 (a head-72 tower
    fails); before 8.3 Dqk = 192 only (vllm-ascend issue #8045). Batched layouts are not bound."""
    monkeypatch.setenv("NPU_SHIM_EMULATE_CANN", cann)
    q, k, v = torch.randn(5, 2, dqk), torch.randn(5, 2, dqk), torch.randn(5, 2, dv)
    call = lambda: torch_npu.npu_fused_infer_attention_score(   # noqa: E731
        q, k, v, num_heads=2, input_layout="TND", scale=0.3, actual_seq_lengths=[2, 5],
        actual_seq_lengths_kv=[2, 5])[0]
    if takes:
        assert call().shape == (5, 2, dv)
    else:
        with pytest.raises(ValueError, match=r"emulated CANN %s\): When layout is TND, queryD\(%d\)"
                           % (cann.replace(".", r"\."), dqk)):
            call()
    if dqk == dv:    # BSND is not bound by the TND rule
        qb = q[:4].reshape(1, 4, 2, dqk)
        torch_npu.npu_fused_infer_attention_score(qb, qb, qb, num_heads=2, input_layout="BSND", scale=0.3)


def test_emulated_cann_version_is_reported_and_checked(monkeypatch):
    from torch_npu.npu.utils import get_cann_version
    monkeypatch.delenv("NPU_SHIM_EMULATE_CANN", raising=False)
    assert get_cann_version() == "8.5.0" and get_cann_version("DRIVER") == ""
    monkeypatch.setenv("NPU_SHIM_EMULATE_CANN", "9.0.0")
    assert get_cann_version(module="CANN") == "9.0.0"
    monkeypatch.setenv("NPU_SHIM_EMULATE_CANN", "8.5")
    with pytest.raises(ValueError, match="NPU_SHIM_EMULATE_CANN='8.5' is not a CANN version"):
        get_cann_version()


@pytest.mark.parametrize("lengths", [[3, 5], [64, 164], [5, 8, 8]],
                         ids=["per-segment", "short-of-the-tokens", "an-empty-last-segment-short"])
def test_fia_tnd_lengths_must_end_at_the_query_tokens(lengths):
    """The real op refuses TND ``actual_seq_lengths`` whose last element is not the query's token
    count ("queryT(...) must be equal to the last element of actualSequenceLengthQ"): sglang 0.5.16
    hands it per-image lengths (increasing for two images of 3 and 5 tokens), fixed in 0.5.17 (PR
    #31867) by the cumulative ones."""
    t = {3: 8, 64: 200, 5: 9}[lengths[0]]
    q = torch.randn(t, 2, 64)
    with pytest.raises(ValueError, match=r"queryT\(%d\) must be equal to the last element" % t):
        torch_npu.npu_fused_infer_attention_score(q, q, q, num_heads=2, input_layout="TND", scale=0.3,
                                                  actual_seq_lengths=lengths, actual_seq_lengths_kv=lengths)
    ends = dense_segments([3, 5])[1:]            # the cumulative lengths of the same images run
    q = torch.randn(8, 2, 64)
    torch_npu.npu_fused_infer_attention_score(q, q, q, num_heads=2, input_layout="TND", scale=0.3,
                                              actual_seq_lengths=ends, actual_seq_lengths_kv=ends)


@pytest.mark.parametrize("layout", ["BSH", "BNSD", "BSND"])
def test_fia_batched_layouts_causal(layout):
    g = torch.Generator().manual_seed(7)
    b, sq, skv, n, d = 2, 5, 9, 4, 16
    q = torch.randn(b, sq, n, d, generator=g)
    k = torch.randn(b, skv, n, d, generator=g)
    v = torch.randn(b, skv, n, d, generator=g)
    conv = {"BSH": lambda x: x.flatten(2), "BSND": lambda x: x,
            "BNSD": lambda x: x.transpose(1, 2).contiguous()}[layout]
    out, _ = torch_npu.npu_fused_infer_attention_score(
        conv(q), conv(k), conv(v), num_heads=n, input_layout=layout, scale=0.25,
        atten_mask=MASK2048, sparse_mode=3)
    back = {"BSH": lambda x: x.unflatten(-1, (n, d)), "BSND": lambda x: x,
            "BNSD": lambda x: x.transpose(1, 2)}[layout]
    want = attention_f64(q.reshape(b * sq, n, d), k.reshape(b * skv, n, d), v.reshape(b * skv, n, d),
                         dense_segments([sq] * b), dense_segments([skv] * b), scale=0.25, causal=True)
    close(back(out).reshape(b * sq, n, d), want)


def test_fia_bsh_paged_decode_takes_the_incremental_branch():
    """Q_S == 1: sparse_mode is documented to have no effect (full attention over the KV)."""
    paged = PagedKV([37, 5, 129], 2, 16, 16, 16, seed=11)
    q = torch.randn(3, 1, 8 * 16)
    k_cache, v_cache = paged.bsh()
    out, _ = torch_npu.npu_fused_infer_attention_score(
        q, k_cache, v_cache, block_table=paged.block_table, block_size=16, num_heads=8,
        num_key_value_heads=2, input_layout="BSH", scale=0.25, sparse_mode=2,
        actual_seq_lengths=[1, 1, 1], actual_seq_lengths_kv=paged.kv_lens)
    k, v, ckv = paged.packed()
    want = attention_f64(q.reshape(3, 8, 16), k, v, [0, 1, 2, 3], ckv, scale=0.25)
    close(out.reshape(3, 8, 16), want)


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(input_layout="TND", sparse_mode=0, atten_mask=MASK2048), ValueError, "TND"),
    (dict(input_layout="TND", sparse_mode=2, atten_mask=MASK2048), ValueError, "TND"),
    (dict(query_rope=torch.zeros(1)), NotImplementedError, "query_rope"),
    (dict(antiquant_mode=1), NotImplementedError, "antiquant_mode"),
    (dict(input_layout="BSND", sparse_mode=3), ValueError, "2048"),
])
def test_fia_refusals(kwargs, exc, word):
    q = torch.randn(4, 2, 16) if kwargs.get("input_layout") == "TND" else torch.randn(1, 4, 2, 16)
    kwargs.setdefault("input_layout", "BSND")
    with pytest.raises(exc, match=word):
        torch_npu.npu_fused_infer_attention_score(q, q, q, num_heads=2, actual_seq_lengths=[4],
                                                  actual_seq_lengths_kv=[4], **kwargs)


# ------------------------------------------------------------------------ IFA

@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("layout", ["BSH", "BNSD"])
def test_incre_flash_attention_paged_decode(block_size, layout):
    kv_lens = [1, 200, 64]
    paged = PagedKV(kv_lens, 2, 32, 32, block_size, seed=block_size + 1)
    q = torch.randn(3, 8, 32)
    if layout == "BSH":
        query, (k_cache, v_cache) = q.reshape(3, 1, 8 * 32), paged.bsh()
    else:
        query, (k_cache, v_cache) = q.reshape(3, 8, 1, 32), paged.bnsd()
    out = torch_npu.npu_incre_flash_attention(
        query, k_cache, v_cache, num_heads=8, num_key_value_heads=2, scale_value=0.2,
        block_table=paged.block_table, actual_seq_lengths=kv_lens, block_size=block_size,
        input_layout=layout)
    assert out.shape == query.shape
    k, v, ckv = paged.packed()
    close(out.reshape(3, 8, 32), attention_f64(q, k, v, [0, 1, 2, 3], ckv, scale=0.2))


def test_incre_flash_attention_mask_and_contiguous_kv():
    q = torch.randn(2, 1, 2 * 16)
    k = torch.randn(2, 10, 2 * 16)
    v = torch.randn(2, 10, 2 * 16)
    mask = torch.zeros(2, 1, 1, 10, dtype=torch.bool)
    mask[1, ..., 3:] = True
    out = torch_npu.npu_incre_flash_attention(q, k, v, atten_mask=mask, num_heads=2,
                                              scale_value=0.25, actual_seq_lengths=[8, 10])
    want0 = attention_f64(q[0].reshape(1, 2, 16), k[0, :8].reshape(8, 2, 16),
                          v[0, :8].reshape(8, 2, 16), [0, 1], [0, 8], scale=0.25)
    want1 = attention_f64(q[1].reshape(1, 2, 16), k[1, :3].reshape(3, 2, 16),
                          v[1, :3].reshape(3, 2, 16), [0, 1], [0, 3], scale=0.25)
    close(out.reshape(2, 2, 16), torch.cat([want0, want1]))


def test_incre_flash_attention_refuses_undocumented_cache_layout():
    cache = torch.randn(4, 16, 2, 32)  # (blocks, block_size, Nkv, D): not a documented layout
    with pytest.raises(ValueError, match="documented"):
        torch_npu.npu_incre_flash_attention(
            torch.randn(1, 2, 1, 32), cache, cache, num_heads=2, input_layout="BNSD",
            block_table=torch.zeros(1, 1, dtype=torch.int32), actual_seq_lengths=[5], block_size=16)


# ------------------------------------------------------------- reshape and cache

def test_reshape_and_cache_then_decode_reads_it_back():
    nb, bs, nkv, d = 6, 16, 2, 32
    key_cache = torch.zeros(nb, bs, nkv, d)
    value_cache = torch.zeros(nb, bs, nkv, d)
    kv_len = 40
    blocks = [4, 0, 5]
    slots = torch.tensor([blocks[i // bs] * bs + i % bs for i in range(kv_len)] + [-1], dtype=torch.int32)
    k = torch.randn(kv_len + 1, nkv, d)
    v = torch.randn(kv_len + 1, nkv, d)
    torch_npu._npu_reshape_and_cache(key=k, value=v, key_cache=key_cache,
                                     value_cache=value_cache, slot_indices=slots)
    flat = key_cache.view(-1, nkv, d)
    assert torch.equal(flat[slots[:kv_len].long()], k[:kv_len])
    assert torch.count_nonzero(key_cache) == k[:kv_len].count_nonzero()  # the -1 slot is skipped
    q = torch.randn(1, 4, 1, d)
    out = torch_npu.npu_incre_flash_attention(
        q, key_cache.flatten(2), value_cache.flatten(2), num_heads=4, num_key_value_heads=2,
        scale_value=0.2, input_layout="BNSD", block_table=torch.tensor([blocks], dtype=torch.int32),
        actual_seq_lengths=[kv_len], block_size=bs)
    close(out.reshape(1, 4, d), attention_f64(q.reshape(1, 4, d), k[:kv_len], v[:kv_len], [0, 1],
                                              [0, kv_len], scale=0.2))


def test_both_spellings_agree_for_every_op():
    q = torch.randn(6, 2, 16)
    a = torch_npu.npu_fusion_attention(q, q, q, 2, "TND", actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6])
    b = torch.ops.npu.npu_fusion_attention(q, q, q, 2, "TND", actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6])
    assert torch.equal(a[0], b[0])
    x = torch.randn(1, 2, 5, 16)
    assert torch.equal(torch_npu.npu_prompt_flash_attention(x, x, x, num_heads=2, input_layout="BNSD"),
                       torch.ops.npu.npu_prompt_flash_attention(x, x, x, num_heads=2, input_layout="BNSD"))
    y = torch.randn(1, 2, 1, 16)
    assert torch.equal(torch_npu.npu_incre_flash_attention(y, x, x, num_heads=2, input_layout="BNSD"),
                       torch.ops.npu.npu_incre_flash_attention(y, x, x, num_heads=2, input_layout="BNSD"))
    o1, o2 = torch.empty_like(q), torch.empty_like(q)
    torch_npu._npu_flash_attention_unpad(q, q, q, torch.tensor([6]), 0.5, 2, 2, o1)
    torch.ops.npu._npu_flash_attention_unpad(q, q, q, torch.tensor([6]), 0.5, 2, 2, o2)
    assert torch.equal(o1, o2)
    c1, c2 = torch.zeros(2, 4, 2, 16), torch.zeros(2, 4, 2, 16)
    slots = torch.tensor([5, 1, 0, 7, 2, 3])
    torch_npu._npu_reshape_and_cache(q, q, c1, c1.clone(), slots)
    torch.ops.npu._npu_reshape_and_cache(q, q, c2, c2.clone(), slots)
    assert torch.equal(c1, c2)
