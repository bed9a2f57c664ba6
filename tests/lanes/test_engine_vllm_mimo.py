"""vLLM's real engine with vllm-ascend's platform plugin on the emulated Ascend device, serving a
MiMo-V2-Flash-shaped model (issue 38, items 2 and 4; README row "MiMo-V2-Flash (V head dim 128, K
192) on vLLM + vllm-ascend").

As tests/lanes/test_engine_vllm.py: ``vllm.LLM(...)`` in a child process
(tests/lanes/engine_support/vllm_case.py), ``NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1`` (a 1 GiB
device), the in-process engine core, every vLLM plugin on, eager, TP 1, float32, blocks of 128,
chunked prefill at 48 tokens a step, prefix caching, 512 positions; the model is a tiny random-weight
MiMo-V2-Flash written by tests/lanes/engine_support/tiny_mimo.py (the checkpoint's layout, no
model class): K 192 / V 128, full-attention layers (0, 3) and
sliding-window layers (1, 2; window 64, learnable sinks, twice the KV heads), a dense MLP in layer 0
and MoE (8 experts, top 2, sigmoid router with the score-correction bias) in layers 1-3, partial
rotary, the value scale.

Shim on: the engine builds every layer on vllm-ascend's own ``AscendAttentionBackendImpl`` with
separate K 192 / V 128 caches, the sliding layers with their window and sinks, the MoE blocks on
vllm-ascend's ``AscendMoERunner``; the attention runs through ``npu_fused_infer_attention_score_v2``
(TND; band for the sliding layers) and the experts through the emulated MoE ops (gating top-k,
init-routing v2, grouped matmul, token unpermute); the greedy tokens of five calls (``CALLS``: those
of test_engine_vllm.py, then a 300-token prompt and one sharing its first 270 tokens, a prefix-cache
hit of 256) equal transformers' float64 greedy argmax on the same weights, and the log-probabilities
are within ``LOGPROB_TOL``.

Where the README says upstream fails, the engine fails there, with upstream's own error:
* shim off: the first forward (the profile run) raises in the model's q/k/v split: vllm-ascend's
  QKV projection sized V with K's 192 (``split_sizes=[768, 384, 256]`` of 1536 columns);
* shim on with ``NPU_SHIM_VLLM_MIMO_V_HEAD_DIM=0`` (the model's DiffKV backend, upstream's choice for
  V != K): KV-cache set-up fails, the Triton DiffKV backend has no ``get_kv_cache_shape`` on Ascend;
* shim on with the runner's K/V byte split left to upstream (``NPU_SHIM_DISABLE=
  vllm.ascend_kv_split_exact``): KV-cache set-up asserts on the page size.

Prefix caching with the two KV-cache groups: vLLM's hybrid KV-cache manager gives the full-attention
group blocks of 256 tokens beside the sliding group's 128 (the page sizes made equal; kernel blocks of
128 in both), so hits come in steps of 256: call 3's 150 shared tokens hit nothing, call 5's 270 hit
256 (both groups; the sliding layers then read the part of their window before position 256 from
the cache).

Two engine lanes (``LANES``: one per transformers major). Where vLLM's MiMo model hands the attention
its own V head dim (``NATIVE``: vllm-ascend 0.30, transformers 5.14, whose ``MiMoV2FlashForCausalLM``
reads the checkpoint and gives the float64 reference), the cases above. Where the model pads V to
192 itself (``PADDED``: the lanes ``vllm.mimo_v2_flash_sinks_refuse`` claims; vLLM 0.18 with
transformers 4.57, which has no MiMo-V2-Flash class: the config is read through the checkpoint's
configuration code, ``trust_remote_code``, and the reference is tiny_mimo's ``forward_f64``, checked
against transformers' on the native lane), what the README says of those releases:
* shim on, the same model: refused at build, naming the first sliding-window layer (learnable sinks,
  V padded to 192: an FIA v2 call the op's page does not take);
* shim on, the model with full-attention layers only (MoE as above): served, every layer on
  vllm-ascend's ``AscendAttentionBackendImpl`` with V padded to 192 (``npu_fused_infer_attention_score``),
  the experts through the emulated MoE ops (vllm-ascend's own ``npu_moe_init_routing_custom``), the
  tokens of the five calls equal float64's; with ``vllm.ascend_qkv_v_head_size`` (its QKV projection);
* shim off, that model: the profile run's first forward raises in the q/k/v split, as on the native
  lane (vllm-ascend 0.18's QKV projection sizes V with K's 192 too).
"""
import pytest
from engine_support import tiny, tiny_mimo  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)
from test_engine_vllm import LANES, PLATFORM, ROOT, run_engine

