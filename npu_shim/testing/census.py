"""More of vLLM's vision towers on CPU, for a census: which towers beyond
Qwen2.5-VL, Qwen3-VL, Kimi-VL and GLM-4.1V make no device->host read per forward once
``vllm.mm_encoder_host_lengths`` and ``vllm.mm_encoder_attn`` apply.

Built as :mod:`npu_shim.testing.towers` builds its towers (same stack from
:func:`towers.setup`, same out-of-tree registration, same custom-op routing,
same weights rule, same stand-ins; read its docstring): vLLM's own tower
class at the installed version, from a tiny random config. Each tower is
called the way its vLLM model calls it, with its grid where vLLM's
multimodal field config puts it:

* Qwen2-VL (``Qwen2VisionTransformer``; also dots.ocr's processor fields):
  ``image_grid_thw`` is ``keep_on_cpu``, the tower gets a host tensor;
* Qwen3-Omni's vision tower (``Qwen3Omni_VisionTransformer``): the fields
  of Qwen2.5-Omni's processor, ``keep_on_cpu``, a host tensor;
* dots.ocr (``DotsVisionTransformer``): the model hands it
  ``grid_thw.tolist()`` of a host tensor, a list;
* Ernie4.5-VL (``Ernie4_5_VisionTransformer``): the model expands
  ``image_grid_thw`` to one row per frame (``_vision_forward``) where it is
  and hands the tower that: on the device where the field config sends it
  there, on the host where it is ``keep_on_cpu`` (0.30.0, 0.33.0; read at run
  time). Here that is the expanded grid, marked as a device tensor or not;
* LLaVA-OneVision-2 (``LlavaOnevision2VisionTower``): ``image_grid_thw`` and
  ``patch_positions`` go to the device (its field config), both marked so;
* GLM-OCR (``GlmOcrVisionTransformer``, a subclass of GLM-4.1V's tower with its own
  ``forward``): the Qwen2-VL field factory keeps ``image_grid_thw`` on the host, and the
  model hands the tower that host tensor (``self.visual(pixel_values, grid_thw=grid_thw)``);
* Keye-VL (``KeyeSiglipVisionModel`` and its ``Projector``): the model's own
  ``_process_image_input`` with every image's pixels in one tensor and the grid, both on
  the device (``flat_from_sizes`` and ``batched``); images only;
* PaddleOCR-VL (``SiglipVisionModel`` of ``paddleocr_vl``): where ``encode_image`` takes one
  image's grid row as a tensor (0.26.0, 0.30.0), it runs once per image on that image's pixels
  and grid row, both on the device (0.26.0's field config is ``batched`` without
  ``keep_on_cpu``); where it takes every image's grid as host tuples (0.33.0), the model's own
  ``_process_image_input`` runs on all images at once (pixels ``flat_from_sizes`` on the
  device, the grid where the field config puts it, read from the config at run time). Images
  only. The projector (``mlp_AR``) the model applies afterwards is not run;
* HunYuan-Vision (``HunYuanVisionTransformer``): ``image_grid_thw`` is ``keep_on_cpu``
  and the model hands the tower ``grid_thw.tolist()``, a list. Images only (the tower
  splits its sequence by ``h * w`` per item), so its grids are single-frame.
* RADIO (``RadioModel``, Nemotron Nano VL's vision model): the dynamic-resolution path of
  ``extract_feature_dynamic``, images only. ``imgs_sizes`` (each image's pixel height and
  width) is a host list (the processor's own list of ints, no tensor; 0.30 also marks it
  ``keep_on_cpu``); the pixels are one device tensor ``(1, patches, 3 * p * p)``, the
  layout ``DynamicResolutionImageTiler.stack`` makes of the per-image pixels. The model
  keeps the features and drops the summary (``_, vit_embeds = ...``); so does the census.
  ``RadioConfig`` takes its sizes from a timm model name only; the tiny sizes are set on
  the config after it is built. The layer scales ``ls1``/``ls2`` are left at the config's
  ``initializer_factor`` (vLLM's ``load_weights`` skips them) instead of random weights.

Towers that are not here, and why, are listed by ``NOT_MEASURED`` (the census document
prints it).
"""
import importlib
import importlib.util
import inspect
import types

