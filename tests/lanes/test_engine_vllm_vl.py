"""vLLM's real engine with vllm-ascend's platform plugin on the emulated Ascend device serving a tiny
Qwen2.5-VL one request with one image (issue 38, items 2 and 4): greedy tokens equal to the float64
reference, shim on and off, and the tower's device->host reads through the engine, on each lane of
the text engine test's LANES (one per transformers major: vllm-0.18 and vllm-0.30).

``vllm.LLM(...)`` is started in a child process (tests/lanes/engine_support/vllm_vl_case.py) the way
the text test starts it (tests/lanes/test_engine_vllm.py: emulated device of 1 GiB, in-process
engine core, every vLLM plugin on, eager, TP 1, float32), on a random-weight Qwen2.5-VL the test
saves with transformers (tests/lanes/engine_support/tiny_vl.py: text 2 layers, 4 heads of 128,
``mrope_section`` [16, 24, 24], the sections for which vllm-ascend calls ``npu_mrope``; vision 2
blocks, 2 heads of 80 as Qwen2.5-VL's own, window attention and one full-attention block), its
word-level tokenizer with Qwen2.5-VL's special tokens (saved as Qwen2's fast class where transformers 4's
processor accepts no other), and the slow (PIL/numpy) Qwen2-VL image
processor (torchvision has no CPU build for the lane's torch). The request: ``{"prompt": text with
<|vision_start|><|image_pad|><|vision_end|>, "multi_modal_data": {"image": a 168 x 112 picture made
here}}``: 96 patches, 24 image tokens, two attention windows.

Checked, shim on and off: vLLM's prompt token ids are the processor's (the 24 image pads expanded),
the tower's layers are vllm-ascend's ``AscendMMEncoderAttention`` (the platform's registration), the 6
greedy tokens equal transformers' ``Qwen2_5_VLForConditionalGeneration`` greedy argmax in float64 on
the same weights and processed inputs (3-D rope positions), each log-probability within
``LOGPROB_TOL`` of float64, and the float64 greedy margins are no near-tie. Read claim (README row
"vLLM: Qwen2.5-VL ... towers", 0.18 and 0.30: 0 device->host reads per tower forward): counted on the
emulated device at dispatch around the tower's forward as ``embed_multimodal`` calls it, once for
the request: 0 with the shim; without it, upstream's reads as measured in this run on upstream's tower
alone (``upstream_tower_reads``: the same vision config and image grid, vLLM's tower code, vllm-ascend's
untouched attention class, today's counter ``count_host_syncs``; vllm-ascend's attention reads the
lengths back in every layer, ``.to("cpu")`` in 0.18 and ``.cpu()`` in 0.30, so 2 for the tiny tower's
2 blocks), so the device's counter at dispatch and the tower tests' counter agree on the engine's
tower; with the shim, the tower's attention calls are the shim's ``vllm.mm_encoder_attn`` (none
handed to upstream's, no host copy; ``npu_shim.stats()`` in the child), and the host lengths it took
were kept by the release's host-lengths patch, which counted them: ``vllm.qwen2_5_vl_host_lengths``
where the tower copies ``cu_seqlens`` itself (it applies only there: vLLM 0.18), else
``vllm.mm_encoder_host_lengths``. The shim's encoder attention at the tower's head 80 keeps
vllm-ascend's own pad to 128 (the emulated FIA refuses 80 in layout TND, as CANN does). Mutants
``engine-vl-reads`` (the attention ignores vLLM's host copy; vllm-0.30) and ``engine-vl-reads-tower-copy``
(0.18's tower copies keep no host array; vllm-0.18) must fail this test.
"""
import json
import os
import sys

import pytest
from engine_support import tiny, tiny_vl  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)
from test_engine_vllm import DEVICE_MEMORY_MIB, LANES, PLATFORM

from npu_shim.testing.errors import Tolerance

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASE = os.path.join(ROOT, "tests", "lanes", "engine_support", "vllm_vl_case.py")

# The text engine test's lanes, one per transformers major; tiny_vl takes the slow image processor, the
# tokenizer class and the reference's inputs the installed transformers has, and the child's video
# processor placeholder reaches the processor where transformers 4.57 hands out a dummy (docs/validation.md).
pytestmark = [pytest.mark.lanes(*LANES), pytest.mark.engine]

TIMEOUT_S = 300
# The decoder's head size: at 128 the mrope sections are [16, 24, 24], the ones for which vllm-ascend
# calls npu_mrope (at 64 it takes vLLM's own rotary path).
TEXT_HEAD = 128
ENCODER_ATTENTION = ["vllm_ascend.ops.mm_encoder_attention.AscendMMEncoderAttention"]
# max |engine log-probability - float64|, float32 weights and KV cache: measured 9.5e-6 on vllm-0.30;
# the smallest float64 greedy margin of the request is 1.6e-2, so equal tokens are no tie broken by luck
LOGPROB_TOL = Tolerance("vLLM engine, Qwen2.5-VL with an image: log-probabilities vs float64", 5e-5, "float32")


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_vl.save(str(tmp_path_factory.mktemp("qwen2_5_vl_tiny")), text_head=TEXT_HEAD)


