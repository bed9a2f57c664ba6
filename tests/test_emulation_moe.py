"""The emulated MoE ops (npu_shim/emulation/moe.py) against references written from their
documented definitions, and the four chained as vllm-ascend's all-gather MoE path chains them
(gating -> init_routing_v2 -> grouped matmul, swiglu, grouped matmul -> token_unpermute)
against a float64 per-token MoE: out_t = sum_j w_tj * W2[e_tj]^T swiglu(W13[e_tj]^T x_t)."""
import math

import pytest
import torch


@pytest.fixture(scope="module")
def torch_npu():
    from npu_shim import emulation

    emulation.install()
    import torch_npu

    return torch_npu


def _softmax_row(row):
    m = max(row)
    e = [math.exp(v - m) for v in row]
    return [v / sum(e) for v in e]


def test_gating_softmax_picks_the_top_experts(torch_npu):
    torch.manual_seed(0)
    x = torch.randn(5, 8)
    for op in (torch_npu.npu_moe_gating_top_k, torch.ops.npu.npu_moe_gating_top_k):
        y, idx, _ = op(x, k=2, norm_type=0)
        assert idx.dtype == torch.int32
        for t in range(5):
            probs = _softmax_row([float(v) for v in x[t]])
            best = sorted(range(8), key=lambda e: -probs[e])[:2]
            assert idx[t].tolist() == best
            torch.testing.assert_close(y[t].double(), torch.tensor([probs[e] for e in best], dtype=torch.float64),
                                       rtol=1e-6, atol=1e-7)


