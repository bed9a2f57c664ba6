"""vLLM's own vision towers on CPU, built from tiny random configs, for the tests,
the selftests and ``benchmarks/bench_towers.py``.

What runs is upstream code at the installed versions: vLLM's tower class
(``Qwen2_5_VisionTransformer``, ``Qwen3_VisionTransformer``), built the way vLLM
builds it (``set_current_vllm_config`` with a CPU ``DeviceConfig``, a 1-rank
gloo model-parallel group), its ``MMEncoderAttention`` layers handed back as
vllm-ascend's class (A2: ``AscendMMEncoderAttention``, 310P:
``AscendMMEncoderAttention310``) through vLLM's ``CustomOp.register_oot`` -- a
named stand-in for vllm-ascend's ``register_ascend_customop``, which imports
every compiled Ascend op. Stand-ins, each because this machine has no NPU:

* torch_npu: npu-shim's emulation of the documented ops;
* vllm-ascend modules load without ``vllm_ascend/ops/__init__.py``
  (:mod:`npu_shim.testing.isolation`);
* the CustomOp forward each layer runs is set the way vllm-ascend's platform
  sets it for the attention (``forward_oot``); every other CustomOp (rotary,
  norms, activations) runs ``forward_native`` -- vllm-ascend's NPU kernels for
  those are not emulated, and both sides of every comparison run the same
  ones (vLLM on an unknown platform would pick ``forward_cuda``);
* ``PIN_MEMORY`` / ``is_pin_memory_available`` in the towers' modules say no (no pinned-memory allocator without an accelerator;
  vLLM's CPU-less "unspecified" platform says it has one);
* the towers' modules import ``transformers``' Qwen2-VL image processor, which
  (transformers 5) imports torchvision at module top; there is no CPU build
  of torchvision on the package index, so an import-only placeholder stands
  in while those modules import (the towers never call it) and is removed
  after.

``upstream_attention_class`` executes the same vllm-ascend file a second time
under a module name the shim does not watch: untouched upstream code.
"""
import contextlib
import importlib
import importlib.machinery
import importlib.util
import inspect
import os
import sys
import tempfile
import types

__all__ = ["DEVICE_CLASSES", "MOONVIT", "MOONVIT_GRIDS", "TOWERS", "Stack", "assert_near_references", "build_moonvit", "build_tower",
           "build_tower_of", "f64_attention_layers",
           "grids", "has_device_class", "hardware_dtype", "moonvit_pixel_values", "moonvit_reference_forward", "pixel_values", "reference_forward",
           "registered", "setup", "upstream_code", "upstream_methods"]

DEVICE_CLASSES = {
    "A2": ("vllm_ascend.ops.mm_encoder_attention", "AscendMMEncoderAttention"),
    "310P": ("vllm_ascend._310p.ops.mm_encoder_attention", "AscendMMEncoderAttention310"),
}
SOC_310P = "Ascend310P3"

# Two forwards with different grids, each with a multi-frame item (t > 1).
GRIDS = ([[1, 8, 8], [2, 4, 12]], [[1, 4, 4], [3, 8, 4], [1, 12, 8]])


def _qwen2_5_config():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    # head dim 80 (Qwen2.5-VL's): padded to 128 by vllm-ascend's rule; window of 4x4 merged patches.
    return Qwen2_5_VLVisionConfig(depth=4, hidden_size=160, num_heads=2, intermediate_size=256,
                                  out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                                  temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3])


def _qwen3_config():
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    return Qwen3VLVisionConfig(depth=3, hidden_size=160, num_heads=2, intermediate_size=256,
                               out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                               temporal_patch_size=2, num_position_embeddings=64,
                               deepstack_visual_indexes=[1])


def _glm4v_config():
    from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig

    # head dim 80: padded to 128 by vllm-ascend's rule; an 8x8 learnable position grid
    # (image_size / patch_size), interpolated to each image's grid.
    return Glm4vVisionConfig(depth=3, hidden_size=160, num_heads=2, intermediate_size=128,
                             out_hidden_size=64, patch_size=14, image_size=112, spatial_merge_size=2,
                             temporal_patch_size=2, rms_norm_eps=1e-5)


def _glm4v_text_config():
    from transformers.models.glm4v.configuration_glm4v import Glm4vTextConfig

    return Glm4vTextConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=1)