from npu_shim.testing import towers

__all__ = ["CENSUS", "attention_layers", "build", "call", "device_args", "grids", "pixel_values", "reference_forward", "setup"]

# Two forwards with different grids, each with a multi-frame item (t > 1); h, w multiples of 2
# (the 2x2 merge) and at most 12 (Qwen3-Omni's learned 8x8 position grid is interpolated).
GRIDS = ([[1, 8, 8], [2, 4, 12]], [[1, 4, 4], [3, 8, 4], [1, 12, 8]])
# The same sizes, one frame each, for towers that take images only.
IMAGE_GRIDS = ([[1, 8, 8], [1, 4, 12]], [[1, 4, 4], [1, 8, 4], [1, 12, 8]])


def _qwen2_vl_config():
    from transformers.models.qwen2_vl.configuration_qwen2_vl import Qwen2VLVisionConfig

    # head dim 80 (Qwen2-VL's): padded to 128 by vllm-ascend's rule.
    return Qwen2VLVisionConfig(depth=3, embed_dim=160, hidden_size=64, num_heads=2, mlp_ratio=2,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, in_channels=3)


def _qwen3_omni_config():
    from transformers.models.qwen3_omni_moe.configuration_qwen3_omni_moe import (
        Qwen3OmniMoeVisionEncoderConfig,
    )

    config = Qwen3OmniMoeVisionEncoderConfig(depth=3, hidden_size=160, num_heads=2, intermediate_size=256,
                                             out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                                             temporal_patch_size=2, num_position_embeddings=64,
                                             deepstack_visual_indexes=[1])
    # Read by vLLM's tower, set by the checkpoint's config (Qwen3-Omni: 768 / 16, learned positions).
    config.image_size = 128
    config.apply_vit_abs_pos_embed = True
    return config


def _dots_ocr_config():
    from vllm.transformers_utils.configs.dotsocr import DotsVisionConfig

    # dots.ocr: temporal patch 1, RMSNorm, SwiGLU; head dim 80.
    return DotsVisionConfig(embed_dim=160, hidden_size=64, intermediate_size=256, num_hidden_layers=3,
                            num_attention_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=1)


def _ernie45_vl_config():
    # Ernie4.5-VL's vision config is read by attribute only (vLLM takes hf_config.vision_config).
    return types.SimpleNamespace(patch_size=14, spatial_merge_size=2, in_channels=3, hidden_size=160,
                                 embed_dim=160, depth=3, num_heads=2, mlp_ratio=2)


def _llava_ov2_config():
    # LLaVA-OneVision-2's vision config is read by attribute; windows of 2 frames, so the
    # 3-frame item is split in two attention windows. Head dim 96 (half of it a multiple of 16).
    return types.SimpleNamespace(patch_size=14, spatial_merge_size=2, num_channels=3, hidden_size=192,
                                 num_hidden_layers=3, num_attention_heads=2, intermediate_size=256,
                                 frame_windows_size=2)


def _glm_ocr_config():
    from transformers.models.glm_ocr.configuration_glm_ocr import GlmOcrTextConfig, GlmOcrVisionConfig

    # (text config, vision config): the tower's first argument is the text config (its merger's
    # width). Head dim 80, padded to 128 by vllm-ascend's rule.
    text = GlmOcrTextConfig(vocab_size=64, hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                            num_attention_heads=2, num_key_value_heads=1)
    vision = GlmOcrVisionConfig(depth=3, hidden_size=160, num_heads=2, intermediate_size=128,
                                out_hidden_size=64, patch_size=14, image_size=112, spatial_merge_size=2,
                                temporal_patch_size=2, rms_norm_eps=1e-5)
    return text, vision


def _hunyuan_vision_config():
    from vllm.transformers_utils.configs.hunyuan_vl import HunYuanVLVisionConfig

    # Head dim 80; an 8x8 learned position grid (max_image_size / patch_size), interpolated.
    return HunYuanVLVisionConfig(hidden_size=160, intermediate_size=256, num_attention_heads=2,
                                 num_hidden_layers=3, out_hidden_size=64, patch_size=16, max_image_size=128,
                                 spatial_merge_size=2, temporal_patch_size=1)


