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


def test_gating_sigmoid_renorm_as_sglang_calls_it(torch_npu):
    """sglang's NPU router (fused_topk_npu) with a sigmoid router and a correction bias:
    ``renorm=renormalize`` (True), eps 1e-20; the weights are the chosen sigmoids over their sum,
    as with renorm=0 (the page's sigmoid formula divides by the sum)."""
    torch.manual_seed(7)
    x, bias = torch.randn(4, 8), torch.randn(8) * 0.1
    y, idx, _ = torch.ops.npu.npu_moe_gating_top_k(x, k=2, bias=bias, k_group=1, group_count=1,
                                                   group_select_mode=0, renorm=True, norm_type=1,
                                                   routed_scaling_factor=1, eps=1e-20)
    for t in range(4):
        sig = [1 / (1 + math.exp(-float(v))) for v in x[t]]
        best = sorted(range(8), key=lambda e: -(sig[e] + float(bias[e])))[:2]
        assert idx[t].tolist() == best
        total = sum(sig[e] for e in best)
        torch.testing.assert_close(y[t].double(), torch.tensor([sig[e] / total for e in best], dtype=torch.float64),
                                   rtol=1e-6, atol=1e-7)


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


def test_grouped_matmul_output_dtype_as_sglang_passes_it(torch_npu):
    """sglang's NPU MoE runner passes ``output_dtype`` (bfloat16 for bfloat16 x): the page's
    non-quantised row, the result in x's own dtype, equal to the call without it."""
    torch.manual_seed(3)
    x, w = torch.randn(4, 8).bfloat16(), torch.randn(2, 8, 6).bfloat16()
    out = torch.ops.npu.npu_grouped_matmul(x=[x], weight=[w], split_item=2, group_list_type=1, group_type=0,
                                           group_list=torch.tensor([3, 1]), output_dtype=torch.bfloat16)[0]
    assert out.dtype == torch.bfloat16
    ref = torch.cat([x[:3].double() @ w[0].double(), x[3:].double() @ w[1].double()])
    torch.testing.assert_close(out.double(), ref, rtol=2e-2, atol=2e-2)
    # float32 stands in for bfloat16 inside the math-check switch only (outside it: refused, below)
    from npu_shim.emulation import dtypes

    with dtypes.float32_not_on_hardware():
        out32 = torch.ops.npu.npu_grouped_matmul(x=[x.float()], weight=[w.float()], split_item=2, group_list_type=1,
                                                 group_type=0, group_list=torch.tensor([3, 1]),
                                                 output_dtype=torch.bfloat16)[0]
    assert out32.dtype == torch.float32
    torch.testing.assert_close(out32.double(), ref, rtol=1e-5, atol=1e-5)


def test_finalize_routing_after_init_routing_v2(torch_npu):
    """sglang's NPU combine: ``npu_moe_init_routing_v2`` (quant_mode -1), the experts, then
    ``npu_moe_finalize_routing(..., drop_pad_mode=2)``. With each expert the identity plus its bias
    row, out[i] = sum_k scales[i, k] * (x[i] + bias[e_ik]) in float64; drop_pad_mode 0 takes the
    same index laid out by choice (i + k * NUM_ROWS) and gives the same."""
    torch.manual_seed(11)
    rows, k, experts, hidden = 5, 2, 4, 6
    x, bias = torch.randn(rows, hidden), torch.randn(experts, hidden)
    expert_idx = torch.stack([torch.randperm(experts)[:k] for _ in range(rows)]).to(torch.int32)
    scales = torch.rand(rows, k)
    expanded_x, expanded_row_idx, _, _ = torch.ops.npu.npu_moe_init_routing_v2(
        x, expert_idx, active_num=rows * k, expert_num=experts, expert_tokens_num_type=1,
        expert_tokens_num_flag=True, active_expert_range=[0, experts], quant_mode=-1)
    ref = torch.zeros(rows, hidden, dtype=torch.float64)
    for i in range(rows):
        for j in range(k):
            ref[i] += float(scales[i, j]) * (x[i].double() + bias[int(expert_idx[i, j])].double())
    out = torch.ops.npu.npu_moe_finalize_routing(expanded_x, skip1=None, skip2=None, bias=bias, scales=scales,
                                                 expanded_src_to_dst_row=expanded_row_idx,
                                                 export_for_source_row=expert_idx, drop_pad_mode=2)
    torch.testing.assert_close(out.double(), ref, rtol=1e-5, atol=1e-5)
    by_choice = expanded_row_idx.reshape(rows, k).t().reshape(-1).contiguous()
    out0 = torch_npu.npu_moe_finalize_routing(expanded_x, None, None, bias, scales, by_choice, expert_idx, 0)
    torch.testing.assert_close(out0.double(), ref, rtol=1e-5, atol=1e-5)
    # the row layout read as the choice layout mixes the rows' choices
    wrong = torch_npu.npu_moe_finalize_routing(expanded_x, None, None, bias, scales, expanded_row_idx, expert_idx, 0)
    assert (wrong.double() - ref).abs().max() > 1e-2


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
    (lambda t: t.npu_moe_gating_top_k(torch.randn(2, 8), k=2, renorm=1, norm_type=0), NotImplementedError, "renorm"),
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
    (lambda t: t.npu_grouped_matmul([torch.randn(3, 2)], [torch.randn(1, 2, 2)], group_list=torch.tensor([3]),
                                    split_item=2, group_type=0, group_list_type=1, output_dtype=torch.bfloat16),
     NotImplementedError, "output_dtype"),
    (lambda t: t.npu_moe_finalize_routing(torch.randn(4, 3), None, None, None, torch.rand(2, 2),
                                          torch.arange(4, dtype=torch.int32), None, drop_pad_mode=1),
     NotImplementedError, "drop_pad_mode"),
    (lambda t: t.npu_moe_finalize_routing(torch.randn(4, 3), None, None, None, torch.rand(2, 2),
                                          torch.tensor([0, 1, 2, 7], dtype=torch.int32), None, drop_pad_mode=2),
     ValueError, "outside"),
    (lambda t: t.npu_moe_token_unpermute(torch.randn(4, 2), torch.tensor([0, 1, 2, 9], dtype=torch.int32)),
     ValueError, "outside permuted_tokens"),
])
def test_bad_input_is_refused_with_the_reason(torch_npu, call, error, message):
    with pytest.raises(error, match=message):
        call(torch_npu)


def test_format_cast_keeps_the_values(torch_npu):
    """sglang casts each unquantised MoE weight to FRACTAL_NZ after loading
    (``torch.ops.npu.npu_format_cast(w, 29)``): the same logical values in a new tensor; a number that
    is no aclFormat, or the packed-FP4 unpacking, is refused."""
    w = torch.randn(3, 8, 4)
    for op in (torch_npu.npu_format_cast, torch.ops.npu.npu_format_cast):
        cast = op(w, 29)
        assert cast.dtype == w.dtype and torch.equal(cast, w) and cast.data_ptr() != w.data_ptr()
    with pytest.raises(ValueError, match="acl_format 28 is not an aclFormat"):
        torch_npu.npu_format_cast(w, 28)
    with pytest.raises(NotImplementedError, match="packed-FP4"):
        torch.ops.npu.npu_format_cast(w, 29, customize_dtype=torch.float8_e4m3fn)