def _moonvit_config():
    from vllm.transformers_utils.configs.moonvit import MoonViTConfig

    # head dim 72: padded to 128 by vllm-ascend's rule; a 6x6 learnable position grid, interpolated.
    return MoonViTConfig(patch_size=14, init_pos_emb_height=6, init_pos_emb_width=6, num_attention_heads=2,
                         num_hidden_layers=3, hidden_size=144, intermediate_size=256, merge_kernel_size=(2, 2))


# Kimi-VL's MoonViT: its own call convention (pixel_values (L, 3, p, p), grid_hw (N, 2) tensor -> a list
# of per-image (h*w/4, 4, hidden) tensors), so not in TOWERS. (vLLM module, tower class, config builder,
# the vLLM module that sends it its inputs).
MOONVIT = ("vllm.model_executor.models.moonvit", "MoonVitPretrainedModel", _moonvit_config,
           "vllm.model_executor.models.kimi_vl")
# Two forwards with different image grids (h, w in patches, multiples of the 2x2 merge kernel).
MOONVIT_GRIDS = ([[8, 12], [4, 4], [6, 10]], [[10, 6], [12, 8]])

TOWERS = {
    # name: (vLLM module, tower class, config builder)
    "Qwen2.5-VL": ("vllm.model_executor.models.qwen2_5_vl", "Qwen2_5_VisionTransformer", _qwen2_5_config),
    "Qwen3-VL": ("vllm.model_executor.models.qwen3_vl", "Qwen3_VisionTransformer", _qwen3_config),
    "GLM-4.1V": ("vllm.model_executor.models.glm4_1v", "Glm4vVisionTransformer", _glm4v_config),
}


@contextlib.contextmanager
def targets_importable():
    """Every installed target importable off the NPU, as the lane gate imports them: where
    vllm-ascend is installed, its ops package registered without its ``__init__``
    (:func:`npu_shim.testing.isolation.import_vllm_ascend_ops_module`), and, on the emulation,
    ``torch.npu`` registered inside the block as a real torch_npu registers it (vllm-ascend's
    attention backend names it at import: ``vllm.sinks_refuse``'s target); where vLLM is,
    torchvision's import-only placeholder (:func:`placeholder_torchvision`) held inside the block."""
    with contextlib.ExitStack() as stack:
        if importlib.util.find_spec("vllm_ascend") is not None:
            from npu_shim.testing.isolation import import_vllm_ascend_ops_module

            import_vllm_ascend_ops_module()
            stack.enter_context(_device_module_registered())
        if importlib.util.find_spec("vllm") is not None:
            stack.enter_context(placeholder_torchvision())
        yield


@contextlib.contextmanager
def _device_module_registered():
    """``torch.npu`` as the emulation's while the block runs, where torch_npu is the emulation
    and ``torch.npu`` is not there yet; removed again after it (sglang and transformers probe
    ``torch.npu``, and the other tests of a lane process must not find it)."""
    import torch

    from npu_shim import emulation

    if hasattr(torch, "npu") or not emulation.is_emulated():
        yield
        return
    emulation.register_device_module()
    try:
        yield
    finally:
        if hasattr(torch, "npu"):
            del torch.npu


@contextlib.contextmanager
def placeholder_torchvision():
    """Import-only placeholders for ``torchvision`` (and the transforms modules vLLM's GLM-4.1V
    and Qwen processors import at module top) while the block runs, where torchvision is not
    installed (it has no CPU build on the lanes' index; the towers never call it), and for the
    ``AutoImageProcessor`` registry transformers gates on torchvision
    (:class:`_ImageProcessorRegistryPlaceholder`). Any use of one raises RuntimeError naming it."""
    if importlib.util.find_spec("torchvision") is not None:
        yield
        return
    names = ("torchvision", "torchvision.transforms", "torchvision.transforms.v2",
             "torchvision.transforms.v2.functional")

    def missing(module_name, attr):
        if attr.startswith("__"):
            raise AttributeError(attr)

        def unusable(*args, **kwargs):
            raise RuntimeError("%s.%s: an import-only placeholder (npu_shim.testing.towers)"
                               % (module_name, attr))
        return unusable

    for name in names:
        module = types.ModuleType(name)
        module.__spec__ = importlib.machinery.ModuleSpec(name, None)
        module.__path__ = []
        module.__getattr__ = lambda attr, name=name: missing(name, attr)
        sys.modules[name] = module
        parent, _, child = name.rpartition(".")
        if parent:
            setattr(sys.modules[parent], child, module)
    registry = _placeholder_image_processor_registry()
    try:
        yield
    finally:
        for name in names:
            sys.modules.pop(name, None)
        if registry is not None:
            import transformers

            transformers.AutoImageProcessor = registry