@pytest.fixture(scope="module")
def processed(model_dir):
    return tiny_vl.processed(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir, processed):
    return tiny_vl.reference_steps(model_dir, processed)


@pytest.fixture(scope="module")
def upstream_tower_reads(model_dir, processed):
    """Upstream's device->host reads for the request's image, measured on upstream's tower alone:
    vLLM's Qwen2.5-VL tower built from the saved vision config, vllm-ascend's untouched
    ``AscendMMEncoderAttention`` (npu_shim.testing.towers), vLLM's own tower code for the forward
    (``upstream_code``), the image's grid, counted by ``count_host_syncs`` (CPU stand-ins watched, the
    counter of the tower tests). Returns ``{kind: count}``."""
    import torch
    from transformers import AutoConfig

    from npu_shim.testing import count_host_syncs, towers

    stack = towers.setup()
    name = "Qwen2.5-VL"
    cls = getattr(stack.modules[name], towers.TOWERS[name][1])
    vision = AutoConfig.from_pretrained(model_dir).vision_config
    tower = towers.build_tower_of(stack, cls, lambda: vision, stack.upstream["A2"])
    grid = processed["image_grid_thw"].tolist()
    x = towers.pixel_values(tower, grid)
    with torch.inference_mode(), towers.registered(stack.upstream["A2"]), towers.upstream_code(stack, name):
        with count_host_syncs(device_tensors=[x], device_modules=[tower]) as syncs:
            tower(x, grid_thw=grid)
    return dict(syncs.kinds())


def test_reference_uses_the_image_grid(model_dir, processed):
    """The float64 reference's rope positions are 3-D over the image's grid (transformers 5 falls
    back to 1-D positions, silently, without ``mm_token_type_ids``; transformers 4 finds the image's
    tokens in ``input_ids``), on each transformers major of LANES."""
    positions = tiny_vl.rope_positions(model_dir, processed)
    length = processed["input_ids"].shape[1]
    assert positions != [list(range(length))] * 3, positions
    image = [i for i, t in enumerate(processed["input_ids"][0].tolist()) if t == tiny_vl.IMAGE_PAD]
    assert len(image) == 24 and {positions[1][i] for i in image} == set(range(3, 7)), positions  # 4 rows


def _run_engine(model_dir, tmp_path, shim_on):
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"prompt": tiny_vl.PROMPT}))
    env = tiny.child_env(shim_on, drop=("NPU_SHIM", "VLLM_"), VLLM_ENABLE_V1_MULTIPROCESSING="0", HF_HUB_OFFLINE="1",
                          NPU_SHIM_EMULATE_DEVICE_MEMORY_MIB=DEVICE_MEMORY_MIB)
    return tiny.run_child([sys.executable, CASE, model_dir, str(request), str(tiny_vl.MAX_NEW)], env,
                          str(tmp_path), TIMEOUT_S, "vllm.LLM (Qwen2.5-VL)")


# One engine start per case per lane.
@pytest.mark.parametrize("shim_on", [True, False], ids=["shim-on", "shim-off"])
def test_image_request_on_the_emulated_npu(model_dir, processed, reference, upstream_tower_reads, tmp_path, shim_on):
    rc, output = _run_engine(model_dir, tmp_path, shim_on)
    assert PLATFORM in output, output[-3000:]
    result = tiny.engine_result(rc, output)
    assert (result["platform"], result["device_type"]) == ("NPUPlatform", "npu"), result
    assert result["encoder_attention"] == ENCODER_ATTENTION, result
    assert result["prompt_token_ids"] == processed["input_ids"][0].tolist(), result
    assert result["tokens"] == [t for t, _, _ in reference], result
    assert len(result["logprobs"]) == tiny_vl.MAX_NEW, result
    assert min(margin for _, _, margin in reference) > 10 * LOGPROB_TOL  # the reference is no near-tie
    assert max(abs(got - want) for got, (_, want, _) in zip(result["logprobs"], reference)) < LOGPROB_TOL
    # the tower ran once, for the request's one image; its device->host reads
    assert len(result["tower_reads"]) == 1, result
    reads = result["tower_reads"][0]
    if shim_on:
        assert reads == {"count": 0, "kinds": {}}, result  # the README row: 0 per tower forward
        # through the shim's encoder attention (every call, none handed to upstream's, no host copy;
        # counted over the process: the profile run's dummy image and the request)
        attn = result["shim"].get("vllm.mm_encoder_attn")
        assert attn and attn["calls"] > 0 and (attn["upstream_calls"], attn["host_copies"]) == (0, 0), result
        # the host lengths were kept by the patch for the tower's copy: its own (applied only where the
        # tower copies cu_seqlens itself), else vLLM's shared copy's
        lengths = ("vllm.qwen2_5_vl_host_lengths" if "vllm.qwen2_5_vl_host_lengths" in result["shim"]
                   else "vllm.mm_encoder_host_lengths")
        assert result["shim"].get(lengths, {}).get("calls"), (lengths, result)
    else:
        assert result["shim"] == {}, result
        # upstream's, before the fix: the engine's tower reads, counted at dispatch, are those of
        # upstream's tower alone on the same image, counted as the tower tests count
        assert upstream_tower_reads and reads["kinds"] == upstream_tower_reads, (result, upstream_tower_reads)