def _paddleocr_vl_config():
    from transformers import PretrainedConfig

    # PaddleOCR-VL's vision config is read by attribute (SigLIP's names). Head dim 80; an 8x8
    # learned position grid (image_size / patch_size), interpolated to each image's grid.
    return PretrainedConfig(hidden_size=160, intermediate_size=256, num_attention_heads=2, num_hidden_layers=3,
                            num_channels=3, image_size=112, patch_size=14, layer_norm_eps=1e-6,
                            hidden_act="gelu_pytorch_tanh")


RADIO_PATCH = 16


def _radio_config():
    from vllm.transformers_utils.configs.radio import RadioConfig

    # Nemotron Nano VL's model builds a RadioConfig from a timm name (which sets the sizes),
    # its preferred resolution and patch size and the checkpoint's args: here two teachers
    # with a CLS token each (one without a summary), registers to a multiple of 4 (so 4
    # prefix tokens per image) and CPE positions for images up to 192 px (12x12 patches).
    config = RadioConfig(model_name="vit_small_patch16_224", image_size=64, patch_size=RADIO_PATCH,
                         cpe_max_size=192, register_multiple=4, cls_token_per_teacher=True,
                         teachers=[{"name": "a"}, {"name": "b", "use_summary": False}])
    # Head dim 80, padded to 128 by vllm-ascend's rule.
    config.hidden_size, config.num_hidden_layers, config.num_attention_heads = 160, 3, 2
    config.intermediate_size = 256
    return config


def _radio_layer_scales(tower):
    """What vLLM leaves in ``ls1``/``ls2``: its ``load_weights`` skips them, so they keep the
    value the layer set at construction (``initializer_factor``)."""
    import torch

    with torch.no_grad():
        for layer in tower.model.encoder.layers:
            layer.ls1.fill_(tower.config.initializer_factor)
            layer.ls2.fill_(tower.config.initializer_factor)


def _radio_sizes(grid):
    """``imgs_sizes``: each image's (height, width) in pixels, a host list."""
    return [(h * RADIO_PATCH, w * RADIO_PATCH) for t, h, w in grid]


def _radio_encode(tower, x, imgs_sizes):
    """Nemotron Nano VL's ``extract_feature_dynamic``, up to the tower: the pixels as
    ``DynamicResolutionImageTiler.stack`` hands them over, one batch row holding every
    image's patches; the features, not the summary."""
    _, features = tower(x.unsqueeze(0), imgs_sizes=imgs_sizes)
    return features


def _muse_spark_vision_config():
    from vllm.transformers_utils.configs.muse_spark import MuseSparkVisionConfig

    # Head dim 80; an 8x8 learned position grid (sampled at each patch's position); layers
    # full, window, full (a window layer makes the tower build its sparse cu_seqlens too).
    return MuseSparkVisionConfig(hidden_size=160, intermediate_size=256, num_attention_heads=2, num_hidden_layers=3,
                                 layer_types=["full_attention", "window_attention", "full_attention"],
                                 patch_size=14, patch_temporal=2, merge_size=2, pos_emb_height=8, pos_emb_width=8,
                                 layer_norm_eps=1e-5, hidden_act="gelu",
                                 rope_parameters={"rope_type": "axial", "rope_theta": 10000.0})


def _muse_spark_images(tower, x, grid):
    """MuseSpark's model hands its NaViT a list of ``[C, H, W]`` images on the device (sizes are
    the images' own shapes, known to the host): here each image is made of its patches' rows of
    ``x`` (patch order as the tower unfolds it) and the tower is called on the list."""
    p = tower.patch_height
    images, start = [], 0
    for _, h, w in grid:
        rows = x[start:start + h * w]
        start += h * w
        images.append(rows.reshape(h, w, 3, p, p).permute(2, 0, 3, 1, 4).reshape(3, h * p, w * p))
    return tower(images)