def test_gating_sigmoid_groups_bias_and_scaling(torch_npu):
    torch.manual_seed(1)
    x, bias = torch.randn(3, 16), torch.randn(16) * 0.1
    y, idx, _ = torch_npu.npu_moe_gating_top_k(x, k=3, bias=bias, k_group=2, group_count=4,
                                               group_select_mode=1, norm_type=1,
                                               routed_scaling_factor=2.5, eps=1e-20)
    for t in range(3):
        sig = [1 / (1 + math.exp(-float(v))) for v in x[t]]
        val = [s + float(b) for s, b in zip(sig, bias)]
        score = [sum(sorted(val[g * 4:(g + 1) * 4])[-2:]) for g in range(4)]
        groups = sorted(range(4), key=lambda g: -score[g])[:2]
        allowed = [e for e in range(16) if e // 4 in groups]
        best = sorted(allowed, key=lambda e: -val[e])[:3]
        assert idx[t].tolist() == best
        total = sum(sig[e] for e in best)
        torch.testing.assert_close(y[t].double(), torch.tensor([sig[e] / total * 2.5 for e in best],
                                                               dtype=torch.float64), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("norm_type", [0, 1])
def test_c_ascend_gating_renorm_and_scaling(torch_npu, norm_type):
    """vllm-ascend's own kernel, called as BaseDeviceAdaptor.moe_gating_top_k calls it
    (keywords; renorm = int(renormalize)): renorm=1 divides the chosen weights by their sum
    (+ eps), then routed_scaling_factor multiplies them; out_flag returns normOut."""
    torch.manual_seed(5)
    x = torch.randn(4, 8)
    y, idx, out = torch.ops._C_ascend.moe_gating_top_k(
        x, k=3, k_group=1, group_count=1, group_select_mode=1, renorm=1, norm_type=norm_type,
        out_flag=True, routed_scaling_factor=1.5, eps=1e-20, bias_opt=None)
    assert idx.dtype == torch.int32 and out.shape == (4, 8) and out.dtype == torch.float32
    for t in range(4):
        row = [float(v) for v in x[t]]
        norm = _softmax_row(row) if norm_type == 0 else [1 / (1 + math.exp(-v)) for v in row]
        best = sorted(range(8), key=lambda e: -norm[e])[:3]
        assert idx[t].tolist() == best
        total = sum(norm[e] for e in best)
        torch.testing.assert_close(y[t].double(), torch.tensor([norm[e] / total * 1.5 for e in best],
                                                               dtype=torch.float64), rtol=1e-6, atol=1e-7)
        torch.testing.assert_close(out[t].double(), torch.tensor(norm, dtype=torch.float64), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("mode, group", [(0, 0), (1, 1)])
def test_gating_group_select_mode(torch_npu, mode, group):
    """Group 0 has the single best expert, group 1 the best pair: mode 0 (max) keeps group 0,
    mode 1 (sum of the top two) keeps group 1."""
    x = torch.tensor([[3.0, -5.0, -5.0, -5.0, 1.5, 1.5, -5.0, -5.0]])
    _, idx, _ = torch_npu.npu_moe_gating_top_k(x, k=2, k_group=1, group_count=2, group_select_mode=mode,
                                               norm_type=1)
    assert all(e // 4 == group for e in idx[0].tolist()), idx


def test_init_routing_v2_sorts_rows_by_expert(torch_npu):
    x = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    expert_idx = torch.tensor([[1, 2], [0, 1], [0, 2]], dtype=torch.int32)
    # and vllm-ascend's own build of the kernel (torch.ops._C_ascend, vllm-ascend 0.18's MoE calls it)
    for op in (torch_npu.npu_moe_init_routing_v2, torch.ops.npu.npu_moe_init_routing_v2,
               torch.ops._C_ascend.npu_moe_init_routing_custom):
        ex, row_idx, tokens, _ = op(x, expert_idx, active_num=6, expert_num=3, expert_tokens_num_type=1,
                                    expert_tokens_num_flag=True, active_expert_range=[0, 3], quant_mode=-1)
        # flattened (token, j) rows 0..5 hold experts 1,2,0,1,0,2; stable sort: rows 2,4,0,3,1,5
        assert row_idx.tolist() == [2, 4, 0, 3, 1, 5] and row_idx.dtype == torch.int32
        assert torch.equal(ex, x[[1, 2, 0, 1, 0, 2]])
        assert tokens.tolist() == [2, 2, 2]
        _, _, cumsum, _ = op(x, expert_idx, active_num=6, expert_num=3, expert_tokens_num_type=0,
                             active_expert_range=[0, 3], quant_mode=-1)
        assert cumsum.tolist() == [2, 4, 6]


def test_grouped_matmul_splits_rows_by_group(torch_npu):
    torch.manual_seed(2)
    x, w, b = torch.randn(7, 5), torch.randn(3, 5, 4), torch.randn(3, 4)
    for op in (torch_npu.npu_grouped_matmul, torch.ops.npu.npu_grouped_matmul):
        for glist, gtype in (([2, 0, 4], 1), ([2, 2, 6], 0)):
            out = op([x], [w], bias=[b], group_list=torch.tensor(glist), split_item=2, group_type=0,
                     group_list_type=gtype)[0]
            owner = [0, 0, 2, 2, 2, 2, None]
            for r in range(7):
                if owner[r] is None:
                    assert out[r].abs().sum() == 0
                    continue
                ref = [sum(float(x[r, i]) * float(w[owner[r], i, c]) for i in range(5)) + float(b[owner[r], c])
                       for c in range(4)]
                torch.testing.assert_close(out[r].double(), torch.tensor(ref, dtype=torch.float64),
                                           rtol=1e-5, atol=1e-5)


def test_token_unpermute_gathers_and_weights(torch_npu):
    torch.manual_seed(3)
    permuted, probs = torch.randn(6, 3), torch.rand(3, 2)
    sorted_indices = torch.tensor([2, 4, 0, 3, 1, 5], dtype=torch.int32)
    for op in (torch_npu.npu_moe_token_unpermute, torch.ops.npu.npu_moe_token_unpermute):
        out = op(permuted, sorted_indices, probs)
        for i in range(3):
            ref = sum(permuted[int(sorted_indices[i * 2 + j])].double() * float(probs[i, j]) for j in range(2))
            torch.testing.assert_close(out[i].double(), ref, rtol=1e-6, atol=1e-6)


def test_the_chain_vllm_ascend_runs_equals_a_float64_moe(torch_npu):
    """gating -> init_routing_v2 -> gmm -> swiglu -> gmm -> unpermute, with the arguments
    vllm-ascend 0.30's all-gather path passes (see docs/emulation-ops.md)."""
    torch.manual_seed(4)
    tokens, hidden, inter, experts, top_k = 5, 6, 4, 4, 2
    x = torch.randn(tokens, hidden)
    logits = torch.randn(tokens, experts)
    w13 = torch.randn(experts, hidden, 2 * inter) * 0.5     # (E, K, N), as apply_gmm1 passes it
    w2 = torch.randn(experts, inter, hidden) * 0.5
    # BaseDeviceAdaptor.moe_gating_top_k (A2/A3) with a softmax router and renormalize=True
    weights, ids, _ = torch.ops._C_ascend.moe_gating_top_k(
        logits, k=top_k, k_group=1, group_count=1, group_select_mode=1, renorm=1, norm_type=0,
        out_flag=False, routed_scaling_factor=1.0, eps=1e-20, bias_opt=None)
    sorted_x, row_idx, counts, _ = torch_npu.npu_moe_init_routing_v2(
        x, ids, scale=None, active_num=tokens * top_k, expert_num=experts, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, active_expert_range=[0, experts], quant_mode=-1)
    gate_up = torch_npu.npu_grouped_matmul(x=[sorted_x], weight=[w13], bias=None, split_item=2,
                                           group_list_type=1, group_type=0, group_list=counts)[0]
    act = torch_npu.npu_swiglu(gate_up)
    down = torch_npu.npu_grouped_matmul(x=[act], weight=[w2], bias=None, split_item=2,
                                        group_list_type=1, group_type=0, group_list=counts)[0]
    out = torch_npu.npu_moe_token_unpermute(permuted_tokens=down, sorted_indices=torch.abs(row_idx),
                                            probs=weights.to(down.dtype))
    for t in range(tokens):
        probs = _softmax_row([float(v) for v in logits[t]])
        best = sorted(range(experts), key=lambda e: -probs[e])[:top_k]
        norm = sum(probs[e] for e in best)
        ref = torch.zeros(hidden, dtype=torch.float64)
        for e in best:
            h = x[t].double() @ w13[e].double()
            a, b = h[:inter], h[inter:]
            ref += probs[e] / norm * ((a * torch.sigmoid(a) * b) @ w2[e].double())
        torch.testing.assert_close(out[t].double(), ref, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("call, error, message", [
    (lambda t: t.npu_moe_gating_top_k(torch.randn(2, 8), k=9), ValueError, "k=9"),
    (lambda t: t.npu_moe_gating_top_k(torch.randn(2, 8), k=2, renorm=1), NotImplementedError, "renorm"),
    (lambda t: torch.ops._C_ascend.moe_gating_top_k(torch.randn(2, 8), 2, 1, 1, 0, 2, 0, False, 1.0, 1e-20),
     ValueError, "renorm must be 0 or 1"),
    (lambda t: torch.ops._C_ascend.moe_gating_top_k(torch.randn(2, 8), 2, 3, 2, 0, 0, 0, False, 1.0, 1e-20),
     ValueError, "k_group"),
    (lambda t: t.npu_moe_init_routing_v2(torch.randn(2, 4), torch.tensor([[0], [5]], dtype=torch.int32),
                                         active_num=2, expert_num=6, active_expert_range=[0, 3], quant_mode=-1),
     NotImplementedError, "outside active_expert_range"),
    (lambda t: t.npu_moe_init_routing_v2(torch.randn(2, 4), torch.tensor([[0], [1]], dtype=torch.int32),
                                         expert_num=2, quant_mode=1), NotImplementedError, "quant_mode"),
    (lambda t: t.npu_grouped_matmul([torch.randn(3, 2)], [torch.randn(2, 2, 2)], group_list=torch.tensor([2, 2]),
                                    split_item=2, group_type=0, group_list_type=1), ValueError, "does not split"),
    (lambda t: t.npu_moe_token_unpermute(torch.randn(4, 2), torch.tensor([0, 1, 2, 9], dtype=torch.int32)),
     ValueError, "outside permuted_tokens"),
])
def test_bad_input_is_refused_with_the_reason(torch_npu, call, error, message):
    with pytest.raises(error, match=message):
        call(torch_npu)
