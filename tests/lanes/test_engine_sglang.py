"""sglang's real engine on the emulated Ascend device (issue 38, item 3): how far it gets.

``sglang.Engine(device="npu", attention_backend="ascend")`` is started in a child process
(tests/lanes/sglang_support/engine_case.py) with ``NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1``
and the lane's import placeholders (tests/placeholders: sgl_kernel_npu, torchair), on a tiny
random-weight Qwen2 saved to a temporary folder (no downloads, token ids in, no tokenizer), eager,
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
import subprocess
import sys

import pytest
from sglang_support import newest  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
PLACEHOLDERS = os.path.join(ROOT, "tests", "placeholders")
CASE = os.path.join(ROOT, "tests", "lanes", "sglang_support", "engine_case.py")

pytestmark = pytest.mark.lanes(newest.LANE)

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 7, 30, 12, 100], [1] + list(range(20, 60))]
MAX_NEW = 6
TIMEOUT_S = 300
# The next blocker: what the start-up must name until the emulation has it.
NEXT_BLOCKER = "sgl_kernel_npu.mem_cache.allocator.alloc_extend_kernel"
# The emulated device's memory: sglang sizes its KV cache as a fraction of the device's free memory, and
# the emulated device's memory is host memory (the default 64 GiB card would take 32 GiB of host RAM).
DEVICE_MEMORY_MIB = "1024"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    folder = str(tmp_path_factory.mktemp("qwen2_tiny"))
    config = Qwen2Config(vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                         tie_word_embeddings=False)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(folder)
    return folder


def _reference_tokens(model_dir):
    """transformers, float64, greedy argmax: the independent reference."""
    import torch
    from transformers import Qwen2ForCausalLM

    model = Qwen2ForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float64).eval()
    tokens = []
    with torch.no_grad():
        for prompt in PROMPTS:
            ids = torch.tensor([prompt])
            out = []
            for _ in range(MAX_NEW):
                nxt = int(model(ids).logits[0, -1].argmax())
                out.append(nxt)
                ids = torch.cat([ids, torch.tensor([[nxt]])], dim=1)
            tokens.append(out)
    return tokens


def _run_engine(model_dir, tmp_path, shim_on):
    import npu_shim

    prompts = tmp_path / "prompts.json"
    prompts.write_text(json.dumps(PROMPTS))
    bootstrap = os.path.join(os.path.dirname(npu_shim.__file__), "_bootstrap")
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_SHIM") and k != "PYTHONPATH"}
    env.update(NPU_SHIM_EMULATE="1", NPU_SHIM_EMULATE_DEVICE="1", NPU_SHIM="1" if shim_on else "0",
               NPU_SHIM_EMULATE_DEVICE_MEMORY_MIB=DEVICE_MEMORY_MIB,
               PYTHONPATH=os.pathsep.join([PLACEHOLDERS, bootstrap]))
    try:
        proc = subprocess.run([sys.executable, CASE, model_dir, str(prompts), str(MAX_NEW)], env=env,
                              capture_output=True, text=True, timeout=TIMEOUT_S, cwd=str(tmp_path))
    except subprocess.TimeoutExpired as exc:  # a hang is a failure, never a pass
        pytest.fail(f"sglang.Engine on the emulated device did not finish within {TIMEOUT_S} s: "
                    f"{(exc.stderr or b'')[-3000:]!r}")
    return proc.returncode, proc.stdout + proc.stderr


@pytest.mark.parametrize("shim_on", [True, False], ids=["shim-on", "shim-off"])
def test_engine_on_the_emulated_npu(model_dir, tmp_path, shim_on):
    rc, output = _run_engine(model_dir, tmp_path, shim_on)
    results = [line for line in output.splitlines() if line.startswith("ENGINE_RESULT ")]
    if rc == 0 and results:
        result = json.loads(results[-1][len("ENGINE_RESULT "):])
        assert result["device"] == "npu" and result["attention_backend"] == "ascend", result
        assert result["tokens"] == _reference_tokens(model_dir)
        return
    # It cannot serve yet: it must say why, by name, on the NPU path.
    assert "'device': 'npu'" in output and "'attention_backend': 'ascend'" in output, output[-3000:]
    assert "KV Cache is allocated" in output, output[-3000:]  # in the emulated device's memory
    assert "Engine startup timings" in output, output[-3000:]  # the scheduler is up
    applied = "applied sglang.npu_mha_v_head_dim"  # the shim's patches reach the scheduler process
    assert (applied in output) == shim_on, output[-3000:]
    assert NEXT_BLOCKER in output and "PlaceholderKernelError" in output, output[-3000:]
    assert "prepare_for_extend" in output, output[-3000:]  # at the first prefill
