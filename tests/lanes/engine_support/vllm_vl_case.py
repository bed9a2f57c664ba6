"""Child process: vLLM's real engine, ``vllm.LLM(...)``, with vllm-ascend's platform plugin on the
emulated Ascend device, serving a tiny Qwen2.5-VL one request with one image
(tests/lanes/test_engine_vllm_vl.py runs it).

argv: a model folder (the tiny random-weight Qwen2.5-VL, tokenizer and image processor the test
saved, tests/lanes/engine_support/tiny_vl.py), a JSON file ``{"prompt": text}``, the number of tokens
to generate. The image is ``tiny_vl.image()``, made here as the test makes it. The stand-ins are the
text case's (tests/lanes/engine_support/vllm_case.py: ``main`` runs ``run`` here inside them), plus
the image processor: the slow (PIL/numpy) Qwen2-VL one (``mm_processor_kwargs={"backend": "pil"}``:
the fast one needs torchvision, which has no CPU build for the lane's torch), the video processor's
import-only placeholder (:func:`video_processor_placeholder`; under transformers 4.57 also bound where
the processor looks its classes up, where transformers hands out torchvision dummies), and vLLM's own
Qwen2.5-VL class registered in this process (in :func:`run`).

Device->host reads of the vision tower: forward hooks on the model's ``visual`` module (vLLM's
``Qwen2_5_VisionTransformer``, called by ``embed_multimodal`` -> ``_process_image_input``) open
``npu_shim.emulation.device.count_transfers()`` before its forward and close it after; they only
count (installed after start-up, so the profiling run's dummy image is not counted); each tower forward
also prints ``ENGINE_TOWER_READS <json>`` as it ends (an engine that fails later in the request still
shows them). Prints one line ``ENGINE_RESULT <json>``: the greedy tokens and their log-probabilities,
the prompt's token ids as the engine processed them, the tower's calls and reads (per call: count and
kinds), the platform, the model dtype, the encoder attention class of the tower's layers, the decoder's
attention impl classes and KV-cache shapes with their recorded aclFormat, the calls of each emulated op
(``vllm_case.count_emulated_ops``), and the shim's counters of its applied multimodal patches
(encoder attention, tower, image merge: ``npu_shim.stats()``).

The 310P test (test_engine_vllm_vl_310p.py) sets ``ENGINE_CASE_BUILD_DEVICE_TYPE`` (read by
``vllm_case.main``) and ``ENGINE_CASE_INDEX_PUT_DEFECT=1``: the engine runs inside the emulated aicpu
IndexPut defect (:func:`run_with_index_put_defect`).
"""
import contextlib
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from engine_support import tiny_vl, vllm_case  # noqa: E402  (vllm_case installs the emulation)

MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS, BLOCK_SIZE = 256, 256, 128


def video_processor_placeholder():
    """transformers' Qwen2.5-VL processor always loads a video processor, and transformers' video
    processors are torchvision's (``BaseVideoProcessor`` requires it; no CPU build for the lane's torch):
    ``AutoVideoProcessor.from_pretrained`` returns an import-only placeholder that passes the
    processor's class check and refuses any use but the processor's own bookkeeping (its kwargs
    list, its dict). The request carries an image, no video.

    The processor checks the video processor against ``BaseVideoProcessor`` looked up by name in
    transformers' namespace (``processing_utils.transformers_module``), and transformers 4.57's
    processor also loads it through ``AutoVideoProcessor`` looked up there (transformers 5 takes the
    class from its module). Without torchvision that namespace hands out a dummy for both names
    (``is_dummy``; its every attribute raises "requires the Torchvision library"; the modules
    defining the classes import without it): each dummy name is bound to the class its own module
    defines, so the processor reaches the placeholder's ``from_pretrained`` and checks it against the
    real base. A name that is the class itself (torchvision installed) is left as it is."""
    import importlib

    from transformers import processing_utils
    from transformers.processing_utils import VideosKwargs
    from transformers.utils import PushToHubMixin

    # the modules by import (transformers 4.57's lazy parent hands out a dummy for them as attributes)
    video_processing_auto = importlib.import_module("transformers.models.auto.video_processing_auto")
    video_processing_utils = importlib.import_module("transformers.video_processing_utils")

    AutoVideoProcessor = video_processing_auto.AutoVideoProcessor
    for name, cls in (("AutoVideoProcessor", AutoVideoProcessor),
                      ("BaseVideoProcessor", video_processing_utils.BaseVideoProcessor)):
        # the namespace the processor looks names up in (processing_utils.transformers_module; on transformers
        # 4.57 another module object than the one an earlier ``import transformers`` bound)
        if getattr(getattr(processing_utils.transformers_module, name), "is_dummy", False):
            setattr(processing_utils.transformers_module, name, cls)

    class VideoProcessorPlaceholder(video_processing_utils.BaseVideoProcessor, PushToHubMixin):
        valid_kwargs = VideosKwargs

        def __init__(self):
            pass

        def to_dict(self):
            return {"video_processor_type": "npu-shim test placeholder (no torchvision)"}

        def __getattr__(self, attr):
            if attr.startswith("__"):
                raise AttributeError(attr)
            raise RuntimeError("video processor .%s: an import-only placeholder (no torchvision; "
                               "tests/lanes/engine_support/vllm_vl_case.py)" % attr)

    AutoVideoProcessor.from_pretrained = classmethod(
        lambda cls, *args, **kwargs: VideoProcessorPlaceholder())


