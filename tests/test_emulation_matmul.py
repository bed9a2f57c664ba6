"""The emulated ``torch_npu._npu_matmul_add_fp32`` (npu_shim/emulation/matmul.py) against a float64
reference written from the definition (op-plugin LinearAtb.cpp: LinearOperation, transposeA, enAccum):
C += x^T @ weight, in place, accumulated in float32."""
import pytest
import torch

from npu_shim import emulation

emulation.install()
import torch_npu  # noqa: E402


def _reference(x, weight, c):
    x, weight, c = x.double(), weight.double(), c.double()
    out = c.clone()
    for i in range(c.shape[0]):
        for j in range(c.shape[1]):
            out[i, j] += sum(float(x[r, i]) * float(weight[r, j]) for r in range(x.shape[0]))
    return out


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_matmul_add_fp32_accumulates_in_place(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, generator=g).to(dtype)
    weight = torch.randn(5, 4, generator=g).to(dtype)
    c = torch.randn(3, 4, generator=g)
    want = _reference(x, weight, c)
    for op in (torch_npu._npu_matmul_add_fp32, torch.ops.npu._npu_matmul_add_fp32):
        got = c.clone()
        assert op(x, weight, got) is None
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), want, rtol=0, atol=1e-5)


def test_matmul_add_fp32_refusals():
    x, w = torch.randn(2, 4).half(), torch.randn(2, 4).half()
    with pytest.raises(ValueError, match="C must be float32"):
        torch_npu._npu_matmul_add_fp32(x, w, torch.zeros(4, 4).half())
    with pytest.raises(ValueError, match="do not agree"):
        torch_npu._npu_matmul_add_fp32(x, w, torch.zeros(3, 4))
    with pytest.raises(ValueError, match="dtype float32"):
        torch_npu._npu_matmul_add_fp32(x.float(), w.float(), torch.zeros(4, 4))