class _ImageProcessorRegistryPlaceholder:
    """Import-only stand-in for transformers' ``AutoImageProcessor`` where transformers (5.x
    before 5.14) makes it a torchvision-gated dummy: vLLM 0.19 - 0.25's HunYuan-Vision processor
    module registers its image processor with it at import. Registering does nothing; any other
    use raises."""

    @staticmethod
    def register(*args, **kwargs):
        pass

    def __getattr__(self, attr):
        raise RuntimeError("AutoImageProcessor.%s: an import-only placeholder (npu_shim.testing.towers)" % attr)


def _placeholder_image_processor_registry():
    """Put the placeholder registry in place of a torchvision-gated ``AutoImageProcessor``;
    the dummy it replaced (to restore), or None where transformers' own class is there."""
    import transformers

    auto = transformers.AutoImageProcessor
    if type(auto).__name__ != "DummyObject" or "torchvision" not in getattr(auto, "_backends", ()):
        return None
    transformers.AutoImageProcessor = _ImageProcessorRegistryPlaceholder()
    return auto


def _no_pinned_memory():
    return False


def open_one_rank_group(prefix):
    """vLLM's model-parallel groups for a single rank on gloo (a file rendezvous named with
    ``prefix``), unless this process has them; inside ``set_current_vllm_config``."""
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        return
    init_file = tempfile.NamedTemporaryFile(prefix=prefix, delete=False)
    init_file.close()
    os.unlink(init_file.name)
    parallel_state.init_distributed_environment(
        world_size=1, rank=0, local_rank=0, distributed_init_method="file://" + init_file.name,
        backend="gloo")
    parallel_state.ensure_model_parallel_initialized(1, 1)


class Stack(types.SimpleNamespace):
    """What :func:`setup` prepared: ``config`` (the VllmConfig), ``modules`` (tower
    name -> vLLM module), ``attention`` / ``upstream`` (device class -> patched /
    untouched vllm-ascend class)."""


_STACK = None


def setup(emulate=True):
    """Install the emulation (``emulate``; off on an NPU box) and the shim, import the
    towers and vllm-ascend's classes, open the 1-rank model-parallel group (once per
    process)."""
    global _STACK
    if _STACK is not None:
        return _STACK
    os.environ.setdefault("VLLM_PLUGINS", "")     # the lanes use "npu_shim"; never "ascend"
    import npu_shim
    from npu_shim import emulation
    from npu_shim.testing.isolation import import_vllm_ascend_module

    if emulate:
        emulation.install()
    npu_shim.install()
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        open_one_rank_group("npu_shim_towers_")
        with placeholder_torchvision():
            modules = {name: importlib.import_module(spec[0]) for name, spec in TOWERS.items()}
            modules["Kimi-VL"] = importlib.import_module(MOONVIT[0])
            modules["Kimi-VL model"] = importlib.import_module(MOONVIT[3])
    import vllm.utils.torch_utils as torch_utils

    for module in (torch_utils, *modules.values()):
        if getattr(module, "PIN_MEMORY", False):
            module.PIN_MEMORY = False
        if callable(getattr(module, "is_pin_memory_available", None)):
            module.is_pin_memory_available = _no_pinned_memory
    attention, upstream = {}, {}
    for device_class, (target, class_name) in DEVICE_CLASSES.items():
        if not has_device_class(device_class):
            continue        # no 310P class: vllm-ascend 0.13.0, 0.15.0rc1 - 0.17.0rc1
        module = import_vllm_ascend_module(target)
        attention[device_class] = getattr(module, class_name)
        spec = importlib.util.spec_from_file_location("npu_shim_towers_upstream_" + device_class.lower(),
                                                      module.__file__)
        copy = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(copy)
        upstream[device_class] = getattr(copy, class_name)
    _STACK = Stack(config=config, modules=modules, attention=attention, upstream=upstream)
    return _STACK


