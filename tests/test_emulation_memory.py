"""The emulation's extra memory per call stays under its bound, whatever the
segment length: no score matrix or mask larger than a block is ever allocated."""
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from npu_shim import emulation
from npu_shim.emulation._engine import Band, attend_segment, memory_bound_bytes, plan_chunks
from npu_shim.testing import attention_f64

emulation.install()
import torch_npu  # noqa: E402


class LargestAllocation(TorchDispatchMode):
    """Largest tensor any aten op returns inside the block (views excluded)."""

    def __init__(self):
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not func._schema.is_mutable and "view" not in func.__name__ and func.__name__ not in (
                "alias", "t", "transpose", "permute", "expand", "slice", "select", "unsqueeze",
                "squeeze", "as_strided", "unflatten", "_unsafe_view", "detach", "lift_fresh"):
            for t in tree_flatten(out)[0]:
                if isinstance(t, torch.Tensor) and t.numel():
                    self.largest = max(self.largest, t.numel() * t.element_size())
        return out


@pytest.mark.parametrize("sq, skv, n, nkv, d, dv", [
    (1, 10 ** 6, 16, 16, 128, 128), (300_000, 3000, 16, 16, 128, 128), (5000, 5000, 8, 1, 64, 32)])
def test_plan_fits_the_bound(sq, skv, n, nkv, d, dv):
    bound = 256 << 20
    qc, kc = plan_chunks(sq, skv, n, nkv, d, dv, bound)
    kv_bytes = kc * nkv * (d + dv) * 4
    row_bytes = (3 * n * kc + n * (d + 4 * dv + 2)) * 4
    assert 1 <= qc <= sq and 1 <= kc <= skv
    assert kv_bytes + qc * row_bytes <= bound


def test_engine_stays_under_a_small_bound_on_a_long_causal_segment():
    s, n, d = 2000, 2, 16
    bound = 1 << 20
    q, k, v = torch.randn(s, n, d), torch.randn(s, n, d), torch.randn(s, n, d)
    out = torch.empty(s, n, d)
    with LargestAllocation() as probe:
        attend_segment(q, k, v, out, scale=0.25, masks=(Band(None, 0, 0),), bound=bound)
    naive_scores = s * s * n * 4
    assert probe.largest <= bound < naive_scores // 20
    torch.testing.assert_close(out.double(), attention_f64(q, k, v, [0, s], scale=0.25, causal=True),
                               atol=1e-4, rtol=1e-4)


@pytest.mark.float32_math   # "exact": float32 against float64
def test_op_under_a_tiny_bound_is_exact_and_never_builds_a_cross_segment_matrix(monkeypatch):
    monkeypatch.setenv("NPU_SHIM_EMULATE_MEMORY_MIB", "1")
    lengths = [1000, 1, 0, 2000]
    cum = [1000, 1001, 1001, 3001]
    t = cum[-1]
    q, k, v = torch.randn(t, 2, 16), torch.randn(t, 2, 16), torch.randn(t, 2, 16)
    with LargestAllocation() as probe:
        out = torch_npu.npu_fusion_attention(q, k, v, 2, "TND", scale=0.25,
                                             actual_seq_qlen=cum, actual_seq_kvlen=cum)[0]
    outputs = t * 2 * 16 * 4                       # attention_out
    assert probe.largest <= max(1 << 20, outputs)
    assert probe.largest < t * t // 8               # far below even a bool S x S mask
    torch.testing.assert_close(out.double(), attention_f64(q, k, v, [0] + cum, scale=0.25),
                               atol=1e-4, rtol=1e-4)
    assert sum(lengths) == t


def test_bound_setting_is_validated(monkeypatch):
    assert memory_bound_bytes() == 256 << 20
    monkeypatch.setenv("NPU_SHIM_EMULATE_MEMORY_MIB", "lots")
    with pytest.raises(ValueError, match="NPU_SHIM_EMULATE_MEMORY_MIB"):
        memory_bound_bytes()
