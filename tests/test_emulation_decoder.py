"""The decoder ops of npu_shim/emulation/decoder_attention.py and kv_cache.py's
npu_scatter_pa_kv_cache against the float64 reference (sinks, sliding window, causal, GQA),
in the dtypes the hardware takes, and their refusals."""
import pytest
import torch

from npu_shim import emulation
from npu_shim.testing import attention_f64, dense_segments
from npu_shim.testing.errors import Tolerance
from npu_shim.testing.paged_kv import paged_kv

emulation.install()
import torch_npu  # noqa: E402

MASK2048 = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
# max |out - float64| (|ref| <= ~3), measured worst on the base lane: bfloat16 7.5e-3, float16 4.1e-4
TOL = {torch.bfloat16: Tolerance("decoder ops vs float64", 3e-2, "bfloat16"),
       torch.float16: Tolerance("decoder ops vs float64", 4e-3, "float16")}
# float32 inside float32_not_on_hardware() (|ref| <= ~3): measured 4.8e-7 (K 192 / V 128, sinks, window)
FLOAT32_TOL = Tolerance("decoder ops vs float64, float32 math check", 1e-5, "float32")


def close(got, want, dtype):
    err = (got.double() - want).abs().max().item()
    assert err < TOL[dtype], err


def window(pre):
    """Reference visibility of a band of ``pre`` keys before the (end-aligned) diagonal."""
    def allowed(seg, sq, skv):
        rows = torch.arange(sq).unsqueeze(1) + (skv - sq)
        cols = torch.arange(skv).unsqueeze(0)
        return cols >= rows - pre
    return allowed


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_paged_attention_decode_gqa(dtype):
    kv_lens = [5, 40, 17]
    k, v, kc, vc, table = paged_kv(kv_lens, 2, 32, 32, 16, dtype, seed=1)
    q = torch.randn(3, 8, 32).to(dtype)
    out = torch.empty_like(q)
    torch_npu._npu_paged_attention(query=q, key_cache=kc, value_cache=vc, num_kv_heads=2,
                                   num_heads=8, scale_value=0.2, block_table=table,
                                   context_lens=torch.tensor(kv_lens, dtype=torch.int32), out=out)
    want = attention_f64(q, torch.cat(k), torch.cat(v), dense_segments([1, 1, 1]),
                         dense_segments(kv_lens), scale=0.2)
    close(out, want, dtype)


def test_paged_attention_refusals():
    k, v, kc, vc, table = paged_kv([5], 2, 32, 32, 16, torch.bfloat16)
    q, out = torch.randn(1, 4, 32).bfloat16(), torch.empty(1, 4, 32).bfloat16()
    args = dict(query=q, key_cache=kc, value_cache=vc, num_kv_heads=2, num_heads=4,
                scale_value=1.0, block_table=table, context_lens=torch.tensor([5]), out=out)
    with pytest.raises(NotImplementedError, match="value head dim"):
        torch_npu._npu_paged_attention(**{**args, "value_cache": vc[..., :16].contiguous(),
                                          "out": torch.empty(1, 4, 16).bfloat16()})
    with pytest.raises(ValueError, match="multiple of 16"):
        torch_npu._npu_paged_attention(**{**args, "key_cache": kc[:, :8].contiguous(),
                                          "value_cache": vc[:, :8].contiguous()})
    with pytest.raises(ValueError, match="int32"):
        torch_npu._npu_paged_attention(**{**args, "block_table": table.long()})
    with pytest.raises(ValueError, match="dtype float32"):
        torch_npu._npu_paged_attention(**{**args, "query": q.float(), "key_cache": kc.float(),
                                          "value_cache": vc.float(), "out": out.float()})


