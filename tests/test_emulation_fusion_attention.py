"""npu_fusion_attention, npu_prompt_flash_attention and _npu_flash_attention_unpad
against the float64 reference, for every layout and the documented sparse modes."""
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
# float32 7.6e-7, float16 4.7e-4, bfloat16 7.6e-3
TOL = {torch.float32: 7e-6, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}


def recorded(comparison, got, want, dtype):
    """The max |got - want| of a check, recorded for the tolerance table (npu_shim.testing.errors)."""
    from npu_shim.testing.errors import within

    diff = (got.double() - want).abs()
    within(comparison, diff.max().item() if diff.numel() else 0.0, TOL[dtype], dtype)
MASK2048 = torch.ones(2048, 2048, dtype=torch.bool).triu(1)


def close(got, want, dtype=torch.float32):
    recorded("emulation FA/PFA/unpad vs float64", got, want, dtype)
    tol = TOL[dtype]
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=0)


def to_layout(x, layout):
    """x: (B, S, N, D) -> the layout's tensor."""
    if layout == "BSND":
        return x.contiguous()
    if layout == "BNSD":
        return x.permute(0, 2, 1, 3).contiguous()
    if layout == "BSH":
        return x.flatten(2).contiguous()
    if layout == "SBH":
        return x.flatten(2).transpose(0, 1).contiguous()
    raise AssertionError(layout)


def from_layout(x, layout, n):
    if layout == "BSND":
        return x
    if layout == "BNSD":
        return x.permute(0, 2, 1, 3)
    if layout == "BSH":
        return x.unflatten(-1, (n, -1))
    return x.transpose(0, 1).unflatten(-1, (n, -1))  # SBH


def batched_reference(q, k, v, scale, allowed=None):
    """Reference for (B, S, N, D) inputs, batch by batch, returns (B, Sq, N, Dv)."""
    b, sq, n, _ = q.shape
    skv = k.shape[1]
    out = attention_f64(q.reshape(b * sq, n, -1), k.reshape(b * skv, k.shape[2], -1),
                        v.reshape(b * skv, v.shape[2], -1), dense_segments([sq] * b),
                        dense_segments([skv] * b), scale=scale, allowed=allowed)
    return out.reshape(b, sq, n, -1)


def band(pre, nxt, offset):
    def allowed(seg, sq, skv):
        rel = torch.arange(skv).unsqueeze(0) - (torch.arange(sq).unsqueeze(1) + offset)
        return (rel <= nxt) & (rel >= -pre)
    return allowed


def qkv(b, sq, skv, n, nkv, d, dv, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, sq, n, d, generator=g).to(dtype),
            torch.randn(b, skv, nkv, d, generator=g).to(dtype),
            torch.randn(b, skv, nkv, dv, generator=g).to(dtype))


@pytest.mark.parametrize("layout", ["BSH", "SBH", "BSND", "BNSD"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_fusion_attention_layouts_no_mask(layout, dtype):
    q, k, v = qkv(2, 9, 13, 4, 2, 16, 16, dtype)
    out = torch_npu.npu_fusion_attention(to_layout(q, layout), to_layout(k, layout),
                                         to_layout(v, layout), 4, layout, scale=0.3)
    assert len(out) == 7 and out[4:] == (0, 0, 0)
    assert out[0].dtype == dtype
    close(from_layout(out[0], layout, 4), batched_reference(q, k, v, 0.3), dtype)


@pytest.mark.parametrize("sparse_mode, make_allowed", [
    (2, lambda sq, skv: band(10 ** 9, 0, 0)),            # leftUpCausal
    (3, lambda sq, skv: band(10 ** 9, 0, skv - sq)),     # rightDownCausal
    (4, lambda sq, skv: band(3, 1, skv - sq)),           # band, bottom-right origin
])
@pytest.mark.parametrize("sq, skv", [(7, 12), (12, 7), (9, 9)])
def test_fusion_attention_causal_and_band_modes(sparse_mode, make_allowed, sq, skv):
    q, k, v = qkv(2, sq, skv, 4, 4, 16, 16)
    out = torch_npu.npu_fusion_attention(to_layout(q, "BNSD"), to_layout(k, "BNSD"),
                                         to_layout(v, "BNSD"), 4, "BNSD", scale=0.25,
                                         atten_mask=MASK2048, sparse_mode=sparse_mode,
                                         pre_tockens=3, next_tockens=1)[0]
    close(from_layout(out, "BNSD", 4), batched_reference(q, k, v, 0.25, make_allowed(sq, skv)))


def test_fusion_attention_mode0_mask_and_band_and_mode1_full_mask():
    q, k, v = qkv(2, 8, 10, 2, 2, 16, 16)
    g = torch.Generator().manual_seed(3)
    mask = torch.rand(2, 2, 8, 10, generator=g) > 0.6  # BNSS, True = masked
    mask[..., 0] = False                              # every row sees key 0
    allowed_mask = lambda seg, sq, skv: ~mask[seg]    # noqa: E731
    out1 = torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", scale=0.5, atten_mask=mask,
                                          sparse_mode=1, pre_tockens=0, next_tockens=0)[0]
    close(out1, batched_reference(q, k, v, 0.5, allowed_mask))
    out0 = torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", scale=0.5, atten_mask=mask,
                                          sparse_mode=0, pre_tockens=2, next_tockens=1)[0]
    both = lambda seg, sq, skv: allowed_mask(seg, sq, skv) & band(2, 1, 0)(seg, sq, skv)  # noqa: E731
    close(out0, batched_reference(q, k, v, 0.5, both))