def has_device_class(device_class):
    """Whether the installed vllm-ascend has the attention module of ``device_class``
    (:data:`DEVICE_CLASSES`), read from its files: vllm-ascend 0.13.0 has no 310P package, and
    0.15.0rc1 - 0.17.0rc1 have one without an ``MMEncoderAttention`` class."""
    import os

    root = importlib.util.find_spec("vllm_ascend")
    if root is None or root.origin is None:
        return False
    path = os.path.join(os.path.dirname(root.origin), *DEVICE_CLASSES[device_class][0].split(".")[1:])
    return os.path.isfile(path + ".py")


@contextlib.contextmanager
def registered(cls):
    """``cls`` registered as vLLM's out-of-tree ``MMEncoderAttention`` for the block (None:
    none), as vllm-ascend's platform keeps it for the process: vLLM looks it up while
    building a tower and, for its classmethods (``maybe_compute_seq_lens``,
    ``maybe_recompute_cu_seqlens``), in every forward."""
    from vllm.model_executor import custom_op
    from vllm.model_executor.custom_op import CustomOp

    registry = vars(custom_op).get("op_registry_oot", None)
    if registry is None:
        registry = CustomOp.op_registry_oot
    saved = registry.pop("MMEncoderAttention", None)
    if cls is not None:
        CustomOp.register_oot(_decorated_op_cls=cls, name="MMEncoderAttention")
    try:
        yield
    finally:
        registry.pop("MMEncoderAttention", None)
        if saved is not None:
            registry["MMEncoderAttention"] = saved


def upstream_code(stack, name):
    """vLLM's own code for tower ``name`` in the block (:func:`upstream_methods` of its module)."""
    return upstream_methods(stack.modules[name])


@contextlib.contextmanager
def upstream_methods(module):
    """vLLM's own code of ``module`` in the block: every method that a patch replaced (the
    replacement names it in ``__wrapped_upstream__``) of the classes the module defines and of
    their bases (GLM-OCR's tower runs GLM-4.1V's ``rot_pos_emb``), and every module-level
    function of ``module`` a patch replaced (PaddleOCR-VL's ``async_tensor_h2d``), is put back,
    and the replacement restored after."""
    owners = [module]
    for cls in vars(module).values():
        if isinstance(cls, type) and cls.__module__ == module.__name__:
            owners.extend(base for base in cls.__mro__ if base not in owners and base is not object)
    saved = []
    for owner in owners:
        for attr, value in list(vars(owner).items()):
            function = value.__func__ if isinstance(value, (classmethod, staticmethod)) else value
            original = getattr(function, "__wrapped_upstream__", None)
            if original is not None:
                saved.append((owner, attr, value))
                setattr(owner, attr, type(value)(original) if function is not value else original)
    try:
        yield
    finally:
        for owner, attr, value in reversed(saved):
            setattr(owner, attr, value)


def _init_weights(model, seed):
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                param.copy_(1 + 0.1 * noise)
            elif param.dim() >= 2:
                fan_in = param[0].numel()
                param.copy_(noise * (2.0 / fan_in) ** 0.5)
            else:
                param.copy_(0.02 * noise)


def _route_custom_ops(tower, attention_class):
    """The attention runs ``forward_oot`` (the registered class), every other custom op
    ``forward_native``; without a class, vLLM's own ``MMEncoderAttention`` is what was built."""
    from vllm.model_executor.custom_op import CustomOp
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    for layer in tower.modules():
        if isinstance(layer, CustomOp):
            oot = attention_class is not None and isinstance(layer, attention_class)
            layer._forward_method = layer.forward_oot if oot else layer.forward_native
        if isinstance(layer, MMEncoderAttention):
            assert (attention_class is None) == (type(layer) is MMEncoderAttention), type(layer)
    return tower


def hardware_dtype(device_class=None):
    """The dtype the towers run in on ``device_class`` (None: the emulated SoC's): bfloat16 on
    A2, float16 on 310P (the emulated ops take no float32, npu_shim.emulation.dtypes)."""
    import torch

    if device_class is None:
        from npu_shim.emulation import soc

        device_class = "310P" if soc.is_310p() else "A2"
    return torch.float16 if device_class == "310P" else torch.bfloat16


def _dtype_of(model):
    return next(model.parameters()).dtype


