"""paged_prefill_attention: sglang's context-parallel FIA call, through the
emulated op, against the float64 reference."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from npu_shim import emulation
from npu_shim.kernels import compressed_causal_mask, paged_prefill_attention
from npu_shim.testing import attention_f64, count_host_syncs, dense_segments, record_npu_calls

emulation.install()
import torch_npu  # noqa: E402,F401

# The emulation's (and the kernels') arithmetic against float64: float32 inputs, which the
# real ops reject, on purpose (see tests/conftest.py float32_math); the dtype rules are
# tests/test_emulation_dtypes.py's.
pytestmark = pytest.mark.float32_math

# max |out - float64|, atol only (rtol 0); measured worst (base lane, CPU torch 2.13):
# float32 9.8e-7, float16 9.5e-4, bfloat16 7.6e-3
TOL = {torch.float32: 9e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def recorded(comparison, got, want, dtype):
    """The max |got - want| of a check, recorded for the tolerance table (npu_shim.testing.errors)."""
    from npu_shim.testing.errors import within

    diff = (got.double() - want).abs()
    within(comparison, diff.max().item() if diff.numel() else 0.0, TOL[dtype], dtype)


def paged_case(q_lens, kv_lens, n, nkv, dqk, dv, block_size, dtype=torch.float32, seed=0):
    """Queries are the last q_len tokens of each sequence; K/V scattered into shuffled
    blocks of sglang-shaped caches (num_blocks * block_size, Nkv, D)."""
    g = torch.Generator().manual_seed(seed)
    ks = [torch.randn(n_kv, nkv, dqk, generator=g).to(dtype) for n_kv in kv_lens]
    vs = [torch.randn(n_kv, nkv, dv, generator=g).to(dtype) for n_kv in kv_lens]
    need = [-(-x // block_size) for x in kv_lens]
    num_blocks = sum(need) + 2
    order = torch.randperm(num_blocks, generator=g).tolist()
    k_cache = torch.randn(num_blocks * block_size, nkv, dqk, generator=g).to(dtype)
    v_cache = torch.randn(num_blocks * block_size, nkv, dv, generator=g).to(dtype)
    table = torch.zeros(len(kv_lens), max(need, default=0) + 1, dtype=torch.int32)
    used = 0
    for i, length in enumerate(kv_lens):
        for j in range(need[i]):
            blk = order[used]
            used += 1
            table[i, j] = blk
            rows = slice(j * block_size, min(length, (j + 1) * block_size))
            k_cache[blk * block_size: blk * block_size + rows.stop - rows.start] = ks[i][rows]
            v_cache[blk * block_size: blk * block_size + rows.stop - rows.start] = vs[i][rows]
    q = torch.randn(sum(q_lens), n, dqk, generator=g).to(dtype)
    return q, k_cache, v_cache, table, torch.cat(ks), torch.cat(vs)


def run_and_check(q_lens, kv_lens, n, nkv, dqk, dv, block_size, dtype=torch.float32, seed=0):
    q, k_cache, v_cache, table, k, v = paged_case(q_lens, kv_lens, n, nkv, dqk, dv, block_size,
                                                  dtype, seed)
    out = paged_prefill_attention(q, k_cache, v_cache, block_table=table, block_size=block_size,
                                  num_heads=n, num_kv_heads=nkv, scale=dqk ** -0.5,
                                  q_seq_lens=q_lens, kv_seq_lens=kv_lens)
    assert out.shape == (sum(q_lens), n, dv)
    want = attention_f64(q, k, v, dense_segments(q_lens), dense_segments(kv_lens),
                         scale=dqk ** -0.5, causal=True)
    recorded("kernel paged_prefill_attention vs float64", out, want, dtype)
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=0)


@pytest.mark.parametrize("block_size", [16, 128])
@pytest.mark.parametrize("case", [
    ([7, 1, 300, 0], [40, 1, 300, 17]),   # chunked prefill, decode, full prefill, idle
    ([1, 1, 1], [5, 129, 260]),           # decode only
    ([64], [64]),                         # one full prefill
])
def test_paged_prefill_matches_reference(block_size, case):
    q_lens, kv_lens = case
    run_and_check(q_lens, kv_lens, 8, 2, 64, 64, block_size, seed=block_size)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_value_head_dim_differs_gqa_and_dtypes(dtype):
    run_and_check([5, 20], [33, 20], 16, 2, 192, 128, 16, dtype, seed=3)


@settings(max_examples=15, deadline=None)
@given(seqs=st.lists(st.tuples(st.integers(0, 40), st.integers(0, 200)), min_size=1, max_size=5),
       group=st.sampled_from([1, 2, 4, 8]), block_size=st.sampled_from([16, 128]),
       seed=st.integers(0, 999))
def test_paged_prefill_property(seqs, group, block_size, seed):
    q_lens = [min(a, a + b) for a, b in seqs]
    kv_lens = [a + b for a, b in seqs]
    if sum(kv_lens) == 0:
        kv_lens[0] = 1
    run_and_check(q_lens, kv_lens, 2 * group, 2, 64, 64, block_size, seed=seed)   # a TND head dim


def test_the_call_is_sglangs():
    q_lens, kv_lens = [3, 5], [10, 5]
    q, k_cache, v_cache, table, _, _ = paged_case(q_lens, kv_lens, 4, 2, 192, 128, 16)
    with record_npu_calls() as calls, count_host_syncs(device_tensors=[q, table]) as syncs:
        paged_prefill_attention(q, k_cache, v_cache, block_table=table, block_size=16, num_heads=4,
                                num_kv_heads=2, scale=0.1, q_seq_lens=q_lens, kv_seq_lens=kv_lens)
    assert syncs.count == 0
    (call,) = calls
    assert (call.name, call.spelling) == ("npu_fused_infer_attention_score", "torch.ops.npu")
    kw = call.kwargs
    assert kw["input_layout"] == "TND" and kw["sparse_mode"] == 3 and kw["next_tokens"] == 0
    assert kw["actual_seq_lengths"] == [3, 8] and kw["actual_seq_lengths_kv"] == [10, 5]
    assert kw["block_size"] == 16 and kw["num_heads"] == 4 and kw["num_key_value_heads"] == 2
    assert kw["atten_mask"] is compressed_causal_mask("cpu") and kw["atten_mask"].shape == (2048, 2048)
    assert call.args[1].shape == (k_cache.shape[0] // 16, 16, 2 * 192)
    assert call.args[2].shape == (v_cache.shape[0] // 16, 16, 2 * 128)


@pytest.mark.parametrize("kwargs, word", [
    (dict(q_seq_lens=[6, 1], kv_seq_lens=[5, 5]), "q_len <= kv_len"),
    (dict(q_seq_lens=[2, 1], kv_seq_lens=[5, 5]), "sum"),
    (dict(q_seq_lens=torch.tensor([3, 5], device="meta"), kv_seq_lens=[10, 5]), "host sync"),
    (dict(q_seq_lens=[3, 5], kv_seq_lens=[10]), "sequences"),
])
def test_errors(kwargs, word):
    q, k_cache, v_cache, table, _, _ = paged_case([3, 5], [10, 5], 4, 2, 64, 64, 16)
    with pytest.raises(ValueError, match=word):
        paged_prefill_attention(q, k_cache, v_cache, block_table=table, block_size=16, num_heads=4,
                                num_kv_heads=2, scale=0.1, **kwargs)