from npu_shim.reference import claimed_lanes
from npu_shim.testing.errors import Tolerance

# the text test's engine lanes (its rule: per transformers major, the newest same-minor vllm / vllm-ascend
# pair), told apart by what vLLM's MiMo model does with V: pads it to K's 192 itself (the lanes
# vllm.mimo_v2_flash_sinks_refuse claims) or hands the attention its own 128 (native)
PADDED = tuple(lane for lane in LANES if lane in claimed_lanes(ROOT)["vllm.mimo_v2_flash_sinks_refuse"])
NATIVE = tuple(lane for lane in LANES if lane not in PADDED)

pytestmark = [pytest.mark.lanes(*LANES), pytest.mark.engine]

BLOCK = 128
# max |engine log-probability - float64| of the 48 generated tokens, float32 weights and KV cache:
# measured 1.2e-5 on vllm-0.30 (the router's gate is float32 on both sides, as the model defines it;
# smallest float64 greedy margin 7.0e-3) and 1.6e-5 on vllm-0.18 (the full-attention model against
# tiny_mimo.forward_f64; smallest margin 3.1e-2)
LOGPROB_TOL = Tolerance("vLLM engine, MiMo-V2-Flash shape: log-probabilities vs float64", 5e-5, "float32")
_LONG = [(7 * i + 3) % tiny.VOCAB for i in range(200)]
# as test_engine_vllm.py: 3, 9 and 41 tokens in one batch; a 200-token prompt in chunks of at most 48
# beside a 125-token one (its decode crosses the sliding group's block boundary at 128); a prompt
# sharing 150 tokens with the long one. Window 64: every prompt past 64 tokens has keys outside the
# sliding layers' window.
_LONGER = [(5 * i + 2) % tiny.VOCAB for i in range(300)]
# then a 300-token prompt, and one sharing its first 270 tokens (a hit of one 256-token block)
CALLS = [tiny.PROMPTS,
         [_LONG, [(11 * i + 5) % tiny.VOCAB for i in range(125)]],
         [_LONG[:150] + [(13 * i + 1) % tiny.VOCAB for i in range(20)]],
         [_LONGER],
         [_LONGER[:270] + [(3 * i + 7) % tiny.VOCAB for i in range(10)]]]
CACHED = [[0, 0, 0], [0, 0], [0], [0], [256]]  # num_cached_tokens per call and prompt (see the docstring)
MAX_MODEL_LEN = "512"
FULL, SLIDING = (0, 3), (1, 2)
MOE = (1, 2, 3)
SHIM_PATCHES = ("vllm.mimo_v2_v_head_dim", "vllm.ascend_qkv_v_head_size", "vllm.ascend_kv_split_exact",
                "vllm.ascend_attention_v_head_dim")
