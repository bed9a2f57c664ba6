"""MoonViT on CPU, shared by the tests, the benchmark and the selftest of ``vllm.moonvit_attn``.

vLLM's real ``MoonVitPretrainedModel`` set up on CPU (vLLM's layer context), built with a
given head geometry and deterministic random weights, fed packed images of uneven grids;
the device->host reads of its attention path classified; one tower forward checked layer by
layer against ``npu_shim.testing.attention_f64``. ``tests/lanes/test_moonvit*.py``,
``benchmarks/bench_moonvit.py`` and ``npu_shim.selftest.vllm_moonvit_attn`` use these, so the
three exercise the same upstream code the same way.
"""
import atexit
import contextlib
import os
import tempfile
import time

PATCH_NAME = "vllm.moonvit_attn"
TARGET = "vllm.model_executor.models.moonvit"
ENV_VAR = "NPU_SHIM_MOONVIT_ATTN"

# Kimi-VL (moonshotai/Kimi-VL-A3B-*) vision tower: MoonViT, 27 layers.
KIMI_VL = dict(hidden_size=1152, num_attention_heads=16, intermediate_size=4304, num_hidden_layers=27)
TINY = dict(hidden_size=64, num_attention_heads=4, intermediate_size=128, num_hidden_layers=2)
SELFTEST = dict(hidden_size=288, num_attention_heads=4, intermediate_size=576, num_hidden_layers=2)
GRIDS = ((8, 12), (6, 4), (10, 6))   # (h, w) patches per image, even (2x2 patch merge)
TOLERANCE = {"float32": 2e-5, "float16": 4e-3, "bfloat16": 3e-2}  # x max(1, max |reference|)

# Functions whose host syncs belong to the attention path (the rest of the
# tower -- patch embedding, rope table, patch merger -- reads grid_hw itself).
ATTENTION_FUNCTIONS = ("sdpa_attention", "ascend_fa_attention", "multihead_attention")


# --------------------------------------------------------------------------- set-up


def moonvit_module():
    """The imported upstream module, with vLLM kept off any accelerator platform plugin.

    ``VLLM_PLUGINS=""`` (a list naming no plugin) stops vLLM from activating
    vllm-ascend's NPU platform on a machine without an NPU; it is set only if
    the caller has not chosen.
    """
    import importlib

    os.environ.setdefault("VLLM_PLUGINS", "")
    return importlib.import_module(TARGET)


def applied_module():
    """The moonvit module, after checking the shim's patch is applied to it."""
    from npu_shim.selftest import applied_target, on_upstream

    moonvit_module()
    module = applied_target(PATCH_NAME)
    if not on_upstream(PATCH_NAME) and "ascend_fa" not in module.VL_VISION_ATTENTION_FUNCTIONS:
        raise RuntimeError("%s reports applied but VL_VISION_ATTENTION_FUNCTIONS has no ascend_fa" % PATCH_NAME)
    return module


@contextlib.contextmanager
def env_choice(value):
    """Build models with ``NPU_SHIM_MOONVIT_ATTN=value`` (None: unset), then restore.

    The patch reads the choice from this process's validated settings, so those
    are swapped for ones with this choice (a malformed value raises ConfigError
    here, naming the variable); the variable is set too, for child interpreters.
    """
    import copy

    from npu_shim import _config

    chosen = copy.copy(_config.settings())
    chosen.moonvit_attn = _config.Settings({} if value is None else {ENV_VAR: value}).moonvit_attn
    old = os.environ.get(ENV_VAR)
    if value is None:
        os.environ.pop(ENV_VAR, None)
    else:
        os.environ[ENV_VAR] = value
    previous = _config.use_settings(chosen)
    try:
        yield
    finally:
        _config.use_settings(previous)
        if old is None:
            os.environ.pop(ENV_VAR, None)
        else:
            os.environ[ENV_VAR] = old


_VLLM_CONFIGS = {}


@contextlib.contextmanager
def vllm_layer_context(module, device="cpu"):
    """What vLLM 0.10.2+ layers need to be constructed outside an engine.

    Their ``ReplicatedLinear``/``Conv2dLayer`` read the current ``VllmConfig``
    and the tensor-parallel rank; a one-process gloo group gives them rank 0 of
    1. vLLM 0.8.5-0.10.1.1 build MoonViT from plain ``nn.Linear`` and need none
    of it.
    """
    if not hasattr(module, "ReplicatedLinear"):
        yield
        return
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed import parallel_state

    config = _VLLM_CONFIGS.get(device)
    if config is None:
        config = _VLLM_CONFIGS[device] = VllmConfig(device_config=DeviceConfig(device=device))
    with set_current_vllm_config(config):
        if not parallel_state.model_parallel_is_initialized():
            init_file = tempfile.NamedTemporaryFile(prefix="npu_shim_moonvit_", delete=False)
            init_file.close()
            os.unlink(init_file.name)
            # gloo's file store lives as long as the process group, i.e. the process.
            atexit.register(_remove_if_present, init_file.name)
            parallel_state.init_distributed_environment(
                world_size=1, rank=0, local_rank=0,
                distributed_init_method="file://" + init_file.name, backend="gloo")
            parallel_state.ensure_model_parallel_initialized(1, 1)
        yield


