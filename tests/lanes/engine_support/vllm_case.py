"""Child process: vLLM's real engine, ``vllm.LLM(...)``, with vllm-ascend's platform plugin on the
emulated Ascend device (tests/lanes/test_engine_vllm.py runs it).

argv: a model folder (the tiny random-weight Qwen2 and tokenizer the test saved), a JSON file of
calls (each a list of prompts, token ids; one ``llm.generate`` per call, in order, on one engine), the
number of tokens to generate. In-process engine core
(``VLLM_ENABLE_V1_MULTIPROCESSING=0``, set by the test), eager, TP 1, every vLLM plugin loaded
(``VLLM_PLUGINS`` unset: vllm-ascend's ``ascend`` platform and its general plugins, and the shim's,
which ``NPU_SHIM=0`` turns off). Prints ``ENGINE_STAGE <name>`` as it passes each stage and, when it
generates, one line ``ENGINE_RESULT <json>``: per call, the greedy tokens and the prefix-cache hit
(``num_cached_tokens``) and the log-probability of each generated token per prompt; the platform vLLM resolved; the scheduler's and cache's settings;
the attention layers and MoE blocks the engine built (:func:`describe_layers`); the shim's applied patches;
the calls of each emulated op during start-up and generation (:func:`count_emulated_ops`).
"""
import json
import os
import sys

from npu_shim import emulation

emulation.install()


# 256: the tiny model's positions; 48 tokens a step: a longer prompt is prefilled in chunks, one of
# which spans a block boundary; blocks of 128 tokens (a prefix-cache hit is a whole block).
# ENGINE_CASE_MAX_MODEL_LEN (set by a test) raises the model length for a model with more positions.
MAX_MODEL_LEN, MAX_NUM_BATCHED_TOKENS, BLOCK_SIZE = int(os.environ.get("ENGINE_CASE_MAX_MODEL_LEN", 256)), 48, 128
# The model's dtype: float32 (default) inside the emulation's math-check switch, to compare with the
# float64 reference; ENGINE_CASE_DTYPE=bfloat16 (set by a test) serves in the dtype the hardware takes,
# the switch closed: every attention and KV-cache op then gets the dtypes its page documents.
DTYPE = os.environ.get("ENGINE_CASE_DTYPE", "float32")
# ENGINE_CASE_TRUST_REMOTE_CODE=1 (set by a test): the model folder's own configuration code is run, as
# for a checkpoint whose model type the lane's transformers does not know (its config.json's auto_map).
TRUST_REMOTE_CODE = os.environ.get("ENGINE_CASE_TRUST_REMOTE_CODE") == "1"


# ENGINE_CASE_BUILD_DEVICE_TYPE=_310P (set by a test, with NPU_SHIM_EMULATE_SOC naming a 310P SoC): the
# installed vllm-ascend stands for its 310P build. vllm-ascend is built per device family: its setup writes
# the family into ``vllm_ascend/_build_info.py`` (``__device_type__``), which the worker checks against the
# runtime SoC (``check_ascend_device_type``) and from which the hardware profile (attention backend family,
# custom-op table, model runner) is chosen; the Python sources are the same. The index's wheel is the A2
# build, so the child sets that one attribute before vllm-ascend reads it (:func:`_set_build_device_type`).
BUILD_DEVICE_TYPE = os.environ.get("ENGINE_CASE_BUILD_DEVICE_TYPE", "")


