"""sglang's real engine on the emulated Ascend device (issue 38, item 3): how far it gets.

``sglang.Engine(device="npu", attention_backend="ascend")`` is started in a child process
(tests/lanes/sglang_support/engine_case.py) with ``NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1``
and the lane's import placeholders (tests/placeholders: sgl_kernel_npu, torchair), on a tiny
random-weight Qwen2 saved to a temporary folder (tests/lanes/engine_support/tiny.py; no downloads,
token ids in, no tokenizer), eager,
TP 1; shim on (its bootstrap ``sitecustomize`` on ``PYTHONPATH``) and off (``NPU_SHIM=0``).

Where the engine generates, its greedy tokens must equal transformers' greedy argmax in float64
on the same weights, for prompts of several lengths. Where it cannot start, it must fail at
start-up or at the first request, within the timeout, with the error naming the missing API or
kernel. Today the engine starts whole on the emulated device (weights loaded on ``npu``, the KV cache
allocated in the device's memory, the shim's sglang patches applied in the scheduler process), and the
first prefill stops at sglang's NPU token allocator, which launches the Triton kernel
``sgl_kernel_npu.mem_cache.allocator.alloc_extend_kernel``: that package is an import placeholder here
(tests/placeholders), which refuses by name.
The blockers met on the way, in order, are in docs/validation.md ("sglang's engine on the
emulated device"). When the emulation grows past this one, the test fails and must be moved on.

Runs on the lane that pins the newest sglang (read from the pin files).
"""
import json
import os
import sys

import pytest
from engine_support import tiny  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)
from sglang_support import newest  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLACEHOLDERS = os.path.join(ROOT, "tests", "placeholders")
CASE = os.path.join(ROOT, "tests", "lanes", "sglang_support", "engine_case.py")

pytestmark = pytest.mark.lanes(newest.LANE)

PROMPTS = tiny.PROMPTS
MAX_NEW = tiny.MAX_NEW
TIMEOUT_S = 300
# The next blocker: what the start-up must name until the emulation has it.
NEXT_BLOCKER = "sgl_kernel_npu.mem_cache.allocator.alloc_extend_kernel"
# The emulated device's memory: sglang sizes its KV cache as a fraction of the device's free memory, and
# the emulated device's memory is host memory (the default 64 GiB card would take 32 GiB of host RAM).
DEVICE_MEMORY_MIB = "1024"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.save_qwen2(str(tmp_path_factory.mktemp("qwen2_tiny")))


def _run_engine(model_dir, tmp_path, shim_on):
    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    env = tiny.child_env(shim_on, pythonpath=[PLACEHOLDERS], NPU_SHIM_EMULATE_DEVICE_MEMORY_MIB=DEVICE_MEMORY_MIB)
    return tiny.run_child([sys.executable, CASE, model_dir, str(prompts), str(MAX_NEW)], env, str(tmp_path),
                          TIMEOUT_S, "sglang.Engine")


@pytest.mark.parametrize("shim_on", [True, False], ids=["shim-on", "shim-off"])
def test_engine_on_the_emulated_npu(model_dir, tmp_path, shim_on):
    rc, output = _run_engine(model_dir, tmp_path, shim_on)
    results = [line for line in output.splitlines() if line.startswith("ENGINE_RESULT ")]
    if rc == 0 and results:
        result = json.loads(results[-1][len("ENGINE_RESULT "):])
        assert result["device"] == "npu" and result["attention_backend"] == "ascend", result
        assert result["tokens"] == tiny.reference_tokens(model_dir)
        return
    # It cannot serve yet: it must say why, by name, on the NPU path.
    assert "'device': 'npu'" in output and "'attention_backend': 'ascend'" in output, output[-3000:]
    assert "KV Cache is allocated" in output, output[-3000:]  # in the emulated device's memory
    assert "Engine startup timings" in output, output[-3000:]  # the scheduler is up
    applied = "applied sglang.npu_mha_v_head_dim"  # the shim's patches reach the scheduler process
    assert (applied in output) == shim_on, output[-3000:]
    assert NEXT_BLOCKER in output and "PlaceholderKernelError" in output, output[-3000:]
    assert "prepare_for_extend" in output, output[-3000:]  # at the first prefill