@pytest.mark.parametrize("mode", [0, 2, 3, 4])
def test_fusion_attention_without_mask_is_full_computation(mode):
    """Documented: atten_mask=None makes sparse_mode and the tokens ineffective."""
    q, k, v = qkv(1, 6, 6, 2, 2, 16, 16)
    out = torch_npu.npu_fusion_attention(q, k, v, 2, "BSND", scale=0.3, sparse_mode=mode,
                                         next_tockens=0)[0]
    close(out, batched_reference(q, k, v, 0.3))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fusion_attention_tnd_varlen_gqa_dv_smaller(dtype):
    lengths_q = [5, 0, 33, 1, 8]
    lengths_kv = [5, 3, 40, 1, 8]
    cq, ckv = dense_segments(lengths_q), dense_segments(lengths_kv)
    g = torch.Generator().manual_seed(1)
    q = torch.randn(cq[-1], 8, 32, generator=g).to(dtype)
    k = torch.randn(ckv[-1], 2, 32, generator=g).to(dtype)
    v = torch.randn(ckv[-1], 2, 16, generator=g).to(dtype)
    out, smax, ssum, *_ = torch_npu.npu_fusion_attention(
        q, k, v, 8, "TND", scale=0.2, atten_mask=MASK2048, sparse_mode=3,
        actual_seq_qlen=cq[1:], actual_seq_kvlen=ckv[1:])
    want, lse = attention_f64(q, k, v, cq, ckv, scale=0.2, causal=True, return_lse=True)
    close(out, want, dtype)
    assert smax.shape == (8, cq[-1], 8) and ssum.shape == (8, cq[-1], 8)
    got_lse = (smax[..., 0] + ssum[..., 0].log()).t()
    rows = torch.isfinite(lse)
    from npu_shim.testing.errors import within
    # measured worst 4.3e-7 (float32), 3.9e-7 (bfloat16: the statistics are float32 either way)
    within("emulation FA log-sum-exp vs float64", (got_lse[rows].double() - lse[rows]).abs().max(), 4e-6, dtype)
    torch.testing.assert_close(got_lse[rows].double(), lse[rows], atol=4e-6, rtol=0)


def test_fusion_attention_tnd_trailing_zero_batches_and_softmax_layout():
    cq = [3, 7, 0, 0]  # documented: the last two batches do not take part
    q = torch.randn(7, 2, 16)
    out, smax, _s, *_ = torch_npu.npu_fusion_attention(q, q, q, 2, "TND", scale=0.25,
                                                       actual_seq_qlen=cq, actual_seq_kvlen=cq,
                                                       softmax_layout="TND")
    close(out, attention_f64(q, q, q, [0, 3, 7], scale=0.25))
    assert smax.shape == (7, 2, 8)


def test_fusion_attention_tnd_ss_mask_per_segment_top_left():
    lengths = [4, 6]
    cu = dense_segments(lengths)
    q = torch.randn(cu[-1], 2, 16)
    mask = torch.zeros(6, 6, dtype=torch.bool)
    mask[:, 1] = True  # every segment: key 1 masked
    out = torch_npu.npu_fusion_attention(q, q, q, 2, "TND", scale=0.25, atten_mask=mask,
                                         sparse_mode=1, actual_seq_qlen=cu[1:],
                                         actual_seq_kvlen=cu[1:])[0]
    allowed = lambda seg, sq, skv: ~mask[:sq, :skv]  # noqa: E731
    close(out, attention_f64(q, q, q, cu, scale=0.25, allowed=allowed))


