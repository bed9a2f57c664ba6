"""vllm-ascend's own layer classes run on the emulated torch_npu ops (npu_shim/emulation:
norms, activation, rotary), compared with float64 references written from the definitions.

Each layer is built as the engine builds it (inside a vLLM config, from the module the platform
plugin registers it from) and its ``forward_oot`` -- the method the Ascend platform dispatches
to -- is called on CPU tensors:

* ``AscendRMSNorm``: ``npu_rms_norm`` without a residual, ``_C_ascend.npu_add_rms_norm_bias``
  with one. Stand-in: ``vllm_ascend.vllm_ascend_C`` (the compiled extension that registers
  ``torch.ops._C_ascend``, not built on CPU) is an empty module here; the emulation registers
  the op it would.
* ``AscendSiluAndMul``: ``npu_swiglu``.
* ``AscendRotaryEmbedding``: ``rope_forward_oot`` (what ``torch.ops.vllm.npu_rotary_embedding``
  runs; that op is registered for the PrivateUse1 key only, so CPU tensors call the function it
  wraps) and ``forward_oot`` with ``key=None``, both reaching ``npu_mrope`` with 1-D positions.
* ``AscendMRotaryEmbedding`` (Qwen2.5-VL's M-RoPE, section [16, 24, 24]): ``npu_mrope``.
* ``AscendApplyRotaryEmb`` (the vision towers' rotary): ``npu_rotary_mul``.
* MoE routing: ``AscendFusedTopKRouter`` -> ``_C_ascend.moe_gating_top_k``,
  ``TokenDispatcherWithAllGather`` -> ``npu_moe_init_routing_v2`` / ``npu_moe_token_unpermute``
  (the experts between them are a stand-in, see the test; ``npu_grouped_matmul`` and
  ``npu_swiglu`` are chained as ``apply_gmm1``/``apply_gmm2`` pass them in the base lane's
  tests/test_emulation_moe.py).

The reference never reads the layer's cos/sin cache: angles are position * base^(-2i/R) in
float64. Every emulated call is recorded, so a layer that took another path fails.
"""
import math
import sys
import types

import pytest
import torch

from npu_shim.testing import record_npu_calls

pytestmark = [pytest.mark.claimed("vllm.mimo_v2_v_head_dim", pinned={"vllm-ascend": ("0.30.0rc2",)}),
              pytest.mark.keeps_process_state]


@pytest.fixture(scope="module")
def ops():
    from npu_shim import emulation
    from npu_shim.testing.isolation import import_vllm_ascend_ops_module
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    emulation.install()
    emulation.register_device_module()
    mods = {name: import_vllm_ascend_ops_module(name) for name in ("layernorm", "activation", "rotary_embedding")}
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        yield mods


def _rms_f64(x, weight, eps):
    x = x.double()
    return x / torch.sqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight.double()