def _set_build_device_type(name):
    """vllm-ascend's own ``_build_info`` module, loaded from the installed package before the package
    itself (whose import already chooses the hardware profile), with ``__device_type__`` set to
    ``name``; checked after vllm-ascend's import."""
    import importlib.util

    if any(m == "vllm_ascend" or m.startswith("vllm_ascend.") for m in sys.modules if m != "vllm_ascend.vllm_ascend_C"):
        raise RuntimeError("vllm-ascend was imported before the case set its build's device type")
    folder = importlib.util.find_spec("vllm_ascend").submodule_search_locations[0]
    spec = importlib.util.spec_from_file_location("vllm_ascend._build_info", os.path.join(folder, "_build_info.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    module.__device_type__ = name
    sys.modules[spec.name] = module
    from vllm_ascend.device import device_config

    if device_config.get_ascend_device_type().name != name:
        raise RuntimeError("vllm-ascend's build device type is %s, not %s"
                           % (device_config.get_ascend_device_type(), name))


def stage(name):
    print("ENGINE_STAGE " + name, flush=True)


def main(model_dir, prompts_file, max_new_tokens, runner=None):
    """``runner``: the function run inside the stand-ins (``run`` here; the image case passes its own)."""
    # vllm-ascend's NPU-only imports that exist on no package index: fla_npu (NPU kernels;
    # vllm_ascend.ops.gdn) and CANN's pyACL (``acl``: vllm_ascend.device_allocator.camem imports
    # ``acl.rt.memcpy`` at module top, for sleep mode): import placeholders whose names refuse to
    # be used (npu_shim.testing.mimo.import_placeholders; scipy is installed in the lane).
    # torchvision: no CPU build for the lane's torch on the package index; vllm-ascend's worker
    # patches import vLLM's Qwen3.5 / Qwen3-VL modules, whose transformers image processor imports
    # it at module top (the text model never calls it): the towers' import-only placeholder.
    # vllm_ascend.vllm_ascend_C: vllm-ascend's compiled extension, whose import registers
    # torch.ops._C_ascend (not built without the CANN toolkit). AscendRMSNorm's residual branch imports
    # it before calling _C_ascend.npu_add_rms_norm_bias, and enable_custom_op() imports it: an empty
    # module under that name; the emulation registers the _C_ascend ops it has, any other fails naming
    # the op (as tests/lanes/test_vllm_ascend_layer_ops.py does). Its sleep-mode names stay missing
    # (vllm_ascend.device_allocator.camem catches the ImportError and disables sleep mode).
    import types

    if BUILD_DEVICE_TYPE:
        _set_build_device_type(BUILD_DEVICE_TYPE)
    sys.modules["vllm_ascend.vllm_ascend_C"] = types.ModuleType(
        "vllm_ascend.vllm_ascend_C", "npu-shim test stand-in: vllm-ascend's compiled extension (empty)")
    _declare_meta_registered_ops()
    from npu_shim.testing.mimo import import_placeholders
    from npu_shim.testing.towers import placeholder_torchvision

    import transformers

    transformers.AutoImageProcessor  # resolved before torchvision's placeholder exists (as the towers' tests do)
    # float32 weights and KV cache, to compare with the float64 reference: the device's KV-cache and
    # attention ops take float16/bfloat16 only, and the emulation admits float32 inside
    # float32_not_on_hardware() (its rule for math checks).
    from npu_shim.emulation.dtypes import float32_not_on_hardware

    # torchair: torch_npu's graph-mode compiler (shipped with torch_npu, not on a package index);
    # vllm-ascend 0.18's worker patches import patch_npugraph_ex_triton, which imports torchair's
    # npu_fx_compiler and core._concrete_graph at module top, sets a class on them and reloads
    # torchair.fx_summary (graph mode only; the eager engine never calls them): placeholders as well,
    # fx_summary imported first so that upstream's reload finds it.
    import importlib

    # torch.compile: vLLM 0.18's sampler counts logprob ranks in a function compiled with the platform's
    # simple_compile_backend, "eager" on vllm-ascend (the same ops, run as written). Dynamo cannot trace
    # the emulated device's tensor subclass (its allocation registers a weakref.finalize, and the frame's
    # guard on that registry fails: "Guard failed on the same frame it was created"): dynamo is off in
    # the child, so such a frame runs as written, the ops the eager backend would run, on the device.
    import torch._dynamo

    torch._dynamo.config.disable = True
    import contextlib

    math_check = float32_not_on_hardware() if DTYPE == "float32" else contextlib.nullcontext()
    with import_placeholders(("fla_npu", "acl", "torchair")), placeholder_torchvision(), math_check:
        importlib.import_module("torchair.fx_summary")
        (runner or run)(model_dir, prompts_file, max_new_tokens)


# vllm-ascend's compiled ops that its ``vllm_ascend.meta_registration`` (imported by
# ``enable_custom_op()`` after the extension, in vllm-ascend 0.18; absent in 0.30) gives Meta kernels:
# ``torch.library.Library("_C_ascend", "IMPL").impl`` needs the op defined, which the compiled extension
# does. Their schemas (vllm-ascend's csrc/torch_binding.cpp, the meta functions' signatures), each with a
# kernel that refuses, naming the op: vocab-parallel masking (vllm-ascend's embedding computes it in
# Python) and the LoRA kernels, none of which this engine calls. An op the emulation registers is left
# to it.
_META_REGISTERED_OPS = {
    "get_masked_input_and_mask": "get_masked_input_and_mask(Tensor input, int org_vocab_start_index, "
                                 "int org_vocab_end_index, int num_org_vocab_padding, int added_vocab_start_index, "
                                 "int added_vocab_end_index) -> (Tensor, Tensor)",
    "bgmv_expand": "bgmv_expand(Tensor x, Tensor weight, Tensor indices, Tensor y, int slice_offset, "
                   "int slice_size) -> Tensor",
    "sgmv_expand": "sgmv_expand(Tensor x, Tensor weight, Tensor lora_indices, Tensor seq_len, Tensor y, "
                   "int slice_offset, int slice_size) -> Tensor",
}
_declared = []


def _declare_meta_registered_ops():
    import torch

    lib = torch.library.Library("_C_ascend", "FRAGMENT")
    for name, schema in _META_REGISTERED_OPS.items():
        if hasattr(torch.ops._C_ascend, name):
            continue

        def refuse(*args, _name=name, **kwargs):
            raise NotImplementedError("torch.ops._C_ascend.%s: vllm-ascend's compiled op, not emulated "
                                      "(npu-shim's engine test declares its schema only)" % _name)

        lib.define(schema)
        lib.impl(name, refuse, "CompositeExplicitAutograd")
    _declared.append(lib)  # kept for the process: the ops stay defined


def run(model_dir, prompts_file, max_new_tokens):
    with open(prompts_file) as f:
        calls = json.load(f)
    stage("import")
    import vllm
    from vllm.platforms import current_platform

    stage("platform " + type(current_platform).__name__ + " device_type=" + str(current_platform.device_type))
    # vllm-ascend's Triton kernels for the KV slots of the scheduled tokens (triton-ascend on the NPU box,
    # no Triton here): the emulated launches (npu_shim.emulation.triton_kernels), in the names that
    # launch them: one KV-cache group's kernel in the block table's module, and the fused kernels for
    # several groups (full and sliding-window layers) in their own module's, where the release has it.
    # vllm-ascend 0.18's block table computes the slots in numpy, upstream's own code, and never reads
    # these names.
    import importlib.util

    compute_slot_mapping = None
    if importlib.util.find_spec("vllm_ascend.ops.triton.compute_slot_mapping") is not None:
        from vllm_ascend.ops.triton import compute_slot_mapping
    from vllm_ascend.worker import block_table

    from npu_shim.emulation import triton_kernels

    block_table._compute_slot_mapping_kernel = triton_kernels.compute_slot_mapping
    if compute_slot_mapping is not None:
        compute_slot_mapping._compute_slot_mapping_fused_groups_kernel = triton_kernels.compute_slot_mapping_fused_groups
        compute_slot_mapping._compute_slot_mapping_fused_groups_adaptive_kernel = (
            triton_kernels.compute_slot_mapping_fused_groups_adaptive)
    ops = count_emulated_ops()
    llm = vllm.LLM(model=model_dir, enforce_eager=True, tensor_parallel_size=1, dtype=DTYPE,
                   max_model_len=MAX_MODEL_LEN, gpu_memory_utilization=0.5, seed=0, max_num_seqs=4,
                   block_size=BLOCK_SIZE, max_num_batched_tokens=MAX_NUM_BATCHED_TOKENS,
                   enable_chunked_prefill=True, enable_prefix_caching=True, trust_remote_code=TRUST_REMOTE_CODE)
    stage("engine")
    layers = llm.apply_model(describe_layers)[0]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=max_new_tokens, ignore_eos=True, logprobs=1)
    tokens, cached, logprobs = [], [], []
    for prompts in calls:  # one llm.generate per call, in order, on the same engine (its prefix cache)
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts], params, use_tqdm=False)
        tokens.append([list(o.outputs[0].token_ids) for o in outs])
        cached.append([o.num_cached_tokens for o in outs])
        logprobs.append([[step[t].logprob for step, t in zip(o.outputs[0].logprobs, o.outputs[0].token_ids)]
                         for o in outs])
    stage("generate")
    from npu_shim.emulation.dtypes import float32_allowed

    scheduler = llm.llm_engine.vllm_config.scheduler_config
    cache = llm.llm_engine.vllm_config.cache_config
    result = {"tokens": tokens, "cached": cached, "logprobs": logprobs, "platform": type(current_platform).__name__,
              "device_type": current_platform.device_type,
              "chunked_prefill": scheduler.enable_chunked_prefill,
              "max_num_batched_tokens": scheduler.max_num_batched_tokens,
              "prefix_caching": cache.enable_prefix_caching, "block_size": cache.block_size,
              "dtype": str(llm.llm_engine.vllm_config.model_config.dtype), "float32_allowed": float32_allowed(),
              "layers": layers, "shim": shim_patches(), "ops": dict(sorted(ops.items()))}
    print("ENGINE_RESULT " + json.dumps(result), flush=True)