class _Images(types.SimpleNamespace):
    """Per-image inputs as vLLM's batched field config hands them to a model: ``grid`` (the
    grid tensor, sent to the device) and ``sizes`` (each image's patch count: vLLM batches
    the pixels per image on the host side, so the split is known without reading the grid)."""


def _per_image(grid):
    return _Images(grid=_host_tensor(grid), sizes=[t * h * w for t, h, w in grid])


def _keye_configs():
    from transformers import PretrainedConfig

    # (text config, vision config), read by attribute. The projector reads the text width only.
    vision = PretrainedConfig(hidden_size=160, intermediate_size=256, num_attention_heads=2, num_hidden_layers=3,
                              num_channels=3, image_size=112, patch_size=14, layer_norm_eps=1e-6,
                              hidden_act="gelu_pytorch_tanh")
    return PretrainedConfig(hidden_size=64), vision


def _keye_vision(module):
    """What Keye-VL's ``_process_image_input`` reads of its model: ``visual`` (vLLM's
    ``KeyeSiglipVisionModel``) and ``mlp_AR`` (vLLM's ``Projector``, what Keye-VL's
    ``_build_projector`` returns), held by one module so that they are built, weighted and
    placed together."""
    import torch

    class KeyeVision(torch.nn.Module):
        def __init__(self, text_config, vision_config, prefix=""):
            super().__init__()
            self.visual = module.KeyeSiglipVisionModel(vision_config, prefix="%s.visual" % prefix)
            self.mlp_AR = module.Projector(text_config, vision_config, prefix="%s.mlp_AR" % prefix)

    return KeyeVision


def _keye_encode(tower, x, grid):
    """Keye-VL's model: its own ``_process_image_input`` with the pixels of every image in one
    tensor (``flat_from_sizes``) and the grid, both on the device (``batched`` grid field)."""
    import torch

    p = tower.visual.vision_model.embeddings.patch_size
    base = _MODULES["Keye-VL"].BaseKeyeModule
    image_input = {"type": "pixel_values", "pixel_values": x.reshape(x.shape[0], -1, p, p), "image_grid_thw": grid}
    return torch.cat(list(base._process_image_input(tower, image_input)))


def _paddleocr_vl_one_call():
    """True where PaddleOCR-VL's ``encode_image`` takes every image's grid as host tuples
    (``image_grid_thw: list[tuple[int, int, int]]``) and encodes all images in one tower call
    (vLLM 0.33.0); False where it takes one image's grid row, a tensor (0.26.0, 0.30.0)."""
    model = _MODULES["PaddleOCR-VL"].PaddleOCRVLForConditionalGeneration
    annotation = inspect.signature(model.encode_image).parameters["image_grid_thw"].annotation
    return str(annotation).startswith("list")


def _grid_kept_on_cpu(name, processor):
    """Whether tower ``name``'s model keeps ``image_grid_thw`` on the host (``keep_on_cpu``),
    read from upstream's own ``_get_mm_fields_config`` of its multimodal processor class."""
    import torch
    from transformers import BatchFeature

    config = getattr(_MODULES[name], processor)._get_mm_fields_config
    fields = config(None, BatchFeature({"image_grid_thw": torch.tensor([[1, 2, 2]])}), {})
    return bool(getattr(fields["image_grid_thw"].field, "keep_on_cpu", False))


def _paddleocr_vl_grid_on_cpu():
    return _grid_kept_on_cpu("PaddleOCR-VL", "PaddleOCRVLMultiModalProcessor")


def _ernie45_vl_device_args(arg):
    """The expanded grid on the device where upstream's field config sends ``image_grid_thw``
    there (``_vision_forward`` expands it where it is), on the host where it is ``keep_on_cpu``
    (0.30.0, 0.33.0: its tower then builds ``cu_seqlens`` on the host and asserts so)."""
    return [] if _grid_kept_on_cpu("Ernie4.5-VL", "Ernie4_5VLMultiModalProcessor") else [arg]


def _paddleocr_vl_grid(grid):
    """Per image (:func:`_per_image`) where ``encode_image`` runs once per image, else the grid tensor."""
    return _host_tensor(grid) if _paddleocr_vl_one_call() else _per_image(grid)


