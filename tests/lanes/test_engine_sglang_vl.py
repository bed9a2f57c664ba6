"""sglang's real engine on the emulated Ascend device serving a tiny Qwen2.5-VL one image request
(issue 38, items 3 and 4): its greedy tokens equal the float64 reference, shim on and off, and the
shim's sglang vision claims hold through the engine.

``sglang.Engine(device="npu", attention_backend="ascend")`` (multimodal attention: sglang's default on
NPU, ``ascend_attn``) is started in a child process (tests/lanes/sglang_support/engine_vl_case.py) as
the text test starts it (tests/lanes/test_engine_sglang.py: ``NPU_SHIM_EMULATE=1
NPU_SHIM_EMULATE_DEVICE=1``, the lane's import placeholders, eager, TP 1, float32 under the
emulation's math-check switch), on a tiny random-weight Qwen2.5-VL saved to a temporary folder with
its tokenizer and slow image processor (tests/lanes/engine_support/tiny_vl.py; no downloads): text
head 64, mrope; vision tower of 2 blocks (one windowed, one full), 2 heads of 64 or of 80
(Qwen2.5-VL's own). One request: a text prompt with one image (168 x 112 pixels, made by the test,
24 image tokens after the merge), ``engine.generate(prompt=..., image_data=[file])``: sglang's own
processor, its Qwen2.5-VL tower and mrope, the Ascend backend's prefill and decode.

* Tokens: the 6 greedy tokens equal transformers' ``Qwen2_5_VLForConditionalGeneration`` in float64
  (eager attention) on the same weights and the processor's inputs; the reference's top-2 margins are
  in the assertion message (smallest 0.038, head 64, step 5).
* Reads (README row "sglang: Qwen2.5-VL, Qwen3-VL, GLM-4V towers": 0 device->host reads per forward):
  the device->host transfers the emulated device counts at dispatch during the tower's forward, in the
  scheduler process (module-wide forward hooks that only count). Shim on: 0. Shim off: upstream's 3
  reads of the tower (``sglang.qwen2_5_vl_host_lengths``) + 1 per vision attention metadata object
  (window and full: 2) + 1 per layer (``sglang.vision_host_lengths``) on 0.5.23, measured in the same run
  on upstream's tower alone (``upstream_tower_reads``: the saved vision config, the image's grid, counted
  as tests/lanes/test_sglang_towers.py counts), so the device's counter at dispatch and the tower tests'
  counter agree on the engine's tower.
* Head 80 (README row "sglang: vision towers with head dims between 64 and 128",
  ``sglang.vision_head_pad``): shim on, the tokens equal the reference; shim off, or on with that patch
  alone switched off, the engine fails at the image request, FIA (TND) refusing head dim 80 as the op's
  documentation says CANN does.

Runs on the lane that pins the newest sglang and on the lane above the oldest (sglang_support/engine_lanes.py,
read from the pin files: the oldest's NPU image-processor wrapper refuses transformers' call). There the
shim's tower patches of that release's families (``sglang.qwen2_5_vl_host_lengths``,
``sglang.vision_device_lengths``; ``sglang.vision_host_lengths`` has no family there) must apply, and the
tower's reads through the engine are 0 shim on and upstream's measured count shim off. Shim off, the request
then stops in upstream's text rope (``MRotaryEmbedding.forward_npu`` hands the 2-D mrope positions to
``npu_mrope`` with ``mrope_section=[0, 0, 0]``, which the emulated op refuses; the hardware returns wrong
rotary instead, sglang PRs #38499, #36959), asserted as such; shim on, ``sglang.npu_mrope_positions`` (applied
there, asserted) routes them to ``forward_native`` as the newest release does, and the greedy tokens equal the
float64 reference on both lanes. The head-80 test skips, naming ``sglang.vision_head_pad``'s fences, where no
family of it claims the lane's release.
"""
import json
import os
import sys

import pytest
from engine_support import tiny, tiny_vl  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)
from sglang_support import engine_lanes, engine_run  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
LANE = os.environ.get("NPU_SHIM_LANE", "")
CASE = os.path.join(ROOT, "tests", "lanes", "sglang_support", "engine_vl_case.py")

