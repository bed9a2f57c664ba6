"""vLLM's real engine with vllm-ascend's platform plugin on the emulated Ascend device (issue 38,
item 2): greedy tokens equal to the float64 reference.

``vllm.LLM(...)`` is started in a child process (tests/lanes/engine_support/vllm_case.py) with
``NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1`` (a 1 GiB device), the in-process engine core
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), every vLLM plugin on (vllm-ascend's ``ascend`` platform and
its registrations), eager, TP 1, on a tiny random-weight Qwen2 (head 64) and a tokenizer the test
saves to a temporary folder (no downloads; tests/lanes/engine_support/tiny.py); shim on and off
(``NPU_SHIM=0``). It must run on vllm-ascend's platform (``NPUPlatform``, device type ``npu``, not a
CPU path) and its greedy tokens must equal transformers' greedy argmax in float64 on the same
weights, in three calls on one engine (``CALLS``): prompts of several lengths in one batch, chunked
prefill (48 tokens a step, a chunk spanning a block boundary), decode across a block boundary, and a
prefix-cache hit of one 128-token block (``num_cached_tokens``); and the engine's log-probability of
each generated token within ``LOGPROB_TOL`` of float64. The child's stand-ins are declared
there and in docs/validation.md ("vLLM's engine with vllm-ascend on the emulated device"), with the
blockers passed on the way.

Runs on one lane per transformers major release: the one that pins the newest vllm-ascend with the
vLLM of its own minor release among those on that major (read from the pin files; ``LANES``).
"""
import json
import os
import sys

import pytest
from engine_support import tiny  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)
from packaging.version import Version

from npu_shim.reference import lane_table, variant_lanes
from npu_shim.testing.errors import Tolerance

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASE = os.path.join(ROOT, "tests", "lanes", "engine_support", "vllm_case.py")


def _same_minor(pins):
    return Version(pins["vllm"]).release[:2] == Version(pins["vllm-ascend"]).release[:2]


_LANES = {lane: pins for lane, pins in lane_table(ROOT).items()
          if "vllm-ascend" in pins and lane not in variant_lanes(ROOT) and _same_minor(pins)}
# One lane per transformers major release: the one pinning the newest vllm-ascend (with the vLLM of its
# own minor) among the same-minor lanes on that major. Each lane runs its own engine (vllm-ascend's
# attention backend, model runner and ops differ between them).
_NEWEST = {}
for _lane, _pins in _LANES.items():
    _major = Version(_pins["transformers"]).major
    _best = _NEWEST.get(_major)
    if _best is None or (Version(_pins["vllm-ascend"]), _lane) > (Version(_LANES[_best]["vllm-ascend"]), _best):
        _NEWEST[_major] = _lane
LANES = tuple(_NEWEST[major] for major in sorted(_NEWEST))

pytestmark = [pytest.mark.lanes(*LANES), pytest.mark.engine]

TIMEOUT_S = 300
PLATFORM = "ENGINE_STAGE platform NPUPlatform device_type=npu"
# The emulated device's memory (host memory): gpu_memory_utilization is a fraction of it, and the KV
# cache is sized from what is left after the model.
DEVICE_MEMORY_MIB = "1024"
# Head size 64 (hidden 256, 4 heads): vllm-ascend's prefill attention (npu_fused_infer_attention_score,
# layout TND) takes head sizes 64, 128 or 192 only (CANN's check, emulated).
MODEL = {"hidden_size": 256}
BLOCK = 128  # the case's KV-cache block size (vllm_case.BLOCK_SIZE); 48 tokens a step, chunked prefill
# max |engine log-probability - float64| of the generated tokens, float32 weights and KV cache: measured
# 3.8e-7 on vllm-0.30; the smallest float64 greedy margin (top logit - runner-up) of these prompts is
# 1.3e-3, so equal tokens are no tie broken by luck
LOGPROB_TOL = Tolerance("vLLM engine on the emulated device: log-probabilities vs float64", 1e-5, "float32")
_LONG = [(7 * i + 3) % tiny.VOCAB for i in range(200)]
# One engine, three llm.generate calls in order:
# 1. several lengths in one batch (3, 9, 41 tokens: 53 > 48, so the 41-token prompt is chunked);
# 2. a 200-token prompt, prefilled in chunks of at most 48 (one spans the block boundary at 128), beside
#    a 125-token prompt whose decode crosses the block boundary (positions 125..130);
# 3. a prompt sharing the first 150 tokens of call 2's long one: a prefix-cache hit of one block.
CALLS = [tiny.PROMPTS,
         [_LONG, [(11 * i + 5) % tiny.VOCAB for i in range(125)]],
         [_LONG[:150] + [(13 * i + 1) % tiny.VOCAB for i in range(20)]]]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.save_qwen2(str(tmp_path_factory.mktemp("qwen2_tiny")), with_tokenizer=True, **MODEL)