def _paddleocr_vl_device_args(arg):
    """The grid on the device where upstream's field config puts it there (0.26.0), on the host
    where it is ``keep_on_cpu`` (0.30.0, 0.33.0)."""
    if _paddleocr_vl_grid_on_cpu():
        return []
    return [arg.grid] if isinstance(arg, _Images) else [arg]


def _paddleocr_vl_encode(tower, x, arg):
    """PaddleOCR-VL's model, as the installed release encodes images.

    Per image (``arg`` an :class:`_Images`): ``_process_image_input`` calls its own ``encode_image``
    once per image with that image's pixels ``(patches, 3, p, p)`` and its grid row, both on the
    device. Run here as upstream's method on a holder whose only attribute is the tower
    (``self.visual``, all the method reads of ``self``).

    All at once (``arg`` the grid tensor): upstream's own ``_process_image_input`` on a holder
    with the tower (``visual``), upstream's ``encode_image`` bound to it, and the projector
    ``mlp_AR`` left out (the holder's returns the tower's per-image outputs as they are)."""
    import torch

    model = _MODULES["PaddleOCR-VL"].PaddleOCRVLForConditionalGeneration
    p = tower.vision_model.embeddings.patch_size
    if not isinstance(arg, _Images):
        holder = types.SimpleNamespace(visual=tower, mlp_AR=lambda outputs, image_grid_thw: outputs)
        holder.encode_image = types.MethodType(model.encode_image, holder)
        image_input = types.SimpleNamespace(pixel_values=x.reshape(x.shape[0], -1, p, p), image_grid_thw=arg)
        return torch.cat(list(model._process_image_input(holder, image_input)))
    holder = types.SimpleNamespace(visual=tower)
    outs = []
    for pixels, row in zip(x.split(arg.sizes), arg.grid):
        outs.append(model.encode_image(holder, pixels.reshape(pixels.shape[0], -1, p, p), row).squeeze(0))
    return torch.cat(outs)


def _cat(outputs):
    import torch

    return torch.cat(list(outputs))


def _grid_and_positions(grid):
    """LLaVA-OneVision-2's ``image_grid_thw`` and ``patch_positions`` (one ``(t, h, w)`` row per
    patch, raster order), both sent to the device by its field config."""
    import torch

    rows = [[t_i, h_i, w_i] for t, h, w in grid for t_i in range(t) for h_i in range(h) for w_i in range(w)]
    return _host_tensor(grid), torch.tensor(rows, dtype=torch.long)


def _host_tensor(grid):
    import torch

    return torch.tensor(grid, dtype=torch.long)


def _per_frame(grid):
    """Ernie4.5-VL's ``_vision_forward``: one ``[1, h, w]`` row per frame."""
    return _host_tensor([[1, h, w] for t, h, w in grid for _ in range(t)])


class Spec(types.SimpleNamespace):
    """module, cls (a class name in module, or module -> constructor), config (one config, or a tuple of the constructor's positional configs),
    kwargs (constructor), width (pixel row length from the tower), grid_arg (grid -> the
    tower's argument), grid_on_device (whether vLLM sends it there), call (tower, x,
    grid_arg) -> output, grids (optional: the two forwards' grids, default ``GRIDS``),
    classes (optional: the vLLM classes, where cls is a constructor),
    device_args (optional: grid_arg -> the tensors in it vLLM has on the device),
    weights (optional: tower -> None, run after the random weights: what vLLM's loading
    leaves that is not a checkpoint weight)."""