def assert_near_references(comparison, out, ref, sdpa, tolerance):
    """``out`` within ``tolerance[out.dtype]`` x max |ref| of the float64 tower ``ref`` and of
    vLLM's TORCH_SDPA tower ``sdpa`` (same dtype); no floor under max |ref|, so the bound is
    a relative one whatever the output's size. Each error is recorded
    (:mod:`npu_shim.testing.errors`) under ``comparison``."""
    from npu_shim.testing.errors import within

    dtype = out.dtype
    tol = tolerance[str(dtype).replace("torch.", "")] if isinstance(tolerance, dict) else tolerance
    scale = ref.abs().max().item()
    err = (out.double() - ref).abs().max().item() / scale
    assert within("%s vs float64" % comparison, err, tol, dtype), (comparison, dtype, err, tol)
    err = (out.double() - sdpa.double()).abs().max().item() / scale
    assert within("%s vs TORCH_SDPA" % comparison, err, tol, dtype), (comparison, dtype, err, tol)


def emulate_device_class(device_class):
    """Make the emulation report the SoC of ``device_class`` ("A2" or "310P") from now on."""
    import os

    if device_class == "310P":
        os.environ["NPU_SHIM_EMULATE_SOC"] = SOC_310P
    else:
        os.environ.pop("NPU_SHIM_EMULATE_SOC", None)


def state_with_disabled(patch_name):
    """The state ``npu-shim status`` gives ``patch_name`` in a fresh interpreter that sets up
    the towers' stack with ``NPU_SHIM_DISABLE=<patch_name>``."""
    import os
    import subprocess
    import sys

    code = ("import npu_shim; from npu_shim.testing import towers; towers.setup(); "
            "print([r['state'] for r in npu_shim.status() if r['name'] == %r][0])" % patch_name)
    env = dict(os.environ, NPU_SHIM_DISABLE=patch_name)
    proc = subprocess.run([sys.executable, "-P", "-c", code], env=env, capture_output=True, text=True,
                          timeout=300)
    if proc.returncode != 0:
        raise AssertionError(proc.stderr[-3000:])
    return proc.stdout.strip().splitlines()[-1]


def build_tower(stack, name, attention_class=None, *, seed=0, dtype=None):
    """vLLM's tower ``name`` with deterministic weights for ``seed`` in ``dtype`` (None:
    :func:`hardware_dtype` of the emulated SoC); its attention layers are
    ``attention_class`` (None: vLLM's own ``MMEncoderAttention``, whose native path is
    TORCH_SDPA here)."""
    module_name, class_name, make_config = TOWERS[name]
    return build_tower_of(stack, getattr(stack.modules[name], class_name), make_config, attention_class,
                          seed=seed, dtype=dtype)


def build_tower_of(stack, cls, make_config, attention_class=None, *, seed=0, dtype=None):
    """:func:`build_tower` for a tower class ``cls`` and its config builder ``make_config`` not in
    :data:`TOWERS` (the tests of one tower)."""
    import torch
    from vllm.config import set_current_vllm_config

    with registered(attention_class), set_current_vllm_config(stack.config):
        if "text_config" in inspect.signature(cls).parameters:
            # GLM-4.1V from vLLM 0.23: a required first argument the vision tower does not read
            tower = cls(_glm4v_text_config(), make_config(), norm_eps=1e-6, prefix="visual")
        else:
            tower = cls(make_config(), norm_eps=1e-6, prefix="visual")
    _init_weights(tower, seed)
    tower.to(dtype or hardware_dtype()).eval()
    return _route_custom_ops(tower, attention_class)


def grids(forward):
    return [list(g) for g in GRIDS[forward]]


def pixel_values(tower, grid, seed=0):
    import torch

    patch = tower.patch_embed
    width = patch.proj.weight[0].numel()
    tokens = sum(t * h * w for t, h, w in grid)
    return torch.randn(tokens, width, generator=torch.Generator().manual_seed(seed)).to(_dtype_of(tower))


def f64_attention_layers(model):
    """Every ``MMEncoderAttention`` of ``model`` runs :func:`npu_shim.testing.attention_f64`."""
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    from npu_shim.testing import attention_f64

    def attend(layer, query, key, value, cu_seqlens=None, *args, **kwargs):
        heads, dim = layer.num_heads, layer.head_size
        kv_heads = getattr(layer, "num_kv_heads", None) or heads      # grouped K/V: head h reads h // group
        flat = [query.reshape(-1, heads, dim)] + [t.reshape(-1, kv_heads, dim) for t in (key, value)]
        if cu_seqlens is None:      # MMEncoderAttention's batch layout: each of the B rows is one sequence
            bounds = [i * query.shape[1] for i in range(query.shape[0] + 1)]
        else:
            bounds = cu_seqlens.tolist()
        out = attention_f64(*flat, bounds, scale=layer.scale)
        return out.to(query.dtype).reshape(query.shape[:2] + ((heads, dim) if query.dim() == 4 else (-1,)))

    for layer in model.modules():
        if isinstance(layer, MMEncoderAttention):
            layer._forward_method = types.MethodType(attend, layer)


