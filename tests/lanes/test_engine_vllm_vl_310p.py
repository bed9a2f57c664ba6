"""vLLM's real engine on an emulated 310P (Atlas inference card) serving the tiny Qwen2.5-VL one image
request through vllm-ascend 0.30's own 310P path (issue 38, item 4: "the 310P merge, where the SoC is
set to 310P").

The image case of test_engine_vllm_vl.py (tests/lanes/engine_support/vllm_vl_case.py: ``vllm.LLM(...)``
in a child, vllm-ascend's platform plugin, the emulated device, eager, TP 1, the same tiny random-weight
Qwen2.5-VL, prompt and 168 x 112 picture), with three settings changed for the child:

* ``NPU_SHIM_EMULATE_SOC=Ascend310P3``: torch_npu reports a 310P SoC;
* ``ENGINE_CASE_BUILD_DEVICE_TYPE=_310P``: the installed vllm-ascend stands for its 310P build (its
  ``_build_info.__device_type__``, the one line the build writes per device family; the worker refuses a
  build that does not match the SoC), so vllm-ascend chooses its 310P hardware profile: the 310P model
  runner and worker (``vllm_ascend/_310p``), the ``AscendAttentionBackend310`` decoder attention
  (``_npu_flash_attention`` prefill with an NZ causal mask, ``_npu_paged_attention`` decode, KV cache
  made by ``torch_npu.empty_with_format(..., FRACTAL_NZ)`` in the (num_blocks, Nkv*D/16, block, 16)
  layout and written by ``_npu_reshape_and_cache``), and the 310P custom ops (``AscendMMEncoderAttention310``
  for the tower, the 310P norms, rotary and activation);
* ``ENGINE_CASE_INDEX_PUT_DEFECT=1``: the whole engine runs inside the emulated aicpu IndexPut defect of
  310P (npu_shim.emulation.index_put: a boolean-mask ``index_put_`` on a device tensor raises error
  507018, vllm-ascend #12086).

Weights and activations float32 inside the emulation's math-check switch (as the A2 image case): 310P
serves float16 (no bfloat16 there), and the emulated 310P ops take float32 only inside
``float32_not_on_hardware()``, where the comparison with float64 is tight enough to see a wrong
element. Checked, shim on: the 6 greedy tokens equal transformers' float64 greedy argmax (3-D rope
positions), each log-probability within ``LOGPROB_TOL`` of float64 and no near-tie in float64; the decoder
attention is vllm-ascend's 310P impl with an NZ KV cache and ran the 310P ops (op counts); the image
merge was the shim's ``vllm.mm_merge_310p`` (counted in the engine's process, none handed to upstream's);
the tower's attention was the shim's ``vllm.mm_encoder_attn_310p`` with 0 device->host reads per tower
forward, counted at dispatch. Shim off: the engine starts, the tower reads the lengths back as upstream's
310P tower alone does (``upstream_tower_reads_310p``, measured here), and the request fails at vLLM's
``_merge_multimodal_embeddings`` with the aicpu error, as #12086 reports (the check can fail).
"""
import json
import os
import sys

import pytest
from engine_support import tiny, tiny_vl  # noqa: E402  (tests/lanes/conftest.py puts tests/lanes on sys.path)
from test_engine_vllm import DEVICE_MEMORY_MIB, LANES, PLATFORM

from npu_shim.testing.errors import Tolerance
from npu_shim.testing.towers import SOC_310P

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
CASE = os.path.join(ROOT, "tests", "lanes", "engine_support", "vllm_vl_case.py")

# the newest same-minor lane (vllm-ascend 0.30.0rc2 with vLLM 0.30): its _310p path
pytestmark = [pytest.mark.lanes(LANES[-1]), pytest.mark.engine]

TIMEOUT_S = 300
TEXT_HEAD = 128
ENCODER_ATTENTION = ["vllm_ascend._310p.ops.mm_encoder_attention.AscendMMEncoderAttention310"]
DECODER_ATTENTION = ["vllm_ascend._310p.attention.attention_v1.AscendAttentionBackendImpl310"]
NZ = 29
# max |engine log-probability - float64|, float32 weights and KV cache: measured 7.6e-6 on vllm-0.30 (the
# smallest float64 greedy margin of the request is 1.6e-2)
LOGPROB_TOL = Tolerance("vLLM engine on 310P, Qwen2.5-VL with an image: log-probabilities vs float64", 5e-5,
                        "float32")
SOC_ENV = {"NPU_SHIM_EMULATE_SOC": SOC_310P, "ENGINE_CASE_BUILD_DEVICE_TYPE": "_310P",
           "ENGINE_CASE_INDEX_PUT_DEFECT": "1"}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    return tiny_vl.save(str(tmp_path_factory.mktemp("qwen2_5_vl_tiny_310p")), text_head=TEXT_HEAD)


@pytest.fixture(scope="module")
def processed(model_dir):
    return tiny_vl.processed(model_dir)


@pytest.fixture(scope="module")
def reference(model_dir, processed):
    return tiny_vl.reference_steps(model_dir, processed)