CENSUS = {
    "Qwen2-VL": Spec(module="vllm.model_executor.models.qwen2_vl", cls="Qwen2VisionTransformer",
                     config=_qwen2_vl_config, kwargs={"norm_eps": 1e-6}, grid_arg=_host_tensor,
                     grid_on_device=False, call=lambda tower, x, g: tower(x, grid_thw=g),
                     width=lambda tower: tower.patch_embed.proj.weight[0].numel()),
    "Qwen3-Omni": Spec(module="vllm.model_executor.models.qwen3_omni_moe_thinker",
                       cls="Qwen3Omni_VisionTransformer", config=_qwen3_omni_config, kwargs={"norm_eps": 1e-6},
                       grid_arg=_host_tensor, grid_on_device=False, call=lambda tower, x, g: tower(x, grid_thw=g),
                       width=lambda tower: tower.patch_embed.proj.weight[0].numel()),
    "dots.ocr": Spec(module="vllm.model_executor.models.dots_ocr", cls="DotsVisionTransformer",
                     config=_dots_ocr_config, kwargs={}, grid_arg=lambda grid: [list(g) for g in grid],
                     grid_on_device=False, call=lambda tower, x, g: tower(x, g),
                     width=lambda tower: tower.patch_embed.patchifier.proj.weight[0].numel()),
    "LLaVA-OneVision-2": Spec(module="vllm.model_executor.models.llava_onevision2",
                              cls="LlavaOnevision2VisionTower", config=_llava_ov2_config,
                              kwargs={"text_hidden_size": 64, "norm_eps": 1e-6}, grid_arg=_grid_and_positions,
                              grid_on_device=True, call=lambda tower, x, g: tower(x, g[0], g[1]),
                              width=lambda tower: tower.embeddings.patch_embedding.weight[0].numel()),
    "Ernie4.5-VL": Spec(module="vllm.model_executor.models.ernie45_vl", cls="Ernie4_5_VisionTransformer",
                        config=_ernie45_vl_config, kwargs={"norm_eps": 1e-6}, grid_arg=_per_frame,
                        grid_on_device=True, device_args=_ernie45_vl_device_args, call=lambda tower, x, g: tower(x, g),
                        width=lambda tower: tower.patch_embed.proj.weight[0].numel()),
    "GLM-OCR": Spec(module="vllm.model_executor.models.glm_ocr", cls="GlmOcrVisionTransformer",
                    config=_glm_ocr_config, kwargs={"norm_eps": 1e-6}, grid_arg=_host_tensor,
                    grid_on_device=False, call=lambda tower, x, g: tower(x, grid_thw=g),
                    width=lambda tower: tower.patch_embed.proj.weight[0].numel()),
    "Keye-VL": Spec(module="vllm.model_executor.models.keye", cls=_keye_vision, config=_keye_configs, kwargs={},
                    classes="KeyeSiglipVisionModel + Projector",
                    grid_arg=_host_tensor, grid_on_device=True, call=_keye_encode, grids=IMAGE_GRIDS,
                    width=lambda tower: tower.visual.vision_model.embeddings.patch_embedding.weight[0].numel()),
    "PaddleOCR-VL": Spec(module="vllm.model_executor.models.paddleocr_vl", cls="SiglipVisionModel",
                         config=_paddleocr_vl_config, kwargs={}, grid_arg=_paddleocr_vl_grid, grid_on_device=True,
                         device_args=_paddleocr_vl_device_args, call=_paddleocr_vl_encode, grids=IMAGE_GRIDS,
                         width=lambda tower: tower.vision_model.embeddings.patch_embedding.weight[0].numel()),
    "HunYuan-Vision": Spec(module="vllm.model_executor.models.hunyuan_vision", cls="HunYuanVisionTransformer",
                           config=_hunyuan_vision_config, kwargs={},
                           grid_arg=lambda grid: [list(g) for g in grid], grid_on_device=False,
                           call=lambda tower, x, g: _cat(tower(x, grid_thw=g)), grids=IMAGE_GRIDS,
                           width=lambda tower: tower.embeddings.patch_embedding.weight[0].numel()),
    "RADIO": Spec(module="vllm.model_executor.models.radio", cls="RadioModel", config=_radio_config, kwargs={},
                  grid_arg=_radio_sizes, grid_on_device=False, call=_radio_encode, grids=IMAGE_GRIDS,
                  weights=_radio_layer_scales,
                  width=lambda tower: tower.model.patch_generator.embedder.weight[0].numel()),
    "MuseSpark": Spec(module="vllm.models.muse_spark.common.vision", cls="NaViT", config=_muse_spark_vision_config,
                      kwargs={"projector_hidden_size": 64}, grid_arg=lambda grid: [list(g) for g in grid],
                      grid_on_device=False, call=_muse_spark_images, grids=IMAGE_GRIDS,
                      width=lambda tower: 3 * tower.patch_height * tower.patch_width),
}

