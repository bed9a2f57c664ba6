"""``sglang.small_page_fia`` through sglang's engine (README row "sglang on Ascend ... small-page prefill
defects"; issue 38, item 4): ``sglang.Engine(device="npu", attention_backend="ascend", page_size=P)`` with
KV pages smaller than 128, on the emulated device, as tests/lanes/test_engine_sglang.py starts it
(tests/lanes/sglang_support/engine_case.py: tiny random-weight Qwen2, float32, eager, TP 1).

The case, per page size: prompts of 3, 9 and 41 tokens in one batch, then one of 200 tokens prefilled
in 128-token chunks (the second chunk after a 128-token prefix), then a prompt of 154 tokens whose first
150 are the 200-token prompt's (a prefix-cache hit of whole pages: 144 tokens at page 16, 128 at page
64; the extend's queries attend to cached pages and to their own). Greedy tokens must equal transformers' float64 greedy argmax on the same
weights.

* Shim on: every prefill takes sglang's own FIA prefill branch (``sglang.small_page_fia``), and the
  tokens equal the reference.
* Shim off: upstream sends the prefill to ``torch_npu._npu_flash_attention_qlens`` with a cache of
  block size P. On the hardware that gives wrong output with no error (sglang issue #38196, page 16 on
  910C; PR #39905's differential test: wrong at 16, 32 and 64, NaN at 64); the emulated op refuses any
  block size but 128 (its page: "blockSize必须设为128"), so here the request fails, naming the op and
  the block size. Either way upstream does not serve these pages; the shim does.

Runs on the lane that pins the newest sglang (read from the pin files).
"""
import random

import pytest
from engine_support import tiny  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)
from sglang_support import engine_run, newest  # noqa: E402


pytestmark = [pytest.mark.lanes(newest.LANE), pytest.mark.engine]

_rng = random.Random(11)
CHUNKED = [_rng.randint(2, 127) for _ in range(200)]                      # 128 + 72, the second after 128
SHARED = CHUNKED[:150] + [_rng.randint(2, 127) for _ in range(4)]         # CHUNKED's whole pages cached
ROUNDS = [list(tiny.PROMPTS), [CHUNKED], [SHARED]]
QLENS_REFUSAL = "_npu_flash_attention_qlens: blockSize=128 is required"
# Head dim 128 (hidden 256, 2 query heads, 1 K/V head): sglang's FIA prefill takes layout TND, paged, for
# head dims 128/192/256 (``AscendAttnBackend._can_use_tnd``), the path the patch's tests measured; other head
# dims take its per-sequence BSND call over the paged cache, which the emulation does not model.
MODEL = {"hidden_size": 256, "num_attention_heads": 2, "num_key_value_heads": 1}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny.save_qwen2(str(tmp_path_factory.mktemp("qwen2_tiny")), **MODEL)


@pytest.fixture(scope="module")
def reference(model_dir):
    return tiny.reference_tokens(model_dir, [p for batch in ROUNDS for p in batch])


def _run_engine(model_dir, tmp_path, shim_on, page_size):
    server = {"page_size": page_size, "context_length": 256, "chunked_prefill_size": 128}
    return engine_run.run(model_dir, tmp_path, shim_on, {"rounds": ROUNDS, "server": server},
                          what="sglang.Engine (page size %d)" % page_size)


def _cached_tokens(output):
    import re

    return [int(n) for n in re.findall(r"Prefill batch, #new-seq: \d+, #new-token: \d+, #cached-token: (\d+)",
                                       output)]


@pytest.mark.parametrize("page_size", [16, 64])
def test_small_pages_served_with_the_shim(model_dir, reference, tmp_path, page_size):
    rc, output = _run_engine(model_dir, tmp_path, True, page_size)
    result = tiny.engine_result(rc, output)
    assert (result["device"], result["attention_backend"], result["page_size"]) == ("npu", "ascend", page_size), \
        result
    assert "applied sglang.small_page_fia" in output, output[-3000:]
    # the shared prompt found the 200-token prompt's whole pages among its first 150 tokens in the cache
    assert _cached_tokens(output)[-1] == 150 // page_size * page_size, _cached_tokens(output)
    assert result["tokens"] == reference


def test_small_pages_fail_upstream(model_dir, tmp_path):
    rc, output = _run_engine(model_dir, tmp_path, False, 16)
    assert "applied sglang.small_page_fia" not in output, output[-3000:]
    assert rc != 0 and "ENGINE_RESULT " not in output, output[-3000:]
    assert QLENS_REFUSAL in output and "block size 16" in output, output[-3000:]