@pytest.fixture(scope="module")
def reference(model_dir):
    """Per call, per prompt, per generated token: (token, log-probability, greedy margin), float64."""
    return [tiny.reference_steps(model_dir, prompts) for prompts in CALLS]


def run_engine(model_dir, tmp_path, shim_on, calls=CALLS, what="vllm.LLM", **extra):
    """engine_support/vllm_case.py on ``model_dir`` with ``calls`` written to ``tmp_path``: the in-process
    engine core, the emulated device with DEVICE_MEMORY_MIB, the shim on or off, ``extra`` added to the
    child's environment. Returns (returncode, stdout + stderr)."""
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(calls))
    env = tiny.child_env(shim_on, drop=("NPU_SHIM", "VLLM_"), VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
                          NPU_SHIM_EMULATE_DEVICE_MEMORY_MIB=DEVICE_MEMORY_MIB, **extra)
    return tiny.run_child([sys.executable, CASE, model_dir, str(prompts), str(tiny.MAX_NEW)], env,
                          str(tmp_path), TIMEOUT_S, what)


@pytest.mark.parametrize("shim_on", [True, False], ids=["shim-on", "shim-off"])
def test_engine_on_the_emulated_npu(model_dir, reference, tmp_path, shim_on):
    rc, output = run_engine(model_dir, tmp_path, shim_on)
    assert PLATFORM in output, output[-3000:]  # vllm-ascend's platform, not a CPU path
    result = tiny.engine_result(rc, output)
    assert (result["platform"], result["device_type"]) == ("NPUPlatform", "npu"), result
    # the cases are what the settings make them: chunked prefill, 48 tokens a step, prefix caching, blocks of 128
    assert (result["chunked_prefill"], result["max_num_batched_tokens"], result["prefix_caching"],
            result["block_size"]) == (True, 48, True, BLOCK), result
    assert result["cached"][2] == [BLOCK], result  # call 3 hit the cache: the shared prefix's full block
    assert result["cached"][0] == [0, 0, 0], result
    assert result["tokens"] == [[[t for t, _, _ in steps] for steps in call] for call in reference], result
    steps = [(got, want, margin) for call, got_call in zip(reference, result["logprobs"])
             for ref_steps, got_steps in zip(call, got_call) for (_, want, margin), got in zip(ref_steps, got_steps)]
    assert len(steps) == sum(len(call) for call in CALLS) * tiny.MAX_NEW, result
    assert min(margin for _, _, margin in steps) > 10 * LOGPROB_TOL  # the reference is no near-tie
    assert max(abs(got - want) for got, want, _ in steps) < LOGPROB_TOL


# bfloat16 serving (the dtype the hardware's attention and KV-cache ops take), the emulation's float32
# switch closed: max |engine log-probability - float64| measured 6.4e-3 on vllm-0.30 (bfloat16 keeps 8
# bits of mantissa). Each of the engine's tokens is scored by float64 where the engine stood
# (tiny.scored_steps): it must be float64's greedy pick, or a near-tie within twice the tolerance that the
# dtype's error may swap (measured: every token the greedy pick).
BF16_LOGPROB_TOL = Tolerance("vLLM engine on the emulated device: log-probabilities vs float64", 5e-2, "bfloat16")


@pytest.mark.lanes(LANES[-1])
def test_bfloat16_engine_with_the_hardware_dtypes(model_dir, tmp_path):
    rc, output = run_engine(model_dir, tmp_path, True, ENGINE_CASE_DTYPE="bfloat16")
    assert PLATFORM in output, output[-3000:]
    result = tiny.engine_result(rc, output)
    # served in bfloat16, the attention ops called with the math-check switch closed (float32 fails them)
    assert (result["dtype"], result["float32_allowed"]) == ("torch.bfloat16", False), result
    assert result["ops"].get("npu_fused_infer_attention_score", 0) > 0, result["ops"]
    scored = [(gap, abs(logprob - want))
              for prompts, got_tokens, got_logprobs in zip(CALLS, result["tokens"], result["logprobs"])
              for prompt, tokens, logprobs in zip(prompts, got_tokens, got_logprobs)
              for (want, gap), logprob in zip(tiny.scored_steps(model_dir, prompt, tokens), logprobs)]
    assert len(scored) == sum(len(prompts) for prompts in CALLS) * tiny.MAX_NEW, result
    assert max(gap for gap, _ in scored) < 2 * BF16_LOGPROB_TOL, scored
    assert max(error for _, error in scored) < BF16_LOGPROB_TOL