pytestmark = [pytest.mark.lanes(*engine_lanes.VL_LANES), pytest.mark.engine]

TIMEOUT_S = 400


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """Per tower head size: (model folder, reference steps, prompt length); and the image file."""
    folder = tmp_path_factory.mktemp("qwen2_5_vl_tiny")
    image_file = str(folder / "image.png")
    tiny_vl.image().save(image_file)
    models = {}
    for head in (64, 80):
        model_dir = tiny_vl.save(str(folder / ("head%d" % head)), vision_head=head)
        inputs = tiny_vl.processed(model_dir)
        models[head] = (model_dir, tiny_vl.reference_steps(model_dir, inputs), inputs["input_ids"].shape[1])
    return models, image_file


@pytest.fixture(scope="module")
def upstream_tower_reads(served, tmp_path_factory):
    """Upstream's device->host reads for the request's image, measured on upstream's tower alone:
    sglang's ``Qwen2_5_VisionTransformer`` built from the head-64 model's saved vision config, the
    shim uninstalled for its forward, the image's grid, counted as tests/lanes/test_sglang_towers.py
    counts (npu_shim.testing.sglang_towers.forward: ``count_host_syncs`` over CPU stand-ins; on 0.5.23
    the tower's own 3, one per vision attention metadata object, one per layer), in a child process
    (tests/lanes/sglang_support/tower_reads_case.py says why)."""
    models, _ = served
    case = os.path.join(ROOT, "tests", "lanes", "sglang_support", "tower_reads_case.py")
    rc, output = tiny.run_child([sys.executable, case, models[64][0]], dict(os.environ),
                                str(tmp_path_factory.getbasetemp()), TIMEOUT_S, "upstream's tower alone")
    counts = [int(line.split()[1]) for line in output.splitlines() if line.startswith("UPSTREAM_TOWER_READS ")]
    assert rc == 0 and len(counts) == 1, output[-3000:]
    return counts[0]


def _claimed_here(patch):
    """Whether a family of ``patch`` claims this lane's pinned release (its fences and the pin files)."""
    from npu_shim.reference import claimed_lanes

    return LANE in claimed_lanes(ROOT).get(patch, [])


def _fences(patch):
    import importlib

    from npu_shim.patches import BUILTIN_PATCHES

    return ", ".join(f.fence or "any" for f in importlib.import_module(dict(BUILTIN_PATCHES)[patch]).PATCH.families)


def _mrope_hands_npu_2d_positions():
    """Whether this release's ``MRotaryEmbedding.forward_npu`` hands Qwen2.5-VL's 2-D (3, T) positions to
    ``torch_npu.npu_mrope`` with ``mrope_section=[0, 0, 0]`` (ordinary RoPE, documented for 1-D positions
    only: op-plugin's own test calls it so with 1-D positions alone). The newest lane's sends 2-D positions
    to its ``forward_native`` first ("The NPU call below selects ordinary RoPE, which requires 1D
    positions"); the older lanes' does not, and the emulated op refuses the call by name. Read from the
    installed file: in this process the shim may have replaced the method already."""
    import ast
    import importlib.util

    path = importlib.util.find_spec("sglang.srt.layers.rotary_embedding.mrope").origin
    with open(path, encoding="utf-8") as handle:
        text = handle.read()
    layer = next(node for node in ast.parse(text).body
                 if isinstance(node, ast.ClassDef) and node.name == "MRotaryEmbedding")
    method = next(node for node in layer.body if isinstance(node, ast.FunctionDef) and node.name == "forward_npu")
    source = ast.get_source_segment(text, method)
    return "mrope_section = [0, 0, 0]" in source and "positions.ndim" not in source


MROPE_REFUSAL = ("npu_mrope: mrope_section [0, 0, 0] must have one entry per positions row (3) and sum to "
                 "rotary_dim / 2")