# Towers in vLLM that reach MMEncoderAttention and are not in CENSUS: why (printed by the
# census document as it is; nothing here is a measurement).
NOT_MEASURED = {}

_MODULES = {}
# towers whose module this vLLM release has but cannot import here: {name: why}. A test that
# builds one fails with the reason (build()); the other towers' tests run.
UNIMPORTABLE = {}


def _has_module(name):
    """Whether the installed release has module ``name`` (False too where a parent package is
    missing: ``vllm.models.muse_spark`` before 0.33.0, ``vllm.models`` itself in older releases)."""
    try:
        return importlib.util.find_spec(name) is not None
    except ModuleNotFoundError:
        return False


def setup():
    """:func:`towers.setup`, then the census towers' modules imported the same way."""
    stack = towers.setup()
    if not _MODULES:
        from vllm.config import set_current_vllm_config
        import vllm.utils.torch_utils as torch_utils

        with set_current_vllm_config(stack.config), towers.placeholder_torchvision():
            for name, spec in CENSUS.items():
                if not _has_module(spec.module):
                    continue        # a tower this vLLM release does not have
                try:
                    _MODULES[name] = importlib.import_module(spec.module)
                except ImportError as exc:
                    # none known since the registry placeholder (vLLM 0.19 - 0.25's HunYuan-Vision
                    # registered its image processor with a torchvision-gated AutoImageProcessor)
                    UNIMPORTABLE[name] = "%s: %s" % (type(exc).__name__, str(exc).strip().splitlines()[0])
        for module in (torch_utils, *_MODULES.values()):
            if getattr(module, "PIN_MEMORY", False):
                module.PIN_MEMORY = False
            if callable(getattr(module, "is_pin_memory_available", None)):
                module.is_pin_memory_available = towers._no_pinned_memory
    return stack


def build(stack, name, attention_class=None, *, seed=0, dtype=None):
    """vLLM's tower ``name`` as :func:`towers.build_tower` builds its own (``dtype`` None:
    :func:`towers.hardware_dtype` of the emulated SoC)."""
    import torch
    from vllm.config import set_current_vllm_config

    spec = CENSUS[name]
    if name in UNIMPORTABLE:
        raise RuntimeError("census tower %s: its module %s does not import here: %s"
                           % (name, spec.module, UNIMPORTABLE[name]))
    configs = spec.config()
    configs = configs if isinstance(configs, tuple) else (configs,)
    with towers.registered(attention_class), set_current_vllm_config(stack.config):
        cls = spec.cls(_MODULES[name]) if callable(spec.cls) else getattr(_MODULES[name], spec.cls)
        tower = cls(*configs, prefix="visual", **spec.kwargs)
    towers._init_weights(tower, seed)
    if getattr(spec, "weights", None) is not None:
        spec.weights(tower)
    tower.to(dtype or towers.hardware_dtype()).eval()
    return towers._route_custom_ops(tower, attention_class)


def grids(forward, name=None):
    chosen = getattr(CENSUS[name], "grids", None) if name is not None else None
    return [list(g) for g in (chosen or GRIDS)[forward]]


def pixel_values(name, tower, grid, seed=0):
    import torch

    tokens = sum(t * h * w for t, h, w in grid)
    return torch.randn(tokens, CENSUS[name].width(tower),
                       generator=torch.Generator().manual_seed(seed)).to(towers._dtype_of(tower))


class Forward(types.SimpleNamespace):
    """One forward of a census tower on three sides: ``out``/``syncs`` (the shim),
    ``up``/``up_syncs`` (vLLM's tower code, vllm-ascend's untouched class), ``sdpa`` (vLLM's
    TORCH_SDPA); the ``grid`` and pixels ``x`` they all ran on, and the tower's attention
    ``layers`` (:func:`attention_layers`)."""