def run(model_dir, prompt_file, max_new_tokens):
    with open(prompt_file) as f:
        request = json.load(f)
    prompt = request["prompt"]
    stage = vllm_case.stage
    stage("import")
    import vllm
    from vllm.platforms import current_platform

    stage("platform " + type(current_platform).__name__ + " device_type=" + str(current_platform.device_type))
    from vllm_ascend.worker import block_table

    from npu_shim.emulation import device, triton_kernels

    block_table._compute_slot_mapping_kernel = triton_kernels.compute_slot_mapping
    # vLLM inspects a lazily registered model class in a subprocess, which has no torchvision
    # placeholder (vLLM's qwen2_vl module imports transformers' torchvision image processor module
    # at top): the same class, vLLM's own, registered in this process under its own name.
    from vllm import ModelRegistry
    from vllm.model_executor.models.qwen2_5_vl import Qwen2_5_VLForConditionalGeneration

    ModelRegistry.register_model("Qwen2_5_VLForConditionalGeneration", Qwen2_5_VLForConditionalGeneration)
    ops = vllm_case.count_emulated_ops()
    llm = vllm.LLM(model=model_dir, enforce_eager=True, tensor_parallel_size=1, dtype=vllm_case.DTYPE,
                   max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=0.5, seed=0, max_num_seqs=2,
                   block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                   limit_mm_per_prompt={"image": 1, "video": 0}, mm_processor_kwargs={"backend": "pil"})
    stage("engine")
    calls = []

    def hooks(model):
        tower = model.visual
        stack = contextlib.ExitStack()

        def before(module, args, kwargs):
            calls.append(stack.enter_context(device.count_transfers()))

        def after(module, args, kwargs, output):
            stack.close()
            # printed at once: an engine that fails later in the request still shows its tower's reads
            print("ENGINE_TOWER_READS " + json.dumps({"count": calls[-1].count, "kinds": calls[-1].by_kind()}),
                  flush=True)

        tower.register_forward_pre_hook(before, with_kwargs=True)
        tower.register_forward_hook(after, with_kwargs=True)
        return sorted({type(m).__module__ + "." + type(m).__name__ for m in tower.modules()
                       if "EncoderAttention" in type(m).__name__})

    def decoder(model):
        """The decoder's attention impl classes and the aclFormat of its KV caches (the emulation
        records what torch_npu.empty_with_format / npu_format_cast were asked for)."""
        from vllm.model_executor.layers.attention import Attention

        from npu_shim.emulation.formats import acl_format_of

        layers = [m for m in model.modules() if isinstance(m, Attention)]
        caches = [t for m in layers for t in _tensors(getattr(m, "kv_cache", None))]
        return {"impl": sorted({type(m.impl).__module__ + "." + type(m.impl).__name__ for m in layers}),
                "kv_cache": sorted({"%s format %d" % (tuple(t.shape), acl_format_of(t)) for t in caches})}

    attention = llm.apply_model(hooks)[0]
    decoder_attention = llm.apply_model(decoder)[0]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, logprobs=1)
    inputs = {"prompt": prompt}
    if request.get("image", True):
        inputs["multi_modal_data"] = {"image": tiny_vl.image()}
    outs = llm.generate([inputs], params, use_tqdm=False)
    stage("generate")
    out = outs[0]
    import npu_shim

    # the shim's counters of the multimodal patches: encoder attention, tower, image merge (empty with NPU_SHIM=0)
    shim = {name: {key: row.get(key) for key in ("state", "family", "calls", "upstream_calls", "host_copies")}
            for name, row in npu_shim.stats().items()
            if name.startswith(("vllm.mm_", "vllm.qwen2_5_vl")) and row.get("state") == "applied"}
    result = {"tokens": list(out.outputs[0].token_ids), "prompt_token_ids": list(out.prompt_token_ids),
              "logprobs": [step[t].logprob for step, t in zip(out.outputs[0].logprobs, out.outputs[0].token_ids)],
              "tower_reads": [{"count": c.count, "kinds": c.by_kind()} for c in calls],
              "encoder_attention": attention, "decoder_attention": decoder_attention, "shim": shim, "platform": type(current_platform).__name__,
              "device_type": current_platform.device_type, "ops": dict(sorted(ops.items())),
              "dtype": str(llm.llm_engine.vllm_config.model_config.dtype)}
    print("ENGINE_RESULT " + json.dumps(result), flush=True)


def _tensors(value):
    """The tensors in a layer's ``kv_cache`` (a tensor, or nested lists / tuples of them)."""
    import torch

    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def run_with_index_put_defect(model_dir, prompt_file, max_new_tokens):
    """``run`` inside the emulated 310P aicpu IndexPut defect (npu_shim.emulation.index_put: a boolean-mask
    ``index_put_`` on a device tensor raises error 507018, as vllm-ascend #12086 reports the hardware's
    kernel failing), for the whole engine: start-up, the profile run and the request."""
    from npu_shim.emulation.index_put import aicpu_index_put_defect

    with aicpu_index_put_defect():
        run(model_dir, prompt_file, max_new_tokens)


if __name__ == "__main__":
    video_processor_placeholder()  # before the torchvision placeholder: transformers' auto module as is
    # ENGINE_CASE_INDEX_PUT_DEFECT=1 (set by the 310P test): the engine runs inside the emulated defect
    defect = os.environ.get("ENGINE_CASE_INDEX_PUT_DEFECT") == "1"
    vllm_case.main(sys.argv[1], sys.argv[2], int(sys.argv[3]), runner=run_with_index_put_defect if defect else run)
    os._exit(0)
