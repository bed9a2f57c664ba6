"""vLLM's real engine with vllm-ascend's platform plugin on the emulated Ascend device (issue 38,
item 2): greedy tokens equal to the float64 reference.

``vllm.LLM(...)`` is started in a child process (tests/lanes/engine_support/vllm_case.py) with
``NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1`` (a 1 GiB device), the in-process engine core
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), every vLLM plugin on (vllm-ascend's ``ascend`` platform and
its registrations), eager, TP 1, on a tiny random-weight Qwen2 (head 64) and a tokenizer the test
saves to a temporary folder (no downloads; tests/lanes/engine_support/tiny.py); shim on and off
(``NPU_SHIM=0``). It must run on vllm-ascend's platform (``NPUPlatform``, device type ``npu``, not a
CPU path) and its greedy tokens must equal transformers' greedy argmax in float64 on the same
weights, for three prompts of different lengths in one batch. The child's stand-ins are declared
there and in docs/validation.md ("vLLM's engine with vllm-ascend on the emulated device"), with the
blockers passed on the way.

Runs on the lane that pins the newest vllm-ascend with the vLLM of its own minor release (read from
the pin files).
"""
import json
import os
import sys

import pytest
from engine_support import tiny  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)
from packaging.version import Version

from npu_shim.reference import lane_table, variant_lanes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASE = os.path.join(ROOT, "tests", "lanes", "engine_support", "vllm_case.py")


def _same_minor(pins):
    return Version(pins["vllm"]).release[:2] == Version(pins["vllm-ascend"]).release[:2]


_LANES = {lane: pins for lane, pins in lane_table(ROOT).items()
          if "vllm-ascend" in pins and lane not in variant_lanes(ROOT) and _same_minor(pins)}
LANE = max(_LANES, key=lambda lane: (Version(_LANES[lane]["vllm-ascend"]), lane))

pytestmark = pytest.mark.lanes(LANE)

TIMEOUT_S = 300
PLATFORM = "ENGINE_STAGE platform NPUPlatform device_type=npu"
# The emulated device's memory (host memory): gpu_memory_utilization is a fraction of it, and the KV
# cache is sized from what is left after the model.
DEVICE_MEMORY_MIB = "1024"
# Head size 64 (hidden 256, 4 heads): vllm-ascend's prefill attention (npu_fused_infer_attention_score,
# layout TND) takes head sizes 64, 128 or 192 only (CANN's check, emulated).
MODEL = {"hidden_size": 256}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.save_qwen2(str(tmp_path_factory.mktemp("qwen2_tiny")), with_tokenizer=True, **MODEL)


@pytest.fixture(scope="module")
def reference(model_dir):
    return tiny.reference_tokens(model_dir)


def _run_engine(model_dir, tmp_path, shim_on):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(tiny.PROMPTS))
    env = tiny.child_env(shim_on, drop=("NPU_SHIM", "VLLM_"), VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
                          NPU_SHIM_EMULATE_DEVICE_MEMORY_MIB=DEVICE_MEMORY_MIB)
    return tiny.run_child([sys.executable, CASE, model_dir, str(prompts), str(tiny.MAX_NEW)], env,
                          str(tmp_path), TIMEOUT_S, "vllm.LLM")


@pytest.mark.parametrize("shim_on", [True, False], ids=["shim-on", "shim-off"])
def test_engine_on_the_emulated_npu(model_dir, reference, tmp_path, shim_on):
    rc, output = _run_engine(model_dir, tmp_path, shim_on)
    assert PLATFORM in output, output[-3000:]  # vllm-ascend's platform, not a CPU path
    results = [line for line in output.splitlines() if line.startswith("ENGINE_RESULT ")]
    assert rc == 0 and results, output[-3000:]
    result = json.loads(results[-1][len("ENGINE_RESULT "):])
    assert (result["platform"], result["device_type"]) == ("NPUPlatform", "npu"), result
    assert result["tokens"] == reference, result
