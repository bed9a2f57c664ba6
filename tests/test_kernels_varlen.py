"""VarlenAttention: block-diagonal attention through the (emulated) NPU ops,
against the float64 reference; the dispatch it makes; block independence."""
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from npu_shim import emulation
from npu_shim.kernels import VarlenAttention
from npu_shim.testing import attention_f64, count_host_syncs, dense_segments, record_npu_calls

emulation.install()
import torch_npu  # noqa: E402,F401

# The emulation's (and the kernels') arithmetic against float64: float32 inputs, which the
# real ops reject, on purpose (see tests/conftest.py float32_math); the dtype rules are
# tests/test_emulation_dtypes.py's.
pytestmark = pytest.mark.float32_math

# max |out - float64|, atol only (rtol 0); measured worst (base lane, CPU torch 2.13):
# float32 1.5e-6, float16 9.7e-4, bfloat16 7.7e-3
TOL = {torch.float32: 1.4e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def recorded(comparison, got, want, dtype):
    """The max |got - want| of a check, recorded for the tolerance table (npu_shim.testing.errors)."""
    from npu_shim.testing.errors import within

    diff = (got.double() - want).abs()
    within(comparison, diff.max().item() if diff.numel() else 0.0, TOL[dtype], dtype)
HEAD_DIMS = [64, 72, 80, 96, 112, 128]


def make(lengths, n, nkv, d, dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    t = sum(lengths)
    return (torch.randn(t, n, d, generator=g).to(dtype), torch.randn(t, nkv, d, generator=g).to(dtype),
            torch.randn(t, nkv, dv, generator=g).to(dtype))


def check(layer, lengths, dtype=torch.float32, seed=0, cu_as="tensor"):
    q, k, v = make(lengths, layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.v_head_dim,
                   dtype, seed)
    cu = dense_segments(lengths)
    cu_arg = torch.tensor(cu, dtype=torch.int32) if cu_as == "tensor" else cu
    out = layer(q, k, v, cu_arg)
    assert out.shape == (q.shape[0], layer.num_heads, layer.v_head_dim) and out.dtype == dtype
    want = attention_f64(q, k, v, cu, scale=layer.scale)
    recorded("kernel VarlenAttention vs float64", out, want, dtype)
    torch.testing.assert_close(out.double(), want, atol=TOL[dtype], rtol=0)
    return out


segment_length = st.one_of(st.integers(0, 8), st.integers(9, 64), st.integers(65, 400))


@settings(max_examples=30, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(lengths=st.lists(segment_length, min_size=1, max_size=10).filter(lambda x: sum(x) > 0),
       nkv=st.sampled_from([1, 2]), group=st.sampled_from([1, 2, 4, 8]),
       head_dim=st.sampled_from(HEAD_DIMS), v_dim=st.sampled_from([None, 64, 96]),
       dtype=st.sampled_from([torch.float32, torch.float16, torch.bfloat16]),
       backend=st.sampled_from(["tnd", "unpad"]), seed=st.integers(0, 2 ** 16))
def test_matches_the_float64_reference(lengths, nkv, group, head_dim, v_dim, dtype, backend, seed):
    if backend == "unpad":
        v_dim = None  # the 310P op needs equal key and value head dims
    layer = VarlenAttention(nkv * group, head_dim, num_kv_heads=nkv, v_head_dim=v_dim, backend=backend)
    check(layer, lengths, dtype, seed)


def test_long_and_tiny_segments_together():
    layer = VarlenAttention(4, 72, num_kv_heads=2)
    check(layer, [5000, 1, 0, 3, 1, 700], seed=1)


def test_many_tiny_segments_are_split_into_documented_batches():
    lengths = [i % 4 for i in range(1500)]  # includes zero-length segments
    layer = VarlenAttention(2, 64)
    with record_npu_calls() as calls:
        check(layer, lengths, seed=2)
    assert [c.name for c in calls] == ["npu_fusion_attention"] * 2
    assert all(len(c.kwargs["actual_seq_qlen"]) <= 1024 for c in calls)


@pytest.mark.parametrize("head_dim, padded", [(64, 64), (72, 128), (80, 128), (112, 128), (128, 128)])
def test_one_fused_tnd_call_per_layer_without_a_mask(head_dim, padded):
    lengths = [30, 0, 7, 64]
    cu = torch.tensor(dense_segments(lengths))
    layers = [VarlenAttention(8, head_dim) for _ in range(27)]
    q, k, v = make(lengths, 8, 8, head_dim, head_dim)
    with record_npu_calls() as calls, count_host_syncs(device_tensors=[cu]) as syncs:
        for layer in layers:
            layer(q, k, v, cu)
    assert len(calls) == 27 and syncs.count == 1
    for call in calls:
        assert call.name == "npu_fusion_attention" and call.spelling == "torch_npu"
        assert call.kwargs["input_layout"] == "TND" and call.kwargs["head_num"] == 8
        assert call.kwargs.get("atten_mask") is None and "sparse_mode" not in call.kwargs
        assert call.kwargs["actual_seq_qlen"] == call.kwargs["actual_seq_kvlen"] == [30, 30, 37, 101]
        assert all(type(x) is int for x in call.kwargs["actual_seq_qlen"])
        assert call.kwargs["scale"] == head_dim ** -0.5
        assert call.args[0].shape[-1] == padded


def test_310p_uses_unpad_with_host_lengths(monkeypatch):
    monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", "Ascend310P3")
    layer = VarlenAttention(4, 72, num_kv_heads=2)
    assert layer.backend == "unpad"
    lengths = [9, 0, 4]
    cu = torch.tensor(dense_segments(lengths))
    with record_npu_calls() as calls, count_host_syncs(device_tensors=[cu]) as syncs:
        out = check(layer, lengths, cu_as="list")
        layer(*make(lengths, 4, 2, 72, 72), cu)
    assert syncs.count == 1
    assert [c.name for c in calls] == ["_npu_flash_attention_unpad"] * 2
    seq_len = calls[0].kwargs["seq_len"]
    assert seq_len.device.type == "cpu" and seq_len.dtype == torch.int32 and seq_len.tolist() == [9, 4]
    assert calls[0].kwargs["out"].shape == (13, 4, 128) and calls[0].kwargs["query"].shape[-1] == 128
    assert out.shape == (13, 4, 72)


def test_310p_refuses_a_different_value_head_dim(monkeypatch):
    monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", "Ascend310P3")
    with pytest.raises(ValueError, match="_npu_flash_attention_unpad"):
        VarlenAttention(4, 64, v_head_dim=32)


def test_value_head_dim_larger_than_key_head_dim_on_tnd():
    layer = VarlenAttention(4, 64, v_head_dim=96)  # Dk >= Dv: q and k are padded to 128
    assert (layer.qk_pad_dim, layer.v_pad_dim) == (128, 128)
    check(layer, [10, 3], seed=4)


def test_block_independence_is_bitwise():
    lengths = [50, 37, 64]
    q, k, v = make(lengths, 4, 2, 80, 80, torch.bfloat16, seed=5)
    layer = VarlenAttention(4, 80, num_kv_heads=2)
    cu = dense_segments(lengths)
    before = layer(q, k, v, cu)
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    seg_b = slice(cu[1], cu[2])
    q2[seg_b] = torch.randn_like(q2[seg_b]) * 10
    k2[seg_b] = torch.randn_like(k2[seg_b]) * 10
    v2[seg_b] = torch.randn_like(v2[seg_b]) * 10
    after = layer(q2, k2, v2, cu)
    assert torch.equal(before[:cu[1]], after[:cu[1]])
    assert torch.equal(before[cu[2]:], after[cu[2]:])
    assert not torch.equal(before[seg_b], after[seg_b])


def test_scale_and_backend_are_decided_once():
    layer = VarlenAttention(2, 72, scale=0.5, backend="unpad")
    assert layer.scale == 0.5 and layer.backend == "unpad"
    check(layer, [4, 6], seed=6)
    with pytest.raises(ValueError, match="backend"):
        VarlenAttention(2, 64, backend="bnsd")


def test_shape_and_length_errors():
    layer = VarlenAttention(4, 64, num_kv_heads=2)
    q, k, v = make([3, 4], 4, 2, 64, 64)
    with pytest.raises(ValueError, match="ends at"):
        layer(q, k, v, [0, 3, 6])
    with pytest.raises(ValueError, match="k must be"):
        layer(q, q, v, [0, 3, 7])
    with pytest.raises(ValueError, match="divide"):
        VarlenAttention(6, 64, num_kv_heads=4)
    empty = layer(q[:0], k[:0], v[:0], [0])
    assert empty.shape == (0, 4, 64)


@pytest.mark.parametrize("backend, op, limit", [
    ("tnd", "npu_fusion_attention", 1024),        # documented varlen batch limit
    ("unpad", "_npu_flash_attention_unpad", 2000),  # documented 310P batch limit
])
def test_more_segments_than_one_call_takes_are_split(backend, op, limit):
    lengths = [1 + i % 3 for i in range(limit + 7)]
    layer = VarlenAttention(2, 16, backend=backend)
    with record_npu_calls() as calls:
        check(layer, lengths)
    assert [c.name for c in calls] == [op, op]
    assert [c.arg("query", 0).shape[0] for c in calls] == [sum(lengths[:limit]), sum(lengths[limit:])]


def test_gqa_ratio_over_the_documented_limit_is_refused():
    q = torch.randn(1, 65, 1, 16)     # BNSD: 65 query heads
    kv = torch.randn(1, 1, 4, 16)     # 1 key/value head
    with pytest.raises(ValueError, match="num_heads / num_key_value_heads must be <= 64"):
        torch_npu.npu_fused_infer_attention_score(q, kv, kv, num_heads=65, num_key_value_heads=1,
                                                  input_layout="BNSD")