def test_scatter_pa_kv_cache_norm_k_and_v_dims_differ():
    key, value = torch.randn(4, 2, 24).bfloat16(), torch.randn(4, 2, 16).bfloat16()
    kc, vc = torch.zeros(3, 16, 2, 24).bfloat16(), torch.zeros(3, 16, 2, 16).bfloat16()
    slots = torch.tensor([17, -1, 0, 47], dtype=torch.int32)
    torch_npu.npu_scatter_pa_kv_cache(key=key, value=value, key_cache=kc, value_cache=vc,
                                      slot_mapping=slots, cache_mode="Norm")
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(kc[slot // 16, slot % 16], key[t])
            assert torch.equal(vc[slot // 16, slot % 16], value[t])
    assert int((kc != 0).flatten(2).any(-1).sum()) == 3          # the -1 slot wrote nothing
    with pytest.raises(NotImplementedError, match="PA_NZ"):
        torch_npu.npu_scatter_pa_kv_cache(key, value, kc, vc, slots, cache_mode="PA_NZ")


def test_scatter_pa_kv_cache_into_strided_views_of_one_buffer():
    # vLLM's and vllm-ascend's runners may hand key and value caches that are strided views of one
    # (num_blocks, 2, block_size, N, D) buffer (block stride 2 * block_size * N * D)
    key, value = torch.randn(5, 2, 8).bfloat16(), torch.randn(5, 2, 8).bfloat16()
    buf = torch.zeros(3, 2, 4, 2, 8).bfloat16()
    kc, vc = buf[:, 0], buf[:, 1]
    assert not kc.is_contiguous()
    slots = torch.tensor([5, 0, -1, 11, 3], dtype=torch.int32)
    torch_npu.npu_scatter_pa_kv_cache(key=key, value=value, key_cache=kc, value_cache=vc,
                                      slot_mapping=slots, cache_mode="Norm")
    for t, slot in enumerate(slots.tolist()):
        if slot >= 0:
            assert torch.equal(buf[slot // 4, 0, slot % 4], key[t])
            assert torch.equal(buf[slot // 4, 1, slot % 4], value[t])
    assert int((buf != 0).flatten(3).any(-1).sum()) == 8          # 4 slots x (k, v); -1 wrote nothing


@pytest.mark.parametrize("sliding", [None, 6])
def test_fia_v2_tnd_sinks_prefill_then_paged_decode(sliding):
    dtype, n, nkv, d = torch.bfloat16, 8, 2, 128
    g = torch.Generator().manual_seed(3)
    sinks = (torch.randn(n, generator=g) * 2).bfloat16()      # the op takes bfloat16 sinks only
    q_lens = [9, 4]
    q = torch.randn(sum(q_lens), n, d, generator=g).to(dtype)
    k = torch.randn(sum(q_lens), nkv, d, generator=g).to(dtype)
    v = torch.randn(sum(q_lens), nkv, d, generator=g).to(dtype)
    cum = dense_segments(q_lens)
    kwargs = dict(num_query_heads=n, num_key_value_heads=nkv, input_layout="TND",
                  pre_tokens=sliding if sliding else 2147483647, next_tokens=0,
                  atten_mask=MASK2048, sparse_mode=4 if sliding else 3, softmax_scale=d ** -0.5,
                  learnable_sink=sinks)
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(
        q, k, v, actual_seq_qlen=cum[1:], actual_seq_kvlen=cum[1:], **kwargs)
    allowed = window(sliding) if sliding else None
    want = attention_f64(q, k, v, cum, causal=True, allowed=allowed, sinks=sinks)
    close(out, want, dtype)
    without = attention_f64(q, k, v, cum, causal=True, allowed=allowed)
    assert (want - without).abs().max() > 0.05          # the sinks matter at this size
    # decode: one new token per sequence against a paged cache (block table), q cumulative
    kv_lens = [13, 30]
    kk, vv, kc, vc, table = paged_kv(kv_lens, nkv, d, d, 128, dtype, seed=4)
    qd = torch.randn(2, n, d, generator=g).to(dtype)
    outd, _ = torch_npu.npu_fused_infer_attention_score_v2(
        qd, kc.flatten(2), vc.flatten(2), block_table=table, block_size=128,
        actual_seq_qlen=torch.tensor([1, 1], dtype=torch.int32).cumsum(0), actual_seq_kvlen=kv_lens,
        **kwargs)
    wantd = attention_f64(qd, torch.cat(kk), torch.cat(vv), dense_segments([1, 1]),
                          dense_segments(kv_lens), causal=True, allowed=allowed, sinks=sinks)
    close(outd, wantd, dtype)


def test_fia_v2_float32_sinks_only_in_the_math_check_switch():
    """The page lists bfloat16 sinks only: float32 sinks are refused, except inside
    ``float32_not_on_hardware()`` (the engine tests' float32 model), where they count as bf16 ones
    would: equal to the float64 reference with the sinks, a window of 3 and K 192 / V 128."""
    from npu_shim.emulation.dtypes import float32_not_on_hardware

    n, g = 4, torch.Generator().manual_seed(8)
    q = torch.randn(7, n, 192, generator=g)
    k = torch.randn(7, 2, 192, generator=g)
    v = torch.randn(7, 2, 128, generator=g)
    sinks = torch.randn(n, generator=g) * 2
    kwargs = dict(num_query_heads=n, num_key_value_heads=2, input_layout="TND", sparse_mode=4, pre_tokens=3,
                  next_tokens=0, atten_mask=MASK2048, softmax_scale=192 ** -0.5, actual_seq_qlen=[7],
                  actual_seq_kvlen=[7], learnable_sink=sinks)
    with pytest.raises(ValueError, match="learnable_sink must be bfloat16"):
        torch_npu.npu_fused_infer_attention_score_v2(q.bfloat16(), k.bfloat16(), v.bfloat16(), **kwargs)
    with float32_not_on_hardware():
        out, _ = torch_npu.npu_fused_infer_attention_score_v2(q, k, v, **kwargs)
    # pre_tokens 3: keys i - 3 .. i (the band as the emulation reads it, :func:`window`)
    want = attention_f64(q, k, v, [0, 7], causal=True, allowed=window(3), sinks=sinks)
    assert (out.double() - want).abs().max() < FLOAT32_TOL
    assert (want - attention_f64(q, k, v, [0, 7], causal=True, allowed=window(3))).abs().max() > 0.05


def test_fia_v2_k192_v128_tnd_documented_paged_or_not():
    n, g = 4, torch.Generator().manual_seed(5)
    q = torch.randn(10, n, 192, generator=g).bfloat16()
    k = torch.randn(10, 2, 192, generator=g).bfloat16()
    v = torch.randn(10, 2, 128, generator=g).bfloat16()
    cum = [4, 10]
    kwargs = dict(num_query_heads=n, num_key_value_heads=2, input_layout="TND", sparse_mode=3,
                  atten_mask=MASK2048, softmax_scale=192 ** -0.5)
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(q, k, v, actual_seq_qlen=cum,
                                                          actual_seq_kvlen=cum, **kwargs)
    assert out.shape == (10, n, 128)
    close(out, attention_f64(q, k, v, [0] + cum, causal=True), torch.bfloat16)
    kk, vv, kc, vc, table = paged_kv([7, 20], 2, 192, 128, 128, torch.bfloat16, seed=6)
    qd = q[:2]
    outd, _ = torch_npu.npu_fused_infer_attention_score_v2(
        qd, kc.flatten(2), vc.flatten(2), block_table=table, block_size=128,
        actual_seq_qlen=[1, 2], actual_seq_kvlen=[7, 20], **kwargs)
    close(outd, attention_f64(qd, torch.cat(kk), torch.cat(vv), [0, 1, 2], [0, 7, 27], causal=True),
          torch.bfloat16)
    with pytest.raises(NotImplementedError, match="K_D=192, V_D=96"):
        torch_npu.npu_fused_infer_attention_score_v2(q, k, v[..., :96].contiguous(),
                                                     actual_seq_qlen=cum, actual_seq_kvlen=cum,
                                                     **kwargs)
    with pytest.raises(NotImplementedError, match="V_D=192 with GQA"):
        torch_npu.npu_fused_infer_attention_score_v2(q, k, k, actual_seq_qlen=cum,
                                                     actual_seq_kvlen=cum, **kwargs)
    with pytest.raises(ValueError, match="block_size"):
        torch_npu.npu_fused_infer_attention_score_v2(
            qd, kc.flatten(2)[:, :120].contiguous(), vc.flatten(2)[:, :120].contiguous(),
            block_table=table, block_size=120, actual_seq_qlen=[1, 2], actual_seq_kvlen=[7, 20],
            **kwargs)
    q256 = torch.randn(4, 2, 256).bfloat16()
    with pytest.raises(NotImplementedError, match="learnable_sink"):
        torch_npu.npu_fused_infer_attention_score_v2(
            q256, q256, q256, num_query_heads=2, input_layout="TND", actual_seq_qlen=[4],
            actual_seq_kvlen=[4], learnable_sink=torch.zeros(2))


def test_fia_v2_refusals_and_host_lengths():
    q = torch.randn(3, 4, 16).bfloat16()
    kv = torch.randn(3, 4, 16).bfloat16()
    with pytest.raises(NotImplementedError, match="input_layout"):
        torch_npu.npu_fused_infer_attention_score_v2(q, kv, kv, input_layout="BSND", num_query_heads=4)
    with pytest.raises(ValueError, match="learnable_sink"):
        torch_npu.npu_fused_infer_attention_score_v2(
            q, kv, kv, input_layout="TND", num_query_heads=4, actual_seq_qlen=[3],
            actual_seq_kvlen=[3], learnable_sink=torch.zeros(3))
    with pytest.raises(ValueError, match="requires actual_seq_qlen"):
        torch_npu.npu_fused_infer_attention_score_v2(q, kv, kv, input_layout="TND", num_query_heads=4)
    from npu_shim.emulation._registry import host_arguments

    assert [a for a, _ in host_arguments("npu_fused_infer_attention_score_v2", (),
                                         {"actual_seq_qlen": [3], "actual_seq_kvlen": [3]})] == \
        ["actual_seq_qlen", "actual_seq_kvlen"]
    assert [a for a, _ in host_arguments("_npu_paged_attention", (),
                                         {"context_lens": torch.tensor([3])})] == ["context_lens"]
