"""sglang's real engine on the emulated Ascend device (issue 38, item 3): it generates, and its greedy
tokens equal the float64 reference.

``sglang.Engine(device="npu", attention_backend="ascend")`` is started in a child process
(tests/lanes/sglang_support/engine_case.py) with ``NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1``
and the lane's import placeholders (tests/placeholders: sgl_kernel_npu, whose kernels the engine's text
path launches are npu-shim's emulation, npu_shim/emulation/sgl_kernels.py; torchair), on a tiny
random-weight Qwen2 saved to a temporary folder (tests/lanes/engine_support/tiny.py; no downloads,
token ids in, no tokenizer), eager, TP 1, float32 (the attention and KV-cache ops take float32 only
inside the emulation's math-check switch, which the child holds open); shim on (its bootstrap
``sitecustomize`` on ``PYTHONPATH``) and off (``NPU_SHIM=0``).

The engine runs whole on the emulated device: weights on ``npu``, the KV cache in the device's memory,
sglang's NPU token allocator (``alloc_extend_kernel``), the Ascend backend's prefill
(``torch_npu._npu_flash_attention_qlens``) and decode (``_npu_paged_attention``), KV writes
(``_npu_reshape_and_cache``). Its greedy tokens for prompts of 3, 9 and 41 tokens, batched, must equal
transformers' greedy argmax in float64 on the same weights. A second engine serves the issue's cases:
chunked prefill (128-token chunks), a prefix-cache hit (a later prompt sharing a cached page) and a
decode across a page edge (page size 128), its tokens equal the reference too. The blockers met on the
way, in order, are in docs/validation.md ("sglang's engine on the emulated device").

Runs on the lanes that pin the newest and the oldest sglang (sglang_support/engine_lanes.py, read from the
pin files). On the oldest, ``support_triton`` is true on an NPU and the engine launches sglang's own Triton
kernels (``write_req_to_token_pool_triton``, ``compute_position_kernel``: emulated,
npu_shim/emulation/sgl_kernels.py, put in place by the child), and its scheduler logs each prefill's
page-rounded budget as ``#new-token``.
"""
import random
import re

import pytest
from engine_support import tiny  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)
from sglang_support import engine_lanes, engine_run  # noqa: E402


pytestmark = [pytest.mark.lanes(*engine_lanes.LANES), pytest.mark.engine]

PROMPTS = tiny.PROMPTS
MAX_NEW = tiny.MAX_NEW


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.save_qwen2(str(tmp_path_factory.mktemp("qwen2_tiny")))


def _run_engine(model_dir, tmp_path, shim_on, spec=PROMPTS):
    return engine_run.run(model_dir, tmp_path, shim_on, spec)


@pytest.mark.parametrize("shim_on", [True, False], ids=["shim-on", "shim-off"])
def test_engine_on_the_emulated_npu(model_dir, tmp_path, shim_on):
    rc, output = _run_engine(model_dir, tmp_path, shim_on)
    result = tiny.engine_result(rc, output)
    assert result["device"] == "npu" and result["attention_backend"] == "ascend", result
    assert "KV Cache is allocated" in output, output[-3000:]  # in the emulated device's memory
    # the shim's sglang patches reach the scheduler process (which ones apply is the release's: on the
    # newest lane sglang.npu_mha_v_head_dim among them, on the oldest the vision patches' oldest families)
    assert bool(re.search(r"applied sglang\.\w+", output)) == shim_on, output[-3000:]
    assert result["tokens"] == tiny.reference_tokens(model_dir)


# The cases, in one engine: sglang's NPU page size is 128 (read from the log), the prefill chunk 128.
_rng = random.Random(7)
LONG = [_rng.randint(2, 127) for _ in range(140)]       # prefilled in two chunks (128 + 12)
EDGE = [_rng.randint(2, 127) for _ in range(125)]       # decodes positions 125-130: across the page edge at 128
CHUNKED = [_rng.randint(2, 127) for _ in range(200)]    # two chunks (128 + 72), the second after a 128 prefix
SHARED = LONG[:130] + [_rng.randint(2, 127) for _ in range(20)]  # after LONG: its first page from the cache
CASES = {"rounds": [[LONG, EDGE, CHUNKED], [SHARED]], "server": {"context_length": 256, "chunked_prefill_size": 128}}


def _prefills(output):
    """(new tokens, cached tokens) of each prefill batch the scheduler logged."""
    return [(int(a), int(b)) for a, b in re.findall(r"Prefill batch, #new-seq: \d+, #new-token: (\d+), "
                                                   r"#cached-token: (\d+)", output)]


@pytest.mark.parametrize("shim_on", [True, False], ids=["shim-on", "shim-off"])
def test_chunked_prefill_prefix_hit_and_decode_across_a_page(model_dir, tmp_path, shim_on):
    """Prompts of 140, 125 and 200 tokens in one batch with 128-token prefill chunks, then a prompt sharing
    the 140-token one's first 130 tokens: the scheduler's log shows the chunks (128 + 12, 125, 128 + 72)
    and the prefix hit (one page of 128 tokens cached, 22 new); the 125-token prompt decodes across the
    page edge. Every greedy token equals the float64 reference."""
    rc, output = _run_engine(model_dir, tmp_path, shim_on, CASES)
    result = tiny.engine_result(rc, output)
    assert result["device"] == "npu" and result["chunked_prefill_size"] == 128, result
    # sglang's NPU default, resolved at start-up in the scheduler (the launcher's server_args may keep None)
    assert re.search(r"""['"]?page_size['"]?(: |=)128\b""", output), output[-3000:]
    chunks = [(128, 0), (12, 0), (125, 0), (128, 0), (72, 0), (22, 128)]
    # the oldest lane's scheduler logs each batch's page-rounded budget as #new-token (its PrefillAdder adds
    # ceil_paged_tokens(extend_input_len) to log_input_tokens): the same six batches, the same cached page
    budgets = [(-(-new // 128) * 128, cached) for new, cached in chunks]
    assert sorted(_prefills(output)) in (sorted(chunks), sorted(budgets)), _prefills(output)
    prompts = [p for batch in CASES["rounds"] for p in batch]
    assert result["tokens"] == tiny.reference_tokens(model_dir, prompts)