def _angles(positions, rot, base):
    return [[float(p) * base ** (-2.0 * i / rot) for i in range(rot // 2)] for p in positions]


def _rope_f64(x, heads, head_size, rot, angles_per_token):
    """neox pairs (i, i + rot/2) of each head rotated by angles_per_token[t][i]."""
    x = x.double().reshape(x.shape[0], heads, head_size).clone()
    out = x.clone()
    half = rot // 2
    for t, theta in enumerate(angles_per_token):
        c = torch.tensor([math.cos(a) for a in theta], dtype=torch.float64)
        s = torch.tensor([math.sin(a) for a in theta], dtype=torch.float64)
        a, b = x[t, :, :half], x[t, :, half:rot]
        out[t, :, :half] = a * c - b * s
        out[t, :, half:rot] = b * c + a * s
    return out.reshape(x.shape[0], -1)


def test_rms_norm_without_and_with_residual(ops, monkeypatch):
    torch.manual_seed(0)
    layer = ops["layernorm"].AscendRMSNorm(32, eps=1e-5)
    layer.weight.data.normal_()
    x, residual = torch.randn(4, 32), torch.randn(4, 32)
    with record_npu_calls() as calls:
        out = layer.forward_oot(x.clone())
    assert [c.name for c in calls] == ["npu_rms_norm"]
    torch.testing.assert_close(out.double(), _rms_f64(x, layer.weight, 1e-5), rtol=1e-6, atol=1e-6)

    monkeypatch.setitem(sys.modules, "vllm_ascend.vllm_ascend_C", types.ModuleType("vllm_ascend.vllm_ascend_C"))
    with record_npu_calls() as calls:
        out, new_residual = layer.forward_oot(x.clone(), residual.clone())
    assert [(c.name, c.spelling) for c in calls] == [("npu_add_rms_norm_bias", "torch.ops._C_ascend")]
    torch.testing.assert_close(new_residual.double(), x.double() + residual.double(), rtol=1e-7, atol=1e-7)
    torch.testing.assert_close(out.double(), _rms_f64(x.double() + residual.double(), layer.weight, 1e-5),
                               rtol=1e-6, atol=1e-6)


def test_silu_and_mul(ops):
    torch.manual_seed(1)
    x = torch.randn(5, 2 * 24)
    with record_npu_calls() as calls:
        out = ops["activation"].AscendSiluAndMul().forward_oot(x)
    assert [c.name for c in calls] == ["npu_swiglu"]
    a, b = x.double()[:, :24], x.double()[:, 24:]
    torch.testing.assert_close(out.double(), a / (1 + torch.exp(-a)) * b, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("rot", [64, 32])
def test_rotary_embedding_text_path(ops, rot):
    torch.manual_seed(2)
    rope = ops["rotary_embedding"]
    head_size, nq, nk, base = 64, 4, 2, 10000.0
    layer = rope.AscendRotaryEmbedding(head_size, rot, 256, base, True, torch.float32)
    positions = torch.tensor([0, 1, 7, 100, 255])
    q, k = torch.randn(5, nq * head_size), torch.randn(5, nk * head_size)
    theta = _angles(positions.tolist(), rot, base)
    with record_npu_calls() as calls:
        qo, ko = rope.rope_forward_oot(positions, q.clone(), k.clone(), layer.cos_sin_cache, head_size, rot, True)
        q_only, none = layer.forward_oot(positions, q.clone(), None)
    assert [c.name for c in calls] == ["npu_mrope", "npu_mrope"] and none is None
    torch.testing.assert_close(qo.double(), _rope_f64(q, nq, head_size, rot, theta), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko.double(), _rope_f64(k, nk, head_size, rot, theta), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(q_only.double(), _rope_f64(q, nq, head_size, rot, theta), rtol=1e-5, atol=1e-5)


def test_mrotary_embedding_qwen2_5_vl_sections(ops):
    torch.manual_seed(3)
    rope = ops["rotary_embedding"]
    head_size, section, base = 128, [16, 24, 24], 1000000.0
    layer = rope.AscendMRotaryEmbedding(head_size, head_size, 512, base, True, torch.float32,
                                        mrope_section=section)
    positions = torch.tensor([[0, 3, 3, 3, 9], [0, 1, 2, 1, 9], [0, 2, 0, 5, 9]])
    q, k = torch.randn(5, 2 * head_size), torch.randn(5, head_size)
    owner = [0] * 16 + [1] * 24 + [2] * 24
    theta = [[float(positions[owner[i], t]) * base ** (-2.0 * i / head_size) for i in range(64)]
             for t in range(5)]
    with record_npu_calls() as calls:
        qo, ko = layer.forward_oot(positions, q.clone(), k.clone())
    assert [c.name for c in calls] == ["npu_mrope"]
    torch.testing.assert_close(qo.double(), _rope_f64(q, 2, head_size, head_size, theta), rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ko.double(), _rope_f64(k, 1, head_size, head_size, theta), rtol=1e-5, atol=1e-5)


def test_apply_rotary_emb_vision_path(ops):
    torch.manual_seed(4)
    s, n, d = 6, 2, 16
    x = torch.randn(1, s, n, d)
    theta = torch.rand(s, d // 2).double() * 6
    layer = ops["rotary_embedding"].AscendApplyRotaryEmb(is_neox_style=True)
    with record_npu_calls() as calls:
        out = layer.forward_oot(x, theta.cos().float(), theta.sin().float())
    assert [c.name for c in calls] == ["npu_rotary_mul"]
    expected = _rope_f64(x[0].reshape(s, n * d), n, d, d, theta.tolist()).reshape(1, s, n, d)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-5)


def test_moe_router_dispatch_and_combine(ops):
    """vllm-ascend's MoE routing around the experts, on the A2/A3 adaptor: ``AscendFusedTopKRouter``
    (softmax, renormalize -> ``_C_ascend.moe_gating_top_k`` with renorm=1),
    ``TokenDispatcherWithAllGather.token_dispatch`` (``npu_moe_init_routing_v2``) and
    ``token_combine`` (``npu_moe_token_unpermute``). Stand-in: the experts between dispatch and
    combine are a per-expert scale (row r of group e times e + 1), applied with the dispatcher's
    own group_list; building ``AscendUnquantizedFusedMoEMethod`` needs vLLM's platform to be the
    Ascend one (out of tree), which this lane keeps off. Expected, from the definitions in
    float64: out_t = sum_j w_tj (e_tj + 1) x_t, with w the renormalised top-k softmax."""
    from vllm_ascend.ops.fused_moe.dataclass.fused_experts import build_fused_experts_input
    from vllm_ascend.ops.fused_moe.dataclass.token_dispatcher import build_token_dispatch_input
    from vllm_ascend.ops.fused_moe.router.fused_topk_router import AscendFusedTopKRouter
    from vllm_ascend.ops.fused_moe.routed_experts import QuantType
    from vllm_ascend.ops.fused_moe.token_dispatcher import TokenDispatcherWithAllGather

    torch.manual_seed(5)
    tokens, hidden, experts, top_k = 6, 16, 8, 2
    x, logits = torch.randn(tokens, hidden), torch.randn(tokens, experts)
    router = AscendFusedTopKRouter(top_k=top_k, global_num_experts=experts, renormalize=True,
                                   scoring_func="softmax")
    dispatcher = TokenDispatcherWithAllGather(top_k=top_k, num_experts=experts, num_local_experts=experts)
    with record_npu_calls() as calls:
        weights, ids = router._compute_routing(x, logits, None)
        fused_input = build_fused_experts_input(hidden_states=x, topk_weights=weights, topk_ids=ids,
                                                quant_type=QuantType.NONE, dynamic_eplb=False)
        dispatched = dispatcher.token_dispatch(token_dispatch_input=build_token_dispatch_input(
            fused_experts_input=fused_input))
        assert dispatched.group_list_type == 1   # counts
        scale = torch.repeat_interleave(torch.arange(1, experts + 1, dtype=x.dtype), dispatched.group_list)
        out = dispatcher.token_combine(hidden_states=dispatched.hidden_states * scale[:, None],
                                       combine_metadata=dispatched.combine_metadata)
    assert [c.name for c in calls] == ["moe_gating_top_k", "npu_moe_init_routing_v2", "npu_moe_token_unpermute"]
    for t in range(tokens):
        row = [float(v) for v in logits[t]]
        top = max(row)
        probs = [math.exp(v - top) for v in row]
        probs = [p / sum(probs) for p in probs]
        best = sorted(range(experts), key=lambda e: -probs[e])[:top_k]
        assert sorted(ids[t].tolist()) == sorted(best)
        norm = sum(probs[e] for e in best)
        expected = sum(probs[e] / norm * (e + 1) for e in best) * x[t].double()
        torch.testing.assert_close(out[t].double(), expected, rtol=1e-5, atol=1e-5)