def _remove_if_present(path):
    with contextlib.suppress(OSError):
        os.unlink(path)


# --------------------------------------------------------------------------- models and inputs


def make_config(module, geometry, attn_implementation=None):
    config = module.MoonViTConfig(patch_size=14, init_pos_emb_height=16, init_pos_emb_width=16,
                                  merge_kernel_size=(2, 2), **geometry)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return config


def build_tower(module, geometry, *, dtype=None, device="cpu", seed=0, choice=None,
                attn_implementation=None):
    """vLLM's ``MoonVitPretrainedModel`` with deterministic random weights.

    ``choice`` sets ``NPU_SHIM_MOONVIT_ATTN`` while the layers are built (None:
    the environment's value); ``attn_implementation`` is what the config asks
    for (None: transformers' default).
    """
    import torch

    config = make_config(module, geometry, attn_implementation)
    with env_choice(choice) if choice is not None else contextlib.nullcontext():
        with vllm_layer_context(module, device):
            model = module.MoonVitPretrainedModel(config)
    init_weights(model, seed)
    model.to(device=device, dtype=dtype or torch.float32)
    model.eval()
    # Rope2DPosEmb keeps its table on ``device`` (vllm 0.10.1.1 defaults to "cuda").
    model.encoder.rope_2d.device = device
    return model


def init_weights(model, seed):
    """Same weights for the same seed and geometry, whatever vLLM left in the parameters.

    (vLLM 0.10.2+ allocate with torch.empty and expect a checkpoint.) Matrices
    get N(0, 1/fan_in) -- wqkv twice that, so attention is far from uniform and
    a token attending to the wrong image shows --, norms 1 + N(0, 0.1^2), biases
    and the position table small noise.
    """
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in name and name.endswith("weight"):
                value = 1 + 0.1 * noise
            elif name.endswith("bias") or "pos_emb" in name:
                value = 0.02 * noise
            else:
                fan_in = param[0].numel() if param.dim() > 1 else param.numel()
                value = noise * fan_in ** -0.5 * (2.0 if "wqkv" in name else 1.0)
            param.copy_(value.to(param.dtype))


