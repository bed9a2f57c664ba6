"""The emulated RMSNorm family (npu_shim/emulation/norms.py) against a float64 reference
written from the definition: y_i = x_i / sqrt(mean_j x_j^2 + eps) * g_i, per row."""
import math

import pytest
import torch


@pytest.fixture(scope="module")
def torch_npu():
    from npu_shim import emulation

    emulation.install()
    import torch_npu

    return torch_npu


def _rms_f64(x, gamma, eps):
    """Row by row, in float64, from the formula."""
    rows = x.double().reshape(-1, x.shape[-1])
    g = gamma.double()
    out = torch.empty_like(rows)
    rstd = torch.empty(rows.shape[0], dtype=torch.float64)
    for r in range(rows.shape[0]):
        ms = sum(float(v) ** 2 for v in rows[r]) / rows.shape[1]
        rstd[r] = 1.0 / math.sqrt(ms + eps)
        out[r] = rows[r] * rstd[r] * g
    return out.reshape(x.shape), rstd.reshape(*x.shape[:-1], 1)


def test_rms_norm_both_spellings(torch_npu):
    torch.manual_seed(0)
    x, gamma = torch.randn(2, 3, 16), torch.randn(16)
    ref_y, ref_rstd = _rms_f64(x, gamma, 1e-6)
    for op in (torch_npu.npu_rms_norm, torch.ops.npu.npu_rms_norm):
        y, rstd = op(x, gamma, 1e-6)
        assert y.dtype == torch.float32 and rstd.dtype == torch.float32
        assert rstd.shape == (2, 3, 1)
        torch.testing.assert_close(y.double(), ref_y, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rstd.double(), ref_rstd, rtol=1e-6, atol=1e-6)


def test_rms_norm_epsilon_counts(torch_npu):
    """Small inputs and a large epsilon, where leaving epsilon out would show."""
    torch.manual_seed(3)
    x, gamma = torch.randn(3, 8) * 0.05, torch.randn(8)
    y, rstd = torch_npu.npu_rms_norm(x, gamma, epsilon=0.01)
    ref_y, ref_rstd = _rms_f64(x, gamma, 0.01)
    torch.testing.assert_close(y.double(), ref_y, rtol=1e-6, atol=1e-7)
    torch.testing.assert_close(rstd.double(), ref_rstd, rtol=1e-6, atol=1e-7)


def test_rms_norm_half_rounds_once(torch_npu):
    torch.manual_seed(1)
    x, gamma = torch.randn(5, 32).bfloat16(), torch.randn(32).bfloat16()
    y, _ = torch_npu.npu_rms_norm(x, gamma, epsilon=1e-5)
    ref, _ = _rms_f64(x, gamma, 1e-5)
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, ref.to(torch.bfloat16), rtol=0, atol=0)


def test_add_rms_norm_and_the_c_ascend_bias_op(torch_npu):
    torch.manual_seed(2)
    x1, x2, gamma, beta = torch.randn(4, 8), torch.randn(4, 8), torch.randn(8), torch.randn(8)
    ref_y, ref_rstd = _rms_f64(x1.double() + x2.double(), gamma, 1e-6)
    for op in (torch_npu.npu_add_rms_norm, torch.ops.npu.npu_add_rms_norm):
        y, rstd, total = op(x1, x2, gamma, 1e-6)
        torch.testing.assert_close(y.double(), ref_y, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(rstd.double(), ref_rstd, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(total.double(), x1.double() + x2.double(), rtol=1e-7, atol=1e-7)
    for b, ref in ((None, ref_y), (beta, ref_y + beta.double())):
        y, _, total = torch.ops._C_ascend.npu_add_rms_norm_bias(x1, x2, gamma, b, 1e-6)
        torch.testing.assert_close(y.double(), ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(total.double(), x1.double() + x2.double(), rtol=1e-7, atol=1e-7)


@pytest.mark.parametrize("call, message", [
    (lambda t: t.npu_rms_norm(torch.randn(2, 8), torch.randn(4)), "trailing dims"),
    (lambda t: t.npu_rms_norm(torch.randn(2, 8), torch.randn(8).half()), "must match"),
    (lambda t: t.npu_rms_norm(torch.randn(2, 8).double(), torch.randn(8).double()), "dtype float64"),
    (lambda t: t.npu_add_rms_norm(torch.randn(2, 8), torch.randn(3, 8), torch.randn(8)), "one shape"),
    (lambda t: torch.ops._C_ascend.npu_add_rms_norm_bias(torch.randn(2, 8).double(), torch.randn(2, 8).double(),
                                                          torch.randn(8).double(), None, 1e-6), "float64"),
    (lambda t: torch.ops._C_ascend.npu_add_rms_norm_bias(torch.randn(2, 8), torch.randn(2, 8),
                                                          torch.randn(8), torch.randn(4), 1e-6), "beta"),
])
def test_bad_input_is_refused_with_the_reason(torch_npu, call, message):
    with pytest.raises(ValueError, match=message):
        call(torch_npu)