@pytest.mark.parametrize("kwargs, exc, word", [
    (dict(pse=torch.zeros(1)), NotImplementedError, "pse"),
    (dict(keep_prob=0.9), NotImplementedError, "keep_prob"),
    (dict(prefix=[1]), NotImplementedError, "prefix"),
    (dict(sparse_mode=6), NotImplementedError, "sparse_mode"),
    (dict(actual_seq_qlen=[2]), NotImplementedError, "actual_seq_qlen"),
    (dict(sparse_mode=3, atten_mask=torch.ones(2, 2, dtype=torch.bool)), ValueError, "2048"),
    (dict(sparse_mode=3, atten_mask=~MASK2048), ValueError, "lower-triangular"),
])
def test_fusion_attention_refuses_what_it_does_not_implement(kwargs, exc, word):
    q = torch.randn(1, 4, 2, 16)  # BSND: S=4, N=2
    with pytest.raises(exc, match=word):
        torch_npu.npu_fusion_attention(q, q, q, 2, "BSND", **kwargs)


def test_fusion_attention_head_dim_constraints():
    q = torch.randn(1, 3, 2, 16)
    with pytest.raises(ValueError, match="Dk >= Dv"):
        torch_npu.npu_fusion_attention(q, q, torch.randn(1, 3, 2, 32), 2, "BSND")
    with pytest.raises(ValueError, match="multiple"):
        torch_npu.npu_fusion_attention(q, torch.randn(1, 3, 3, 16), torch.randn(1, 3, 3, 16), 2, "BSND")


def test_fusion_attention_varlen_batch_limit():
    cu = list(range(1, 1026))
    q = torch.randn(1025, 1, 16)
    with pytest.raises(ValueError, match="1024"):
        torch_npu.npu_fusion_attention(q, q, q, 1, "TND", actual_seq_qlen=cu, actual_seq_kvlen=cu)


# ------------------------------------------------------------ prompt flash attention

@pytest.mark.parametrize("layout", ["BNSD", "BSH", "BSND", "BNSD_BSND"])
def test_prompt_flash_attention_layouts_gqa_and_actual_lengths(layout):
    q, k, v = qkv(2, 8, 11, 4, 2, 16, 16, seed=5)
    in_layout = "BNSD" if layout == "BNSD_BSND" else layout
    out = torch_npu.npu_prompt_flash_attention(
        to_layout(q, in_layout), to_layout(k, in_layout), to_layout(v, in_layout), num_heads=4,
        num_key_value_heads=2, scale_value=0.3, input_layout=layout,
        actual_seq_lengths=[8, 5], actual_seq_lengths_kv=[11, 7])
    got = from_layout(out, "BSND" if layout == "BNSD_BSND" else layout, 4)
    close(got[0], batched_reference(q[:1], k[:1], v[:1], 0.3)[0])
    close(got[1, :5], batched_reference(q[1:, :5], k[1:, :7], v[1:, :7], 0.3)[0])
    assert torch.equal(got[1, 5:], torch.zeros_like(got[1, 5:]))


def test_prompt_flash_attention_mask_with_default_tokens_is_causal_inside_the_mask():
    """Documented (API reference, npu_prompt_flash_attention, sparse_mode 0): with a mask,
    only the pre/next band is computed, and the default next_tokens is 0. An all-False S x S
    mask (nothing masked out) with the default tokens therefore gives causal attention;
    next_tokens=65535 gives full attention."""
    q, k, v = qkv(1, 6, 6, 2, 2, 16, 16, seed=2)
    mask = torch.zeros(1, 1, 6, 6, dtype=torch.bool)
    out = torch_npu.npu_prompt_flash_attention(
        to_layout(q, "BNSD"), to_layout(k, "BNSD"), to_layout(v, "BNSD"), atten_mask=mask,
        num_heads=2, input_layout="BNSD", scale_value=0.25)
    close(from_layout(out, "BNSD", 2), batched_reference(q, k, v, 0.25, band(10 ** 9, 0, 0)))
    full = torch_npu.npu_prompt_flash_attention(
        to_layout(q, "BNSD"), to_layout(k, "BNSD"), to_layout(v, "BNSD"), atten_mask=mask,
        num_heads=2, input_layout="BNSD", scale_value=0.25, next_tokens=65535)
    close(from_layout(full, "BNSD", 2), batched_reference(q, k, v, 0.25))


