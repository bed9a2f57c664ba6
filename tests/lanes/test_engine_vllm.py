"""vLLM's real engine with vllm-ascend's platform plugin on the emulated Ascend device (issue 38,
item 2): how far it gets.

``vllm.LLM(...)`` is started in a child process (tests/lanes/engine_support/vllm_case.py) with
``NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1``, the in-process engine core
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``), every vLLM plugin on (vllm-ascend's ``ascend`` platform and
its registrations), eager, TP 1, on a tiny random-weight Qwen2 and a tokenizer the test saves to a
temporary folder (no downloads; tests/lanes/engine_support/tiny.py); shim on and off
(``NPU_SHIM=0``).

Where the engine generates, its greedy tokens must equal transformers' greedy argmax in float64 on
the same weights, for prompts of several lengths. Where it cannot start, it must fail at start-up,
within the timeout, on vllm-ascend's platform (not a CPU path), at the stage ``NEXT_STAGE`` with the
error naming the missing API ``NEXT_BLOCKER``. When the emulation grows past it, the test fails and
must be moved on. Blockers met on the way, in order: docs/validation.md ("vLLM's engine with
vllm-ascend on the emulated device").

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
# How far start-up gets until the emulation has the next API: the last stage the case passed,
# the upstream function that meets it, and the missing API the error must name.
NEXT_STAGE = "platform"   # inside vllm.LLM(...): the model runner is built, the model is being loaded
NEXT_WHERE = "in to_meta_tensor"  # vLLM's layerwise reload records each parameter as a meta tensor
NEXT_BLOCKER = "__class__ assignment: 'NpuTensor' object layout differs from 'Tensor'"
# The emulated device's memory (host memory): gpu_memory_utilization is a fraction of it, and the KV
# cache is sized from what is left after the model.
DEVICE_MEMORY_MIB = "1024"
# Head size 64 (hidden 256, 4 heads): vllm-ascend's prefill attention (npu_fused_infer_attention_score,
# layout TND) takes head sizes 64, 128 or 192 only (CANN's check, emulated).
MODEL = {"hidden_size": 256}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.save_qwen2(str(tmp_path_factory.mktemp("qwen2_tiny")), with_tokenizer=True, **MODEL)


def _run_engine(model_dir, tmp_path, shim_on):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(tiny.PROMPTS))
    env = tiny.child_env(shim_on, drop=("NPU_SHIM", "VLLM_"), VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
                          NPU_SHIM_EMULATE_DEVICE_MEMORY_MIB=DEVICE_MEMORY_MIB)
    return tiny.run_child([sys.executable, CASE, model_dir, str(prompts), str(tiny.MAX_NEW)], env,
                          str(tmp_path), TIMEOUT_S, "vllm.LLM")


@pytest.mark.parametrize("shim_on", [True, False], ids=["shim-on", "shim-off"])
def test_engine_on_the_emulated_npu(model_dir, tmp_path, shim_on):
    rc, output = _run_engine(model_dir, tmp_path, shim_on)
    assert PLATFORM in output, output[-3000:]  # vllm-ascend's platform, not a CPU path
    results = [line for line in output.splitlines() if line.startswith("ENGINE_RESULT ")]
    if rc == 0 and results:
        result = json.loads(results[-1][len("ENGINE_RESULT "):])
        assert result["tokens"] == tiny.reference_tokens(model_dir)
        return
    # It cannot start yet: it must say why, by name, at start-up, on the NPU path.
    stages = [line.split(" ", 1)[1] for line in output.splitlines() if line.startswith("ENGINE_STAGE ")]
    assert stages[-1].split(" ")[0] == NEXT_STAGE, (stages, output[-3000:])
    assert NEXT_BLOCKER in output, output[-3000:]
    assert NEXT_WHERE in output, output[-3000:]
