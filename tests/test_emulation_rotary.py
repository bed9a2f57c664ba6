"""The emulated rotary ops (npu_shim/emulation/rotary.py) against a float64 reference written
from the definition of rotary embedding: each pair (a, b) of a head is rotated by angle
theta, (a, b) -> (a cos - b sin, b cos + a sin); neox ("half") pairs i with i + R/2,
GPT-J ("interleave") pairs 2i with 2i + 1. M-RoPE takes frequency i's angle from the
position row its section names (t, h, w)."""
import math

import pytest
import torch


@pytest.fixture(scope="module")
def torch_npu():
    from npu_shim import emulation

    emulation.install()
    import torch_npu

    return torch_npu


def _pairs(rot, mode):
    half = rot // 2
    if mode == "quarter":       # neox pairs within each half: (i, i + R/4) and (R/2 + i, R/2 + i + R/4)
        quarter = rot // 4
        return [(i, i + quarter) for i in range(quarter)] + [(half + i, half + i + quarter) for i in range(quarter)]
    return [(i, i + half) if mode == "half" else (2 * i, 2 * i + 1) for i in range(half)]


def _rotate_f64(vec, angles, mode, rot):
    """vec: 1-D float64 head; angles[i]: the angle of frequency i; dims >= rot pass through."""
    out = vec.clone()
    for i, (a, b) in enumerate(_pairs(rot, mode)):
        c, s = math.cos(angles[i]), math.sin(angles[i])
        out[a] = vec[a] * c - vec[b] * s
        out[b] = vec[b] * c + vec[a] * s
    return out


