"""vllm-ascend's decoder attention (``vllm_ascend.attention.attention_v1``) on CPU under the
torch_npu emulation, on the real wheels of vllm-ascend 0.14.0rc1, 0.21.0rc1, 0.24.0rc1,
0.27.1rc1 and 0.30.0rc2: it imports, and ``AscendAttentionBackendImpl.forward`` runs one
prefill and one decode step with an emulated paged KV cache, matching the float64 reference
(attention from its definition: causal, GQA, sliding window, sinks) in the dtypes the
hardware takes. Helpers (metadata, KV cache, import order): vllm_ascend_decoder_support.py.
"""
import inspect

import pytest
import torch

from npu_shim.testing import attention_f64, dense_segments, record_npu_calls
from npu_shim.testing.errors import Tolerance

# keeps_process_state: it registers torch.npu (the emulation's) and imports all of vllm_ascend.ops,
# which the other tests of a lane must not find: it runs after them.
# The lanes: the releases whose decoder path the MiMo-V2-Flash patches use (vllm.mimo_v2_v_head_dim's
# window, one lane per shape of attention_v1) and the one vllm.sinks_refuse guards.
pytestmark = [pytest.mark.claimed("vllm.mimo_v2_v_head_dim",
                                  pinned={"vllm-ascend": ("0.21.0rc1", "0.24.0rc1", "0.27.1rc1", "0.30.0rc2")}),
              pytest.mark.claimed("vllm.sinks_refuse"),
              pytest.mark.keeps_process_state]

# max |out - float64| of the layer (|ref| <= ~3), measured worst over the five lanes:
# bfloat16 7.7e-3, float16 8.9e-4
TOL = {torch.bfloat16: Tolerance("vllm-ascend decoder layer vs float64", 3e-2, "bfloat16"),
       torch.float16: Tolerance("vllm-ascend decoder layer vs float64", 4e-3, "float16")}
CACHE_WRITES = {"_npu_reshape_and_cache", "npu_scatter_pa_kv_cache"}
N, NKV, D = 4, 2, 128   # D 128: what FIA's TND page documents for K == V
Q_LENS = [5, 3]


@pytest.fixture(scope="module")
def support():
    import vllm_ascend_decoder_support

    return vllm_ascend_decoder_support


def tensors(dtype, seed, t, d=D, dv=D):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(t, N, d, generator=g).to(dtype), torch.randn(t, NKV, d, generator=g).to(dtype),
            torch.randn(t, NKV, dv, generator=g).to(dtype))


def close(got, want, dtype):
    err = (got.double().reshape(want.shape) - want).abs().max().item()
    assert err < TOL[dtype], err


def history(k, v, k1, v1):
    """Each sequence's keys/values after the decode step: its prefill tokens, then its new one."""
    bounds = dense_segments(Q_LENS)
    ks, vs = [], []
    for i in range(len(Q_LENS)):
        ks += [k[bounds[i]:bounds[i + 1]], k1[i:i + 1]]
        vs += [v[bounds[i]:bounds[i + 1]], v1[i:i + 1]]
    return torch.cat(ks), torch.cat(vs), dense_segments([n + 1 for n in Q_LENS])


def attention_calls(calls):
    return [c for c in calls if c.name not in CACHE_WRITES]


def test_attention_v1_imports_on_the_emulation(support):
    attention_v1 = support.import_attention_v1()
    with support.DecoderCase(num_heads=N, num_kv_heads=NKV, head_size=D).config():
        backend = attention_v1.AscendAttentionBackend
        assert backend.get_impl_cls() is attention_v1.AscendAttentionBackendImpl
    import torch_npu

    assert torch_npu.__npu_shim_emulated__ and torch.npu is torch_npu.npu


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_standard_layer_prefill_then_decode(support, dtype):
    case = support.DecoderCase(num_heads=N, num_kv_heads=NKV, head_size=D, dtype=dtype)
    q, k, v = tensors(dtype, 0, sum(Q_LENS))
    q1, k1, v1 = tensors(dtype, 1, len(Q_LENS))
    with case.config():
        impl = case.impl()
        with record_npu_calls() as prefill_calls:
            out = case.prefill(impl, q, k, v, Q_LENS)
        close(out, attention_f64(q, k, v, dense_segments(Q_LENS), causal=True), dtype)
        with record_npu_calls() as decode_calls:
            out1 = case.decode(impl, q1, k1, v1)
    kk, vv, cum_kv = history(k, v, k1, v1)
    close(out1, attention_f64(q1, kk, vv, dense_segments([1, 1]), cum_kv, causal=True), dtype)
    # the tokens landed in the emulated cache where the block table says
    for i, n in enumerate([n + 1 for n in Q_LENS]):
        slots = case.slots(i, range(n))
        got = case.key_cache.flatten(0, 1)[slots]
        assert torch.equal(got, kk[cum_kv[i]:cum_kv[i + 1]])
    for calls, paged in ((prefill_calls, False), (decode_calls, True)):
        assert len([c for c in calls if c.name in CACHE_WRITES]) == 1
        (call,) = attention_calls(calls)
        assert call.name == "npu_fused_infer_attention_score"
        assert call.arg("input_layout") == "TND" and call.arg("sparse_mode") == 3
        assert (call.arg("block_table") is not None) is paged


def test_sliding_window_layer_with_sinks(support):
    attention_v1 = support.import_attention_v1()
    params = inspect.signature(attention_v1.AscendAttentionBackendImpl.__init__).parameters
    if "sinks" not in params:
        pytest.skip("this vllm-ascend's AscendAttentionBackendImpl has no sinks parameter "
                    "(0.14.0rc1 takes them into **kwargs and drops them): nothing to run")
    dtype, window = torch.bfloat16, 3
    sinks = torch.tensor([1.5, -0.5, 0.8, 2.0], dtype=torch.bfloat16)   # FIA v2 takes bfloat16 sinks only
    case = support.DecoderCase(num_heads=N, num_kv_heads=NKV, head_size=D, dtype=dtype)
    q, k, v = tensors(dtype, 2, sum(Q_LENS))
    q1, k1, v1 = tensors(dtype, 3, len(Q_LENS))

    def band(seg, sq, skv):   # the op's band: pre_tokens = window keys before the diagonal
        rows = torch.arange(sq).unsqueeze(1) + (skv - sq)
        return torch.arange(skv).unsqueeze(0) >= rows - window

    with case.config():
        impl = case.impl(sliding_window=window, sinks=sinks)
        with record_npu_calls() as calls:
            out = case.prefill(impl, q, k, v, Q_LENS)
            out1 = case.decode(impl, q1, k1, v1)
    want = attention_f64(q, k, v, dense_segments(Q_LENS), causal=True, allowed=band, sinks=sinks)
    close(out, want, dtype)
    assert (want - attention_f64(q, k, v, dense_segments(Q_LENS), causal=True, allowed=band)
            ).abs().max() > 0.05                       # the sinks change the answer
    kk, vv, cum_kv = history(k, v, k1, v1)
    close(out1, attention_f64(q1, kk, vv, dense_segments([1, 1]), cum_kv, causal=True, allowed=band,
                              sinks=sinks), dtype)
    used = attention_calls(calls)
    assert [c.name for c in used] == ["npu_fused_infer_attention_score_v2"] * 2
    assert all(c.arg("learnable_sink") is sinks and c.arg("sparse_mode") == 4 for c in used)