def test_prompt_flash_attention_per_segment_loop_of_seed_000():
    """The seed's working fallback: no mask, one call per image segment."""
    lengths = [3, 10, 1]
    cu = dense_segments(lengths)
    q = torch.randn(cu[-1], 4, 32)
    outs = []
    for a, b in zip(cu, cu[1:]):
        blk = lambda x: x[a:b].transpose(0, 1).unsqueeze(0)  # noqa: E731
        o = torch_npu.npu_prompt_flash_attention(blk(q), blk(q), blk(q), num_heads=4,
                                                 input_layout="BNSD", scale_value=32 ** -0.5)
        outs.append(o.squeeze(0).transpose(0, 1))
    close(torch.cat(outs), attention_f64(q, q, q, cu))


def test_prompt_flash_attention_refusals():
    q = torch.randn(1, 2, 4, 16)
    with pytest.raises(NotImplementedError, match="quant_scale2"):
        torch_npu.npu_prompt_flash_attention(q, q, q, num_heads=2, input_layout="BNSD",
                                             quant_scale2=torch.ones(1))
    with pytest.raises(ValueError, match="2048"):
        torch_npu.npu_prompt_flash_attention(q, q, q, num_heads=2, input_layout="BNSD", sparse_mode=3)


# --------------------------------------------------------------------------- unpad

def test_flash_attention_unpad_writes_out_per_segment():
    lengths = [4, 9, 1]
    seq_len = torch.tensor(lengths, dtype=torch.int32)
    t = sum(lengths)
    q, k, v = torch.randn(t, 8, 32), torch.randn(t, 2, 32), torch.randn(t, 2, 32)
    out = torch.full((t, 8, 32), float("nan"))
    ret = torch_npu._npu_flash_attention_unpad(query=q, key=k, value=v, seq_len=seq_len,
                                               scale_value=0.2, num_heads=8, num_kv_heads=2, out=out)
    assert ret is None
    close(out, attention_f64(q, k, v, dense_segments(lengths), scale=0.2))


def test_flash_attention_unpad_requires_host_seq_len_and_matching_tokens():
    q = torch.randn(5, 2, 16)
    out = torch.empty_like(q)
    with pytest.raises(ValueError, match="host"):
        torch_npu._npu_flash_attention_unpad(q, q, q, torch.tensor([5], device="meta"), 1.0, 2, 2, out)
    with pytest.raises(ValueError, match="summing"):
        torch_npu._npu_flash_attention_unpad(q, q, q, torch.tensor([4]), 1.0, 2, 2, out)


def test_flash_attention_unpad_310p_constraints(monkeypatch):
    monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", "Ascend310P3")
    q = torch.randn(4, 2, 72)
    with pytest.raises(ValueError, match="multiples of 16"):
        torch_npu._npu_flash_attention_unpad(q, q, q, torch.tensor([4]), 1.0, 2, 2, torch.empty_like(q))
    q = torch.randn(4, 2, 128)
    out = torch.empty_like(q)
    torch_npu._npu_flash_attention_unpad(q, q, q, torch.tensor([4]), 0.1, 2, 2, out)
    close(out, attention_f64(q, q, q, [0, 4], scale=0.1))


def test_soc_reporting(monkeypatch):
    assert torch_npu.npu.get_soc_version() == 220
    monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", "Ascend310P3")
    assert torch_npu.npu.get_soc_version() == 202 == torch_npu._C._npu_get_soc_version()
    assert torch_npu.npu.get_device_name() == "Ascend310P3"
    monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", "Ascend999")
    with pytest.raises(ValueError, match="NPU_SHIM_EMULATE_SOC"):
        torch_npu.npu.get_soc_version()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_fusion_attention_on_cuda():
    cu = [3, 10]
    q = torch.randn(10, 4, 64, device="cuda", dtype=torch.float16)
    k = torch.randn(10, 2, 64, device="cuda", dtype=torch.float16)
    out = torch_npu.npu_fusion_attention(q, k, k, 4, "TND", scale=0.125, atten_mask=MASK2048.cuda(),
                                         sparse_mode=3, actual_seq_qlen=cu, actual_seq_kvlen=cu)[0]
    assert out.device.type == "cuda"
    close(out.cpu(), attention_f64(q, k, k, [0] + cu, scale=0.125, causal=True), torch.float16)