def _cache(max_pos, rot, base=10000.0):
    inv = [base ** (-2.0 * i / rot) for i in range(rot // 2)]
    angles = [[p * f for f in inv] for p in range(max_pos)]
    cos = torch.tensor([[math.cos(a) for a in row] for row in angles], dtype=torch.float64)
    sin = torch.tensor([[math.sin(a) for a in row] for row in angles], dtype=torch.float64)
    return torch.cat((cos, sin), dim=-1), angles


@pytest.mark.parametrize("mode", ["half", "interleave"])
def test_rotary_mul_rotates_pairs(torch_npu, mode):
    torch.manual_seed(0)
    s, n, d = 5, 3, 8
    x = torch.randn(1, s, n, d)
    angles = torch.rand(s, d // 2).double() * 6
    if mode == "half":
        cos = torch.cat((angles.cos(), angles.cos()), -1)
        sin = torch.cat((angles.sin(), angles.sin()), -1)
    else:
        cos, sin = angles.cos().repeat_interleave(2, -1), angles.sin().repeat_interleave(2, -1)
    r1, r2 = cos.float().reshape(1, s, 1, d), sin.float().reshape(1, s, 1, d)
    expected = torch.stack([torch.stack([_rotate_f64(x[0, t, h].double(), angles[t].tolist(), mode, d)
                                         for h in range(n)]) for t in range(s)])[None]
    for op in (torch_npu.npu_rotary_mul, torch.ops.npu.npu_rotary_mul):
        out = op(x, r1, r2, rotary_mode=mode)
        torch.testing.assert_close(out.double(), expected, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode, rot", [("half", 8), ("half", 4), ("interleave", 8)])
def test_mrope_one_dim_positions(torch_npu, mode, rot):
    torch.manual_seed(1)
    t, d, nq, nk = 6, 8, 4, 2
    cache, angles = _cache(32, rot)
    positions = torch.tensor([0, 3, 7, 1, 31, 12])
    q, k = torch.randn(t, nq * d), torch.randn(t, nk * d)
    for op in (torch_npu.npu_mrope, torch.ops.npu.npu_mrope):
        qo, ko = op(positions, q, k, cache.float(), d, mrope_section=[0, 0, 0], rotary_mode=mode)
        for x, out, n in ((q, qo, nq), (k, ko, nk)):
            for i in range(t):
                for h in range(n):
                    ref = _rotate_f64(x[i, h * d:(h + 1) * d].double(), angles[int(positions[i])], mode, rot)
                    torch.testing.assert_close(out[i, h * d:(h + 1) * d].double(), ref, rtol=1e-6, atol=1e-6)


def test_mrope_three_rows_take_their_sections(torch_npu):
    torch.manual_seed(2)
    t, d, rot, section = 4, 16, 16, [2, 3, 3]
    cache, angles = _cache(64, rot)
    positions = torch.tensor([[0, 5, 9, 40], [1, 2, 30, 4], [63, 0, 8, 8]])
    q, k = torch.randn(t, 2 * d), torch.randn(t, d)
    owner = [0] * section[0] + [1] * section[1] + [2] * section[2]
    qo, ko = torch_npu.npu_mrope(positions, q, k, cache.float(), d, mrope_section=section)
    for x, out in ((q, qo), (k, ko)):
        for i in range(t):
            theta = [angles[int(positions[owner[f], i])][f] for f in range(rot // 2)]
            for h in range(x.shape[1] // d):
                ref = _rotate_f64(x[i, h * d:(h + 1) * d].double(), theta, "half", rot)
                torch.testing.assert_close(out[i, h * d:(h + 1) * d].double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("neox, mode", [(True, "half"), (False, "interleave")])
def test_rotary_embedding_in_place(torch_npu, neox, mode):
    """vllm-ascend 0.18's in-place rotary: every head of query and key, in place."""
    torch.manual_seed(3)
    t, d, nq, nk = 4, 8, 3, 1
    cache, angles = _cache(16, d)
    positions = torch.tensor([0, 9, 2, 15])
    q, k = torch.randn(t, nq * d), torch.randn(t, nk * d)
    for op in (torch_npu._npu_rotary_embedding, torch.ops.npu._npu_rotary_embedding):
        qi, ki = q.clone(), k.clone()
        assert op(positions, qi, ki, d, cache.float(), neox) is None
        for x, out, n in ((q, qi, nq), (k, ki, nk)):
            for i in range(t):
                for h in range(n):
                    ref = _rotate_f64(x[i, h * d:(h + 1) * d].double(), angles[int(positions[i])], mode, d)
                    torch.testing.assert_close(out[i, h * d:(h + 1) * d].double(), ref, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("mode", ["half", "quarter", "interleave"])
def test_apply_rotary_pos_emb_in_place(torch_npu, mode):
    """vllm-ascend's 310P M-RoPE: query and key (BSND) rotated in place and returned, cos/sin
    (1, S, 1, D) taken per element (the frequency of each pair from the element's own cos/sin)."""
    torch.manual_seed(4)
    s, nq, nk, d = 5, 3, 1, 16
    pairs = _pairs(d, mode)
    angles = torch.rand(s, d // 2).double() * 6
    cos, sin = torch.zeros(s, d, dtype=torch.float64), torch.zeros(s, d, dtype=torch.float64)
    for f, (a, b) in enumerate(pairs):      # each pair's two elements carry its angle
        cos[:, a] = cos[:, b] = angles[:, f].cos()
        sin[:, a] = sin[:, b] = angles[:, f].sin()
    q, k = torch.randn(1, s, nq, d), torch.randn(1, s, nk, d)
    for op in (torch_npu.npu_apply_rotary_pos_emb, torch.ops.npu.npu_apply_rotary_pos_emb):
        qi, ki = q.clone(), k.clone()
        qo, ko = op(qi, ki, cos.float()[None, :, None], sin.float()[None, :, None], rotary_mode=mode)
        assert qo.data_ptr() == qi.data_ptr() and ko.data_ptr() == ki.data_ptr()   # in place, returned
        for x, out, n in ((q, qi, nq), (k, ki, nk)):
            for t in range(s):
                for h in range(n):
                    ref = x[0, t, h].double().clone()
                    for f, (a, b) in enumerate(pairs):
                        c, sn = math.cos(angles[t, f]), math.sin(angles[t, f])
                        ref[a] = x[0, t, h, a] * c - x[0, t, h, b] * sn
                        ref[b] = x[0, t, h, b] * c + x[0, t, h, a] * sn
                    torch.testing.assert_close(out[0, t, h].double(), ref, rtol=1e-6, atol=1e-6)


def test_apply_rotary_pos_emb_takes_no_bfloat16_on_310p(torch_npu, monkeypatch):
    """aclnnApplyRotaryPosEmb: BFLOAT16 only on Atlas A2/A3, not on Atlas inference products (310P)."""
    monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", "Ascend310P3")
    x = torch.randn(1, 2, 1, 8, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="bfloat16.*310P"):
        torch_npu.npu_apply_rotary_pos_emb(x, x.clone(), x.clone(), x.clone())


@pytest.mark.parametrize("call, error, message", [
    (lambda t: t.npu_apply_rotary_pos_emb(*[torch.randn(1, 2, 1, 8) for _ in range(4)], layout="TND"),
     ValueError, "layout"),
    (lambda t: t.npu_apply_rotary_pos_emb(*[torch.randn(1, 2, 1, 8) for _ in range(4)], rotary_mode="neox"),
     ValueError, "rotary_mode"),
    (lambda t: t.npu_apply_rotary_pos_emb(torch.randn(1, 2, 1, 8), torch.randn(1, 2, 1, 8),
                                          torch.randn(1, 3, 1, 8), torch.randn(1, 3, 1, 8)),
     ValueError, "broadcast"),
    (lambda t: t.npu_rotary_mul(torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4), torch.randn(1, 2, 1, 4),
                                rotary_mode="interleaved"), ValueError, "rotary_mode"),
    (lambda t: t.npu_mrope(torch.arange(2), torch.randn(2, 8), torch.randn(2, 8), torch.randn(4, 8), 8,
                           rotary_mode="interleaved"), ValueError, "rotary_mode"),
    (lambda t: t.npu_mrope(torch.arange(2), torch.randn(2, 8), torch.randn(2, 8), torch.randn(4, 8), 8,
                           cache_mode="interleave"), NotImplementedError, "cache_mode"),
    (lambda t: t.npu_mrope(torch.tensor([0, 4]), torch.randn(2, 8), torch.randn(2, 8), torch.randn(4, 8), 8),
     ValueError, "outside cos_sin_cache"),
    (lambda t: t.npu_mrope(torch.zeros(3, 2, dtype=torch.long), torch.randn(2, 8), torch.randn(2, 8),
                           torch.randn(4, 8), 8, mrope_section=[1, 1, 1]), ValueError, "sum"),
    (lambda t: t.npu_mrope(torch.arange(2), torch.randn(2, 7), torch.randn(2, 8), torch.randn(4, 8), 8),
     ValueError, "query"),
])
def test_bad_input_is_refused_with_the_reason(torch_npu, call, error, message):
    with pytest.raises(error, match=message):
        call(torch_npu)