MOE_OPS = ("moe_gating_top_k", "npu_moe_init_routing_v2", "npu_grouped_matmul", "npu_moe_token_unpermute")
# (id, shim on, extra environment, upstream's error the engine stops with)
BROKEN = [
    ("shim-off", False, {}, "split_with_sizes expects split_sizes to sum exactly to 1536 (input tensor's size at "
                            "dimension -1), but got split_sizes=[768, 384, 256]"),
    ("shim-on-diffkv", True, {"NPU_SHIM_VLLM_MIMO_V_HEAD_DIM": "0"},
     "AttributeError: type object 'TritonAttentionDiffKVBackend' has no attribute 'get_kv_cache_shape'"),
    ("shim-on-upstream-kv-split", True, {"NPU_SHIM_DISABLE": "vllm.ascend_kv_split_exact"},
     "assert sum_page_size_bytes % current_kv_cache_spec.page_size_bytes == 0"),
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_mimo.save_mimo_v2_flash(str(tmp_path_factory.mktemp("mimo_v2_flash_tiny")))


@pytest.fixture(scope="module")
def reference(model_dir):
    """Per call, per prompt, per generated token: (token, log-probability, greedy margin), float64."""
    return [tiny_mimo.reference_steps(model_dir, prompts) for prompts in CALLS]


def _run_engine(model_dir, tmp_path, shim_on, **extra):
    if not tiny_mimo.transformers_has_the_model():   # the config read through the checkpoint's own code
        extra["ENGINE_CASE_TRUST_REMOTE_CODE"] = "1"
    return run_engine(model_dir, tmp_path, shim_on, CALLS, "vllm.LLM (MiMo-V2-Flash shape)",
                      ENGINE_CASE_MAX_MODEL_LEN=MAX_MODEL_LEN, **extra)


@pytest.mark.lanes(*NATIVE)
def test_reference_is_the_mimo_shape(model_dir):
    """The saved model is what the test says: transformers reads K 192 / V 128, the layer kinds, the
    sinks on the sliding layers only, the MoE layers; its config carries vLLM's names with the same
    facts."""
    import torch

    model = tiny_mimo.model_class().from_pretrained(model_dir, torch_dtype=torch.float64)
    layers = model.model.layers
    assert [layer.self_attn.sliding_window is not None for layer in layers] == [i in SLIDING for i in range(4)]
    assert [layer.self_attn.sinks is not None for layer in layers] == [i in SLIDING for i in range(4)]
    assert {(layer.self_attn.head_dim, layer.self_attn.v_head_dim) for layer in layers} == {(192, 128)}
    assert [hasattr(layer.mlp, "experts") for layer in layers] == [i in MOE for i in range(4)]
    assert layers[1].self_attn.sinks.abs().min() > 0 and layers[1].mlp.gate.e_score_correction_bias.abs().min() > 0
    config = model.config
    assert config.hybrid_layer_pattern == [int(i in SLIDING) for i in range(4)]
    assert config.moe_layer_freq == [int(i in MOE) for i in range(4)]
    assert config.sliding_window_size == config.sliding_window == tiny_mimo.WINDOW
    # transformers' rope defaults (the checkpoint states none of its own) are the checkpoint's thetas
    assert {kind: (p["rope_theta"], p["partial_rotary_factor"]) for kind, p in config.rope_parameters.items()} == {
        "full_attention": (config.rope_theta, config.partial_rotary_factor),
        "sliding_attention": (config.swa_rope_theta, config.partial_rotary_factor)}


# max |log-probability| between tiny_mimo.forward_f64 and transformers' float64 model: transformers
# rounds its norms' input and its router's gate to float32 (measured 1.9e-5 over a 200-token prompt;
# without the sinks, the window or the value scale: 2.5, 4.3, 3.6)
OWN_REFERENCE_TOL = Tolerance("tiny_mimo.forward_f64 vs transformers' float64 MiMo-V2-Flash", 1e-4, "float32")


@pytest.mark.lanes(*NATIVE)
def test_own_reference_is_transformers(model_dir):
    """tiny_mimo's float64 forward (the reference of the lanes whose transformers has no MiMo-V2-Flash)
    is transformers' model: the same greedy token at every position of a prompt past the window,
    log-probabilities within OWN_REFERENCE_TOL; a forward without the sinks, the window or the value
    scale is not (each differs by more than 100 times that)."""
    import json
    import shutil

    import torch

    model = tiny_mimo.model_class().from_pretrained(model_dir, torch_dtype=torch.float64).eval()
    with torch.no_grad():
        want = torch.log_softmax(model(torch.tensor([_LONG])).logits[0], -1)
    got = torch.log_softmax(tiny_mimo.forward_f64(model_dir, _LONG), -1)
    assert torch.equal(got.argmax(-1), want.argmax(-1))
    assert (got - want).abs().max().item() < OWN_REFERENCE_TOL
    for change in ({"add_swa_attention_sink_bias": False}, {"sliding_window_size": 10 ** 6},
                   {"attention_value_scale": 1.0}):
        other = model_dir + "_changed"
        shutil.copytree(model_dir, other, dirs_exist_ok=True)
        with open(other + "/config.json") as f:
            config = json.load(f)
        config.update(change)
        with open(other + "/config.json", "w") as f:
            json.dump(config, f)
        changed = torch.log_softmax(tiny_mimo.forward_f64(other, _LONG), -1)
        assert (changed - want).abs().max().item() > 100 * OWN_REFERENCE_TOL, change


@pytest.mark.lanes(*NATIVE)
def test_engine_serves_mimo_shape_shim_on(model_dir, reference, tmp_path):
    rc, output = _run_engine(model_dir, tmp_path, True)
    assert PLATFORM in output, output[-3000:]
    result = tiny.engine_result(rc, output)
    assert (result["platform"], result["device_type"]) == ("NPUPlatform", "npu"), result
    assert (result["chunked_prefill"], result["max_num_batched_tokens"], result["prefix_caching"],
            result["block_size"]) == (True, 48, True, BLOCK), result
    assert result["cached"] == CACHED, result["cached"]
    # what the engine built: vllm-ascend's backend for every layer, K 192 / V 128, the sliding layers
    # with their window and sinks, the full ones without; vllm-ascend's MoE runner in the MoE layers
    layers = result["layers"]
    for i in range(4):
        attn = layers["model.layers.%d.self_attn.attn" % i]
        assert (attn["impl"], attn["head_size"], attn["head_size_v"]) == ("AscendAttentionBackendImpl", 192, 128), attn
        assert (attn["sliding_window"], attn["sinks"]) == ((tiny_mimo.WINDOW, True) if i in SLIDING else (None, False))
        experts = layers.get("model.layers.%d.mlp.experts" % i)
        assert (experts == {"experts": "AscendMoERunner"}) if i in MOE else experts is None, (i, experts)
    assert set(SHIM_PATCHES) <= set(result["shim"]), result["shim"]
    ops = result["ops"]
    assert ops.get("npu_fused_infer_attention_score_v2", 0) > 0 and all(ops.get(op, 0) > 0 for op in MOE_OPS), ops
    _assert_equal_to(reference, result)


def _assert_equal_to(reference, result):
    """The engine's greedy tokens of every call equal the reference's, its log-probabilities within
    LOGPROB_TOL, the reference no near-tie."""
    assert result["tokens"] == [[[t for t, _, _ in steps] for steps in call] for call in reference], result["tokens"]
    steps = [(got, want, margin) for call, got_call in zip(reference, result["logprobs"])
             for ref_steps, got_steps in zip(call, got_call) for (_, want, margin), got in zip(ref_steps, got_steps)]
    assert len(steps) == sum(len(call) for call in CALLS) * tiny.MAX_NEW, result
    assert min(margin for _, _, margin in steps) > 10 * LOGPROB_TOL  # the reference is no near-tie
    assert max(abs(got - want) for got, want, _ in steps) < LOGPROB_TOL


@pytest.mark.lanes(*NATIVE)
@pytest.mark.parametrize("shim_on, extra, error", [case[1:] for case in BROKEN], ids=[case[0] for case in BROKEN])
def test_engine_fails_where_upstream_is_broken(model_dir, tmp_path, shim_on, extra, error):
    rc, output = _run_engine(model_dir, tmp_path, shim_on, **extra)
    assert PLATFORM in output, output[-3000:]
    assert rc != 0 and "ENGINE_STAGE generate" not in output, output[-3000:]
    assert error in output, output[-3000:]


# Where the model pads V itself (PADDED): the full-attention layers' model, and what the engine does.
FULL_ONLY = dict(layer_types=["full_attention"] * 4, hybrid_layer_pattern=[0] * 4)
# one KV-cache group (full attention), blocks of 128: call 3's 150 shared tokens hit 128, call 5's 270 hit 256
CACHED_FULL = [[0, 0, 0], [0, 0], [BLOCK], [0], [2 * BLOCK]]
PADDED_PATCHES = ("vllm.ascend_qkv_v_head_size", "vllm.mimo_v2_flash_sinks_refuse")
PADDED_MOE_OPS = ("moe_gating_top_k", "npu_moe_init_routing_custom", "npu_grouped_matmul", "npu_moe_token_unpermute")
# (id, shim on, the full-attention model (else the sliding one), the error the engine stops with)
PADDED_BROKEN = [
    ("shim-on-sliding", True, False, "NotImplementedError: MiMoV2Attention layer 'model.layers.1.self_attn.attn' "
                                     "(learnable sinks, K head dim 192, V head dim 128)"),
    ("shim-off-full", False, True, "split_with_sizes expects split_sizes to sum exactly to 1536 (input tensor's "
                                   "size at dimension -1), but got split_sizes=[768, 384, 256]"),
]


@pytest.fixture(scope="module")
def full_model_dir(tmp_path_factory):
    return tiny_mimo.save_mimo_v2_flash(str(tmp_path_factory.mktemp("mimo_v2_flash_full")), **FULL_ONLY)


@pytest.mark.lanes(*PADDED)
def test_padded_engine_serves_the_full_layers_shim_on(full_model_dir, tmp_path):
    rc, output = _run_engine(full_model_dir, tmp_path, True)
    assert PLATFORM in output, output[-3000:]
    result = tiny.engine_result(rc, output)
    assert (result["platform"], result["device_type"]) == ("NPUPlatform", "npu"), result
    assert (result["chunked_prefill"], result["max_num_batched_tokens"], result["prefix_caching"],
            result["block_size"]) == (True, 48, True, BLOCK), result
    assert result["cached"] == CACHED_FULL, result["cached"]
    layers = result["layers"]
    for i in range(4):   # V padded to 192 by the model, no window, no sinks; the experts in the MoE layers
        attn = layers["model.layers.%d.self_attn.attn" % i]
        assert (attn["impl"], attn["head_size"], attn["head_size_v"], attn["sliding_window"], attn["sinks"]) == (
            "AscendAttentionBackendImpl", 192, 192, None, False), attn
        assert ("model.layers.%d.mlp.experts" % i in layers) == (i in MOE), (i, layers)
    assert set(PADDED_PATCHES) <= set(result["shim"]), result["shim"]
    ops = result["ops"]
    assert ops.get("npu_fused_infer_attention_score", 0) > 0 and all(ops.get(op, 0) > 0 for op in PADDED_MOE_OPS), ops
    reference = [tiny_mimo.reference_steps(full_model_dir, prompts) for prompts in CALLS]
    _assert_equal_to(reference, result)


@pytest.mark.lanes(*PADDED)
@pytest.mark.parametrize("shim_on, full, error", [case[1:] for case in PADDED_BROKEN],
                         ids=[case[0] for case in PADDED_BROKEN])
def test_padded_engine_stops_where_the_readme_says(model_dir, full_model_dir, tmp_path, shim_on, full, error):
    rc, output = _run_engine(full_model_dir if full else model_dir, tmp_path, shim_on)
    assert PLATFORM in output, output[-3000:]
    assert rc != 0 and "ENGINE_STAGE generate" not in output, output[-3000:]
    assert error in output, output[-3000:]