def make_inputs(grids=GRIDS, *, patch_size=14, seed=1, dtype=None, device="cpu"):
    """(pixel_values (L, 3, p, p), grid_hw (n, 2)) for images of these patch grids."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    tokens = sum(h * w for h, w in grids)
    pixels = torch.randn(tokens, 3, patch_size, patch_size, generator=gen)
    grid_hw = torch.tensor(grids, dtype=torch.int64)
    return pixels.to(device=device, dtype=dtype or torch.float32), grid_hw.to(device)


def image_slices(grids):
    """Token ranges of each image in the tower's packed output (after the 2x2 merge)."""
    out, start = [], 0
    for h, w in grids:
        n = (h // 2) * (w // 2)
        out.append(slice(start, start + n))
        start += n
    return out


def forward(model, pixels, grid_hw):
    """The tower's output, concatenated over images: (sum merged tokens, 4, hidden)."""
    import torch

    with torch.no_grad():
        return torch.cat(list(model(pixels, grid_hw)), dim=0)


def attention_syncs(counter):
    """The host-sync events of ``counter`` made by the attention path (see ATTENTION_FUNCTIONS)."""
    return [e for e in counter.events
            if e.location.endswith(ATTENTION_FUNCTIONS) or "/kernels/" in e.location
            or e.location.startswith("kernels/")]


@contextlib.contextmanager
def cu_seqlens_on_device(model, counter):
    """Tell ``counter`` that the ``cu_seqlens`` every block receives lives on the device.

    On an NPU it does (vLLM moves ``grid_hw`` to the device and the encoder
    derives ``cu_seqlens`` from it). On CPU, vLLM 0.10.2+'s
    ``(grid_hw[:, 0] * grid_hw[:, 1]).to(hidden_states.device)`` is a
    ``.to("cpu")`` that the counter must take for a device->host copy (it
    records it, outside the attention path), after which ``cu_seqlens`` would
    look like a host tensor; marking it here restores what an NPU run sees.
    """
    handles = [block.register_forward_pre_hook(lambda _m, args: counter.mark_device(args[1]))
               for block in model.encoder.blocks]
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


@contextlib.contextmanager
def capture_attention_outputs(model):
    """Record what each layer's attention function returned (the input of ``wo``)."""
    outputs = []
    handles = [block.wo.register_forward_pre_hook(lambda _m, args: outputs.append(args[0].detach()))
               for block in model.encoder.blocks]
    try:
        yield outputs
    finally:
        for handle in handles:
            handle.remove()


def fusion_calls_report(calls, num_layers, head_dim):
    """Check the recorded NPU calls of one forward; return the per-call (q, k, v, ends, out).

    One ``npu_fusion_attention`` per layer, TND layout, no mask, cumulative
    lengths as Python ints; padded head-dim columns are zero.
    """
    fused = [c for c in calls if c.name == "npu_fusion_attention"]
    others = [c.name for c in calls if c.name != "npu_fusion_attention"]
    if len(fused) != num_layers or others:
        raise AssertionError("expected %d npu_fusion_attention calls and nothing else, got %d (+ %s)"
                             % (num_layers, len(fused), others))
    records = []
    for call in fused:
        q, k, v = call.args[:3]
        ends = call.arg("actual_seq_qlen")
        if call.arg("input_layout") != "TND":
            raise AssertionError("input_layout %r, expected TND" % call.arg("input_layout"))
        if call.arg("atten_mask") is not None or call.arg("pse") is not None:
            raise AssertionError("a mask/pse tensor was passed to npu_fusion_attention")
        if not (isinstance(ends, (list, tuple)) and all(type(x) is int for x in ends)):
            raise AssertionError("actual_seq_qlen is not a list of Python ints: %r" % (ends,))
        if call.arg("actual_seq_kvlen") != ends:
            raise AssertionError("actual_seq_kvlen differs from actual_seq_qlen")
        for name, t in (("q", q), ("k", k), ("v", v)):
            if t.shape[-1] > head_dim and t[..., head_dim:].abs().max().item() != 0:
                raise AssertionError("padded columns of %s are not zero" % name)
        records.append((q[..., :head_dim], k[..., :head_dim], v[..., :head_dim], list(ends),
                        call.result[0][..., :head_dim], call.arg("scale")))
    return records


# --------------------------------------------------------------------------- selftest


def check_tower(model, geometry, *, dtype, device):
    """One forward of ``model`` (all layers on ascend_fa) against the float64 reference.

    Returns (max_abs_err, tolerance, attention host syncs, seconds). Raises if a
    layer did not make exactly one fused mask-free NPU call.
    """
    from npu_shim.testing import attention_f64, count_host_syncs, record_npu_calls

    heads = geometry["num_attention_heads"]
    head_dim = geometry["hidden_size"] // heads
    if any(block.attn_implementation != "ascend_fa" for block in model.encoder.blocks):
        raise RuntimeError("the tower's layers do not use ascend_fa: %s"
                           % [b.attn_implementation for b in model.encoder.blocks])
    pixels, grid_hw = make_inputs(dtype=dtype, device=device)
    started = time.perf_counter()
    with count_host_syncs(device_tensors=[pixels, grid_hw]) as syncs, \
            cu_seqlens_on_device(model, syncs), record_npu_calls() as calls, \
            capture_attention_outputs(model) as layer_outputs:
        forward(model, pixels, grid_hw)
    seconds = time.perf_counter() - started

    records = fusion_calls_report(calls, geometry["num_hidden_layers"], head_dim)
    max_err, max_ref = 0.0, 0.0
    for (q, k, v, ends, _, scale), returned in zip(records, layer_outputs):
        reference = attention_f64(q, k, v, [0] + ends, scale=scale)
        got = returned.reshape(reference.shape).double().cpu()
        max_err = max(max_err, (got - reference).abs().max().item())
        max_ref = max(max_ref, reference.abs().max().item())
    tolerance = TOLERANCE[str(dtype).replace("torch.", "")] * max(1.0, max_ref)
    return max_err, tolerance, len(attention_syncs(syncs)), seconds


def describe(geometry, dtype):
    heads = geometry["num_attention_heads"]
    return "vllm MoonVitPretrainedModel, %d layers, %d heads x %d, images %s, %s" % (
        geometry["num_hidden_layers"], heads, geometry["hidden_size"] // heads,
        "+".join("%dx%d" % g for g in GRIDS), str(dtype).replace("torch.", ""))


def selftest_dtype(device):
    import torch

    return torch.float16  # taken by the real op on every device class that has it (emulation.dtypes)