def _run_engine(model_dir, image_file, tmp_path, shim_on, **switches):
    env = engine_run.child_env(shim_on, **switches)
    rc, output = tiny.run_child([sys.executable, CASE, model_dir, image_file, tiny_vl.PROMPT, str(tiny_vl.MAX_NEW)],
                                env, str(tmp_path), TIMEOUT_S, "sglang.Engine with an image")
    results = [json.loads(line[len("ENGINE_RESULT "):]) for line in output.splitlines()
               if line.startswith("ENGINE_RESULT ")]
    reads = [json.loads(line[len("TOWER_READS "):]) for line in output.splitlines() if line.startswith("TOWER_READS ")]
    return rc, output, results, reads


def _check_served(served_model, rc, output, results, reads, shim_on, upstream_reads=None):
    _, steps, prompt_len = served_model
    for patch in ("sglang.vision_host_lengths", "sglang.qwen2_5_vl_host_lengths", "sglang.vision_device_lengths",
                  "sglang.npu_mrope_positions"):
        # the patches whose family claims this release reach the scheduler; the others do not apply
        assert ("applied %s " % patch in output) == (shim_on and _claimed_here(patch)), (patch, output[-3000:])
    if _mrope_hands_npu_2d_positions() and not (shim_on and _claimed_here("sglang.npu_mrope_positions")):
        # upstream's own text rope stops the request after the tower forward (sglang.npu_mrope_positions routes
        # the 2-D positions to forward_native); the tower's reads are measured all the same (below)
        assert rc != 0 and not results and MROPE_REFUSAL in output, output[-3000:]
    else:
        assert rc == 0 and results, output[-3000:]
        result = results[-1]
        assert result["device"] == "npu" and result["attention_backend"] == "ascend", result
        assert result["prompt_tokens"] == prompt_len, result  # sglang expanded the image to the processor's 24 pads
        assert result["tokens"] == [s[0] for s in steps], ("reference (token, log-probability, margin)", steps)
    assert len(reads) == 1 and reads[0]["module"] == "sglang.srt.models.qwen2_5_vl", reads  # one tower forward
    if shim_on:
        assert reads[0]["count"] == 0, reads
    else:   # counted at dispatch through the engine: upstream's tower alone, counted as the tower tests count
        assert upstream_reads and reads[0]["count"] == upstream_reads, (reads, upstream_reads)


@pytest.mark.parametrize("shim_on", [True, False], ids=["shim-on", "shim-off"])
def test_image_request_tokens_and_tower_reads(served, upstream_tower_reads, tmp_path, shim_on):
    models, image_file = served
    _check_served(models[64], *_run_engine(models[64][0], image_file, tmp_path, shim_on), shim_on,
                  upstream_reads=upstream_tower_reads)


@pytest.mark.parametrize("shim_on,pad", [(True, True), (False, False), (True, False)],
                         ids=["shim-on", "shim-off", "shim-on-pad-off"])
def test_head_80_tower(served, tmp_path, shim_on, pad):
    """shim-on-pad-off: the shim on with ``sglang.vision_head_pad`` alone switched off
    (``NPU_SHIM_SGLANG_VISION_HEAD_PAD=0``) fails as upstream does: the padding is that patch's."""
    if not _claimed_here("sglang.vision_head_pad"):
        pytest.skip("sglang.vision_head_pad: no family for this lane's sglang (fences %s)"
                    % _fences("sglang.vision_head_pad"))
    models, image_file = served
    switches = {} if pad else {"NPU_SHIM_SGLANG_VISION_HEAD_PAD": "0"}
    rc, output, results, reads = _run_engine(models[80][0], image_file, tmp_path, shim_on, **switches)
    if pad:
        assert "applied sglang.vision_head_pad" in output, output[-3000:]
        _check_served(models[80], rc, output, results, reads, shim_on)
    else:
        # upstream hands FIA (TND) the model's head dim 80, which the op refuses: the image request fails
        assert rc != 0 and not results, output[-3000:]
        assert "When layout is TND, queryD(80), keyD(80) and valueD(80) must be same" in output, output[-3000:]
