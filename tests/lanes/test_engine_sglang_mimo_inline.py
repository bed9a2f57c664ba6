"""sglang's real engine serves a tiny MiMo-V2-Flash shape (K head dim 192, V head dim 128) on the emulated
Ascend device on a release that builds the NPU MHA KV pool inline in ``ModelRunnerKVCacheMixin._init_pools``
(``sglang.npu_mha_v_head_dim_inline``, family ``init-pools-inline``; issue 38, item 3: the README row
"sglang: models whose V head dim differs from K's" on an older family than latest-sglang's).

The lane: one per family of ``sglang.npu_mha_v_head_dim_inline``, the one pinning its newest release
(``pytest.mark.claimed(..., per_family=True)``). The child and its recording are
tests/lanes/test_engine_sglang_mimo.py's (sglang_support/engine_case.py, eager, TP 1, float32 inside the
emulation's math-check switch, token ids in; each process's op calls and the shim's counters recorded).

The model: ``tiny_mimo``'s builder (full layers 0 and 3; sliding layers 1 and 2, window 64, learnable
sinks; MoE in layers 1-3) with the sliding layers' KV heads at the full layers' 2
(``swa_num_key_value_heads``), served on the **plain** NPU MHA pool (``disable_hybrid_swa_memory``), the
one the inline build makes: sglang's hybrid SWA branch hands the class to ``SWAKVPool``, which takes
``v_head_dim`` itself and never reaches the patched call, and one plain pool holds one KV head count
(the patch refuses, at pool construction, a model whose layer kinds need two). On the plain pool each
sliding layer still attends its window (the Ascend backend passes ``layer.sliding_window_size`` to the
FIA call as ``pre_tokens`` over the full block table). Two rounds: the three prompts, then a 100-token
prompt (keys outside the window, prefill and decode).

Server arguments the tiny checkpoint needs on this release (not the shim's business):

* ``trust_remote_code``: this lane's transformers has no MiMo-V2-Flash class; the config is read
  through the checkpoint's configuration code (``tiny_mimo.CONFIG_CODE``, the model type only), and the
  reference is ``tiny_mimo.forward_f64`` (checked against transformers' model on latest-sglang and
  vllm-0.30);
* ``json_model_override_args`` ``rope_parameters`` flat, as on latest-sglang.

sglang's window is one key wider than transformers' (test_engine_sglang_mimo.py's docstring): the
reference attends ``WINDOW + 1`` keys.
"""
import json

import pytest
from engine_support import tiny, tiny_mimo  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)
from sglang_support import engine_run  # noqa: E402

POOL = "sglang.npu_mha_v_head_dim_inline"
DECODE = "sglang.npu_decode_v_head_dim"
pytestmark = [pytest.mark.claimed(POOL, per_family=True), pytest.mark.patch(POOL, DECODE), pytest.mark.engine]

TIMEOUT_S = 400
MODEL = dict(swa_num_key_value_heads=2)   # one KV head count: the plain pool holds every layer
FLAT_ROPE = {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.334}
SERVER = {"disable_hybrid_swa_memory": True, "trust_remote_code": True,
          "json_model_override_args": json.dumps({"rope_parameters": FLAT_ROPE})}
LONG = [(7 * i + 3) % tiny.VOCAB for i in range(100)]   # past the window of 64
ROUNDS = [tiny.PROMPTS, [LONG]]
DECODE_STEPS = tiny.MAX_NEW - 1   # the first token comes from the prefill
SGLANG_KEYS = tiny_mimo.WINDOW + 1   # keys a sliding query attends in sglang


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_mimo.save_mimo_v2_flash(str(tmp_path_factory.mktemp("mimo_inline")), **MODEL)


def _run(model_dir, tmp_path, shim_on, rounds=ROUNDS):
    return engine_run.run_recorded(model_dir, tmp_path, shim_on, {"rounds": list(rounds), "server": SERVER},
                                   timeout_s=TIMEOUT_S)


def test_shim_on_inline_pool_tokens_equal_float64(model_dir, tmp_path):
    rc, output, ops, shim = _run(model_dir, tmp_path, True)
    result = tiny.engine_result(rc, output)
    assert result["device"] == "npu" and result["float32_not_on_hardware"], result
    assert "SWA KV Cache is allocated" not in output, output[-3000:]   # the plain pool
    k_size, v_size = engine_run.kv_sizes(output)
    assert abs(k_size / v_size - 192 / 128) < 0.05, (k_size, v_size)   # V 128 wide
    # the inline build's call, once, in the scheduler (the lane is the one of POOL's family); the pool builder
    # patch of later releases is not applied here
    assert shim[POOL]["calls"] == 1 and shim[POOL]["upstream_calls"] == 0, shim
    assert "sglang.npu_mha_v_head_dim" not in shim, shim
    config = tiny_mimo.config_fields(**MODEL)
    layers, sliding = config["num_hidden_layers"], config["layer_types"].count("sliding_attention")
    sparse = config["mlp_layer_types"].count("sparse")
    # forward passes, from the KV writes (one per layer and pass): a prefill a round and its decode passes
    passes, rest = divmod(ops.get("_npu_reshape_and_cache", 0), layers)
    decode_passes = passes - len(ROUNDS)
    assert rest == 0 and decode_passes >= DECODE_STEPS * len(ROUNDS), ops
    decode = shim[DECODE]
    # each round one prefill batch: every sliding layer's prefill through upstream's TND call with sinks
    assert decode.get("sink_prefill_tnd_calls") == sliding * len(ROUNDS), decode
    # every decode pass of every layer through upstream's TND call
    assert decode["calls"] == decode["tnd_calls"] == layers * decode_passes, (decode, passes)
    assert ops.get("npu_fused_infer_attention_score_v2") == decode["calls"] + decode["sink_prefill_tnd_calls"], ops
    assert "_npu_paged_attention" not in ops, ops
    for op in ("npu_moe_gating_top_k", "npu_moe_init_routing_v2", "npu_moe_finalize_routing"):
        assert ops.get(op) == sparse * passes, (op, ops)
    assert ops.get("npu_grouped_matmul") == 2 * sparse * passes, ops
    prompts = [p for round_ in ROUNDS for p in round_]
    expected = [[t for t, _, _ in steps] for steps in tiny_mimo.reference_steps(model_dir, prompts, window=SGLANG_KEYS)]
    assert result["tokens"] == expected


def test_shim_off_v_built_k_wide_first_write_fails(model_dir, tmp_path):
    """Shim off: upstream's inline build makes V as wide as K (192) and the first prefill's KV write (layer
    0, a full layer) fails; no token is served."""
    rc, output, ops, shim = _run(model_dir, tmp_path, False, rounds=[tiny.PROMPTS])
    assert rc != 0 and "ENGINE_RESULT" not in output, output[-3000:]
    k_size, v_size = engine_run.kv_sizes(output)
    assert k_size == v_size, (k_size, v_size)
    assert "cache heads/dims (2, 192) / (2, 192) do not match key/value (2, 192) / (2, 128)" in output, output[-3000:]
    assert "npu_fused_infer_attention_score_v2" not in ops and not shim, (ops, shim)
