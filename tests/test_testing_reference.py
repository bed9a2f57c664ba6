"""The float64 reference against hand-derived cases and torch's own SDPA (an
implementation independent of both the reference and the emulation)."""
import math

import pytest
import torch

from npu_shim.testing import attention_f64, dense_segments


def test_single_key_returns_its_value():
    q = torch.randn(3, 2, 4)
    k = torch.randn(1, 2, 4)
    v = torch.randn(1, 2, 5)
    out = attention_f64(q, k, v, [0, 3], [0, 1])
    assert torch.equal(out, v.double().expand(3, 2, 5))


def test_equal_scores_average_the_values():
    q = torch.zeros(1, 1, 4)
    k = torch.randn(6, 1, 4)
    v = torch.randn(6, 1, 3)
    out, lse = attention_f64(q, k, v, [0, 1], [0, 6], return_lse=True)
    assert torch.allclose(out[0, 0], v[:, 0].double().mean(0), atol=1e-12)
    assert lse[0, 0].item() == pytest.approx(math.log(6))


def test_two_keys_by_hand():
    q = torch.tensor([[[1.0, 0.0]]])
    k = torch.tensor([[[1.0, 0.0]], [[0.0, 1.0]]])
    v = torch.tensor([[[10.0]], [[20.0]]])
    out = attention_f64(q, k, v, [0, 1], [0, 2], scale=2.0)
    w = math.exp(2.0) / (math.exp(2.0) + 1.0)
    assert out.item() == pytest.approx(10 * w + 20 * (1 - w), rel=1e-12)


def test_causal_is_aligned_to_the_end():
    # 2 queries, 5 keys: query 0 sees keys 0..3, query 1 sees 0..4
    q = torch.zeros(2, 1, 2)
    k = torch.zeros(5, 1, 2)
    v = torch.arange(5, dtype=torch.float64).reshape(5, 1, 1)
    out = attention_f64(q, k, v, [0, 2], [0, 5], causal=True)
    assert out[0, 0, 0].item() == pytest.approx(1.5)
    assert out[1, 0, 0].item() == pytest.approx(2.0)


def test_rows_that_see_nothing_are_zero():
    q = torch.randn(4, 1, 2)
    k = torch.randn(2, 1, 2)
    v = torch.randn(2, 1, 3)
    out, lse = attention_f64(q, k, v, [0, 4], [0, 2], causal=True, return_lse=True)
    assert torch.equal(out[:2], torch.zeros(2, 1, 3, dtype=torch.float64))
    assert torch.isinf(lse[:2]).all() and torch.isfinite(lse[2:]).all()


@pytest.mark.parametrize("group", [1, 2, 4])
def test_matches_sdpa_per_segment_with_gqa(group):
    torch.manual_seed(0)
    lengths = [3, 0, 17, 1, 9]
    cu = dense_segments(lengths)
    nkv, d = 2, 8
    n = nkv * group
    q = torch.randn(cu[-1], n, d, dtype=torch.float64)
    k = torch.randn(cu[-1], nkv, d, dtype=torch.float64)
    v = torch.randn(cu[-1], nkv, 5, dtype=torch.float64)
    out = attention_f64(q, k, v, cu, scale=0.3)
    for a, b in zip(cu, cu[1:]):
        if a == b:
            continue
        kk = k[a:b].repeat_interleave(group, dim=1).transpose(0, 1)
        vv = v[a:b].repeat_interleave(group, dim=1).transpose(0, 1)
        want = torch.nn.functional.scaled_dot_product_attention(
            q[a:b].transpose(0, 1), kk, vv, scale=0.3).transpose(0, 1)
        assert torch.allclose(out[a:b], want, atol=1e-12)


def test_allowed_callable_per_head():
    torch.manual_seed(1)
    q = torch.randn(4, 2, 3, dtype=torch.float64)
    k = torch.randn(4, 2, 3, dtype=torch.float64)
    v = torch.randn(4, 2, 2, dtype=torch.float64)
    only_first = torch.zeros(2, 4, 4, dtype=torch.bool)
    only_first[0, :, 0] = True   # head 0: key 0 only
    only_first[1] = True         # head 1: everything
    out = attention_f64(q, k, v, [0, 4], allowed=lambda s, sq, skv: only_first)
    assert torch.allclose(out[:, 0], v[0, 0].expand(4, 2))
    full = attention_f64(q, k, v, [0, 4])
    assert torch.allclose(out[:, 1], full[:, 1])


def test_rejects_bad_boundaries():
    q = torch.randn(3, 1, 2)
    with pytest.raises(ValueError):
        attention_f64(q, q, q, [1, 3])
    with pytest.raises(ValueError):
        attention_f64(q, q, q, [0, 2, 1])
