"""The emulated ``torch_npu.npu_swiglu`` (npu_shim/emulation/activation.py) against a float64
reference written from the definition: out = A * sigmoid(A) * B, A and B the halves of x."""
import math

import pytest
import torch


@pytest.fixture(scope="module")
def torch_npu():
    from npu_shim import emulation

    emulation.install()
    import torch_npu

    return torch_npu


def _swiglu_f64(x, dim=-1):
    x = x.double().movedim(dim, -1)
    half = x.shape[-1] // 2
    flat = x.reshape(-1, x.shape[-1])
    out = torch.empty(flat.shape[0], half, dtype=torch.float64)
    for r in range(flat.shape[0]):
        for i in range(half):
            a, b = float(flat[r, i]), float(flat[r, half + i])
            out[r, i] = a / (1.0 + math.exp(-a)) * b
    return out.reshape(*x.shape[:-1], half).movedim(-1, dim)


def test_swiglu_both_spellings_and_dims(torch_npu):
    torch.manual_seed(0)
    x = torch.randn(3, 4, 10)
    for op in (torch_npu.npu_swiglu, torch.ops.npu.npu_swiglu):
        torch.testing.assert_close(op(x).double(), _swiglu_f64(x), rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(op(x, 1).double(), _swiglu_f64(x, 1), rtol=1e-6, atol=1e-6)


def test_swiglu_half_precision_rounds_once(torch_npu):
    torch.manual_seed(1)
    x = torch.randn(6, 16).half()
    out = torch_npu.npu_swiglu(x)
    assert out.dtype == torch.float16 and out.shape == (6, 8)
    torch.testing.assert_close(out, _swiglu_f64(x).half(), rtol=0, atol=0)


def test_odd_split_and_bad_dtype_are_refused(torch_npu):
    with pytest.raises(ValueError, match="odd size"):
        torch_npu.npu_swiglu(torch.randn(2, 5))
    with pytest.raises(ValueError, match="dtype int64"):
        torch_npu.npu_swiglu(torch.ones(2, 4, dtype=torch.long))