@pytest.fixture(scope="module")
def upstream_tower_reads_310p(model_dir, processed):
    """Upstream's device->host reads for the request's image on 310P, measured on upstream's tower
    alone: vLLM's Qwen2.5-VL tower from the saved vision config, vllm-ascend's untouched
    ``AscendMMEncoderAttention310``, vLLM's own tower code, the SoC set to 310P, float16, counted by
    ``count_host_syncs``. Returns ``{kind: count}``."""
    import torch
    from transformers import AutoConfig

    from npu_shim.testing import count_host_syncs, towers

    before = os.environ.get("NPU_SHIM_EMULATE_SOC")
    towers.emulate_device_class("310P")
    try:
        stack = towers.setup()
        name = "Qwen2.5-VL"
        cls = getattr(stack.modules[name], towers.TOWERS[name][1])
        vision = AutoConfig.from_pretrained(model_dir).vision_config
        tower = towers.build_tower_of(stack, cls, lambda: vision, stack.upstream["310P"], dtype=torch.float16)
        grid = processed["image_grid_thw"].tolist()
        x = towers.pixel_values(tower, grid)
        with torch.inference_mode(), towers.registered(stack.upstream["310P"]), towers.upstream_code(stack, name):
            with count_host_syncs(device_tensors=[x], device_modules=[tower]) as syncs:
                tower(x, grid_thw=grid)
    finally:
        if before is None:
            os.environ.pop("NPU_SHIM_EMULATE_SOC", None)
        else:
            os.environ["NPU_SHIM_EMULATE_SOC"] = before
    return dict(syncs.kinds())


def _run_engine(model_dir, tmp_path, shim_on):
    request = tmp_path / "request.json"
    request.write_text(json.dumps({"prompt": tiny_vl.PROMPT}))
    env = tiny.child_env(shim_on, drop=("NPU_SHIM", "VLLM_", "ENGINE_CASE_"), VLLM_ENABLE_V1_MULTIPROCESSING="0",
                         HF_HUB_OFFLINE="1", NPU_SHIM_EMULATE_DEVICE_MEMORY_MIB=DEVICE_MEMORY_MIB, **SOC_ENV)
    return tiny.run_child([sys.executable, CASE, model_dir, str(request), str(tiny_vl.MAX_NEW)], env,
                          str(tmp_path), TIMEOUT_S, "vllm.LLM (Qwen2.5-VL, 310P)")


def _tower_reads(output):
    return [json.loads(line[len("ENGINE_TOWER_READS "):]) for line in output.splitlines()
            if line.startswith("ENGINE_TOWER_READS ")]


def test_image_request_on_the_emulated_310p_with_the_shim(model_dir, processed, reference, tmp_path):
    rc, output = _run_engine(model_dir, tmp_path, True)
    assert PLATFORM in output, output[-3000:]
    result = tiny.engine_result(rc, output)
    assert (result["platform"], result["device_type"], result["dtype"]) == ("NPUPlatform", "npu", "torch.float32")
    # vllm-ascend's 310P path: the tower's and the decoder's attention classes, the NZ KV cache, the 310P ops
    assert result["encoder_attention"] == ENCODER_ATTENTION, result
    assert result["decoder_attention"]["impl"] == DECODER_ATTENTION, result
    caches = result["decoder_attention"]["kv_cache"]
    assert caches and all(c.endswith("format %d" % NZ) and c.startswith("(") and c.count(",") == 3
                          for c in caches), caches
    ops = result["ops"]
    assert all(ops.get(op, 0) > 0 for op in ("_npu_flash_attention", "_npu_paged_attention",
                                             "_npu_reshape_and_cache", "_npu_flash_attention_unpad")), ops
    assert not any(op.startswith("npu_fused_infer_attention_score") for op in ops), ops  # no A2 attention
    # the request, against float64
    assert result["prompt_token_ids"] == processed["input_ids"][0].tolist(), result
    assert result["tokens"] == [t for t, _, _ in reference], result
    assert len(result["logprobs"]) == tiny_vl.MAX_NEW, result
    assert min(margin for _, _, margin in reference) > 10 * LOGPROB_TOL
    assert max(abs(got - want) for got, (_, want, _) in zip(result["logprobs"], reference)) < LOGPROB_TOL
    # the tower: once for the request, 0 device->host reads, every encoder attention call the shim's
    assert result["tower_reads"] == [{"count": 0, "kinds": {}}], result
    attn = result["shim"].get("vllm.mm_encoder_attn_310p")
    assert attn and attn["calls"] > 0 and (attn["upstream_calls"], attn["host_copies"]) == (0, 0), result
    # the merge: the shim's, in the engine's process, inside the emulated IndexPut defect
    merge = result["shim"].get("vllm.mm_merge_310p")
    assert merge and merge["calls"] >= 1 and merge["upstream_calls"] == 0, result


def test_image_request_on_the_emulated_310p_without_the_shim_dies_at_the_merge(
        model_dir, upstream_tower_reads_310p, tmp_path):
    rc, output = _run_engine(model_dir, tmp_path, False)
    assert PLATFORM in output and "ENGINE_STAGE engine" in output, output[-3000:]  # the engine started
    assert rc != 0 and "ENGINE_RESULT " not in output, output[-3000:]
    # upstream's tower ran for the request, reading the lengths back as upstream's 310P tower alone does
    reads = _tower_reads(output)
    assert len(reads) == 1 and upstream_tower_reads_310p and reads[0]["kinds"] == upstream_tower_reads_310p, \
        (reads, upstream_tower_reads_310p)
    # then vLLM's merge assigned through the boolean mask: the aicpu IndexPut kernel's error (vllm-ascend #12086)
    tail = output[output.index("ENGINE_TOWER_READS"):]
    assert "_merge_multimodal_embeddings" in tail and "error code is 507018" in tail, tail[-3000:]
    assert "ValueError: Error during index put operation" in tail, tail[-3000:]