def reference_forward(stack, name, x, grid, *, seed=0):
    """Tower ``name`` with the weights of ``seed`` in float64, every attention layer
    replaced by :func:`npu_shim.testing.attention_f64` (the definition of attention).
    The weights are those of the tower under test, rounded to ``x.dtype`` first, so the
    comparison measures the forward's arithmetic, not the rounding of the weights."""
    import torch

    ref = build_tower(stack, name, None, seed=seed, dtype=x.dtype).double()
    f64_attention_layers(ref)
    with torch.inference_mode(), registered(None), upstream_code(stack, name):
        return ref(x.double(), grid_thw=grid)


def build_moonvit(stack, attention_class=None, *, seed=0, dtype=None):
    """vLLM's MoonViT (Kimi-VL's tower, ``MoonVitPretrainedModel``) as :func:`build_tower` builds
    the others: deterministic weights, ``attention_class`` for its ``MMEncoderAttention`` layers."""
    import torch
    from vllm.config import set_current_vllm_config

    module_name, class_name, make_config, _ = MOONVIT
    with registered(attention_class), set_current_vllm_config(stack.config):
        tower = getattr(stack.modules["Kimi-VL"], class_name)(make_config(), prefix="vision_tower")
    _init_weights(tower, seed)
    tower.to(dtype or hardware_dtype()).eval()
    # Rope2DPosEmb's device defaults to current_platform.device_type at import: "" on vLLM's
    # unspecified platform, "npu" under vllm-ascend; the placement stand-in here.
    from npu_shim.testing.syncs import DEVICE

    tower.encoder.rope_2d.device = DEVICE
    return _route_custom_ops(tower, attention_class)


def moonvit_grid(forward):
    return [list(g) for g in MOONVIT_GRIDS[forward]]


def moonvit_pixel_values(tower, grid, seed=0):
    """``pixel_values`` for ``grid`` (a list of ``[h, w]``): ``(sum h*w, 3, p, p)``."""
    import torch

    patch = tower.patch_embed.patch_size
    tokens = sum(h * w for h, w in grid)
    return torch.randn(tokens, 3, patch[0], patch[1],
                       generator=torch.Generator().manual_seed(seed)).to(_dtype_of(tower))


def moonvit_reference_forward(stack, x, grid, *, seed=0):
    """MoonViT with the weights of ``seed`` in float64, attention by
    :func:`npu_shim.testing.attention_f64`; the per-image outputs concatenated."""
    import torch

    ref = build_moonvit(stack, None, seed=seed, dtype=x.dtype).double()
    f64_attention_layers(ref)
    with torch.inference_mode(), registered(None):
        return torch.cat(ref(x.double(), torch.tensor(grid)))


def kimi_vl_batch(stack, x, grid, *, device=None, upstream_fields=False):
    """``pixel_values`` and ``image_grid_hws`` as vLLM hands them to Kimi-VL's model: the
    processor's field config (the installed one; upstream's own with ``upstream_fields``)
    builds one item per image, ``group_and_batch_mm_kwargs`` batches them and places them on
    ``device`` (fields declared ``keep_on_cpu`` stay on the host)."""
    import torch
    from vllm.multimodal.inputs import MultiModalKwargsItem
    from vllm.multimodal.utils import group_and_batch_mm_kwargs

    fields_of = stack.modules["Kimi-VL model"].KimiVLMultiModalProcessor._get_mm_fields_config
    if upstream_fields:
        fields_of = getattr(fields_of, "__wrapped_upstream__", fields_of)
    hf_inputs = {"pixel_values": x, "image_grid_hws": torch.tensor(grid)}
    fields = fields_of(None, hf_inputs, {})          # reads hf_inputs only
    elems = {key: fields[key].build_elems(key, value) for key, value in hf_inputs.items()}
    items = [MultiModalKwargsItem({key: elems[key][i] for key in elems}) for i in range(len(grid))]
    (_, _, kwargs), = group_and_batch_mm_kwargs([("image", item) for item in items], device=device)
    return kwargs["pixel_values"], kwargs["image_grid_hws"]