def count_emulated_ops():
    """A dict counting the calls of each emulated torch_npu / ``_C_ascend`` op from here on (the
    emulation's hook around every op body, chained to the one installed before)."""
    import collections
    import contextlib

    from npu_shim.emulation import _registry

    counts = collections.Counter()
    previous = None

    def hook(name, args, kwargs):
        counts[name] += 1
        return previous(name, args, kwargs) if previous is not None else contextlib.nullcontext()

    previous = _registry.set_body_hook(hook)
    return counts


def describe_layers(model):
    """What the engine built, per attention layer (vLLM's ``Attention``: its backend's impl class, head
    sizes, sliding window, sinks) and per MoE block (the experts' class, their count and top-k)."""
    from vllm.model_executor.layers.attention import Attention

    out = {}
    for name, module in model.named_modules():
        if isinstance(module, Attention):
            impl = module.impl
            out[name] = {"impl": type(impl).__name__, "head_size": module.head_size,
                         "head_size_v": getattr(module, "head_size_v", module.head_size),
                         "sliding_window": getattr(impl, "sliding_window", None),
                         "sinks": getattr(impl, "sinks", None) is not None}
        elif name.endswith(".experts"):
            out[name] = {"experts": type(module).__name__}
    return out


def shim_patches():
    """The shim's applied patches in this process and their counters (empty with ``NPU_SHIM=0``)."""
    import npu_shim

    return {name: {key: row.get(key) for key in ("family", "calls", "upstream_calls")}
            for name, row in npu_shim.stats().items() if row.get("state") == "applied"}


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    os._exit(0)