def attention_layers(tower):
    """The attention layers of a built tower: vLLM's encoder attention modules in it (upstream's
    attention reads cu_seqlens once per layer, so tests measure what they expect from this)."""
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    return sum(isinstance(module, MMEncoderAttention) for module in tower.modules())


def side_by_side(stack, name, device_class="A2", forwards=2, *, grid_on_device=False):
    """The three towers of ``name`` (one seed), each run over the same inputs for ``forwards``
    grids (:func:`grids`): a list of :class:`Forward`. Upstream runs vLLM's own code of the
    tower's module (:func:`towers.upstream_methods`: what a tower patch replaced, put back).
    ``grid_on_device``: see :func:`call`."""
    attention, untouched = stack.attention[device_class], stack.upstream[device_class]
    dtype = towers.hardware_dtype(device_class)
    patched = build(stack, name, attention, dtype=dtype)
    upstream = build(stack, name, untouched, dtype=dtype)
    sdpa = build(stack, name, None, dtype=dtype)
    runs = []
    for forward in range(forwards):
        grid = grids(forward, name)
        x = pixel_values(name, patched, grid, seed=forward)
        out, syncs = call(name, patched, attention, x, grid, grid_on_device=grid_on_device)
        with towers.upstream_methods(_MODULES[name]):
            up, up_syncs = call(name, upstream, untouched, x, grid, grid_on_device=grid_on_device)
        sd, _ = call(name, sdpa, None, x, grid, grid_on_device=grid_on_device)
        runs.append(Forward(index=forward, grid=grid, x=x, out=out, syncs=syncs, up=up, up_syncs=up_syncs,
                            sdpa=sd, layers=attention_layers(patched)))
    return runs


def assert_matches_references(stack, name, run, tolerance):
    """``run.out`` equals upstream's bit for bit (the same ops on the same data) and is within
    ``tolerance[dtype]`` x max |reference| of the float64 tower (same weights, rounded to the
    tower's dtype) and of vLLM's TORCH_SDPA tower in the same dtype."""
    import torch

    assert torch.equal(run.out, run.up)
    ref = reference_forward(stack, name, run.x, run.grid)
    towers.assert_near_references("tower (census)", run.out, ref, run.sdpa, tolerance)


def device_args(name, arg):
    """The tensors in tower ``name``'s grid argument ``arg`` (:attr:`Spec.grid_arg`'s) that vLLM
    has on the device: where its multimodal field config puts them."""
    spec = CENSUS[name]
    if getattr(spec, "device_args", None) is not None:
        return list(spec.device_args(arg))
    return list(arg) if isinstance(arg, tuple) else [arg] if spec.grid_on_device else []


def call(name, tower, attention_class, x, grid, *, grid_on_device=False):
    """One whole tower forward in ``torch.inference_mode()`` with ``attention_class``
    registered, device->host reads counted: (output, counter). The grid's tensors are where vLLM
    has them (:func:`device_args`); with ``grid_on_device`` a grid tensor is a device stand-in
    whatever vLLM does (a patch that takes host lengths from a host grid must tell it from one)."""
    import torch

    from npu_shim.testing import count_host_syncs

    spec = CENSUS[name]
    arg = spec.grid_arg(grid)
    if grid_on_device:
        placed = [arg] if isinstance(arg, torch.Tensor) else device_args(name, arg)
        if not placed:
            raise ValueError("census tower %s: its grid argument holds no tensor to place" % name)
    else:
        placed = device_args(name, arg)
    with torch.inference_mode(), towers.registered(attention_class):
        with count_host_syncs(device_tensors=[x] + placed, device_modules=[tower]) as syncs:
            out = spec.call(tower, x, arg)
    return out, syncs


def reference_forward(stack, name, x, grid, *, seed=0):
    """Tower ``name`` with the weights of ``seed`` in float64, every attention layer
    :func:`npu_shim.testing.attention_f64`."""
    import torch

    ref = build(stack, name, None, seed=seed, dtype=x.dtype).double()
    towers.f64_attention_layers(ref)
    with torch.inference_mode(), towers.registered(None):
        return CENSUS[name].call(ref, x.double(), CENSUS[name].grid_arg(grid))
