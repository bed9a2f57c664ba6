"""sglang's own vision towers on CPU (Qwen2.5-VL, Qwen3-VL, GLM-4V), for the tests of
``sglang.vision_host_lengths`` and ``benchmarks/bench_towers.py``. sglang is imported only
inside the functions.

What runs is sglang's code at the installed release: the tower class its model builds as
``self.visual`` (``Qwen2_5_VisionTransformer``, ``Qwen3VLMoeVisionModel``,
``Glm4vVisionModel``), from a tiny random config (transformers' vision config classes), with
``mm_attention_backend="ascend_attn"`` in sglang's global server args (the NPU attention
backend: ``VisionAscendAttention``), a one-rank gloo process group for sglang's parallel
linears, and the tower's own forward. Stand-ins, because this machine has no NPU (see
:mod:`npu_shim.testing.sglang_vision`): torch_npu is npu-shim's emulation, sglang's
``_is_npu`` / ``is_npu()`` answer True in the vision module and the model module, and the
tower's parameters and pixel values are device stand-ins of the sync counter
(``follow_placement``: what the tower creates on ``x.device`` is on the device, what it
moves to ``"cpu"`` is a read).

How each tower is called: as the sglang model calls ``self.visual``: pixel values on the
device (sglang moves ``item.feature`` there, ``managers/mm_utils.py``) and ``grid_thw`` the
host tensor the processor made (sglang never moves ``image_grid_thw``).

"Upstream" is the same tower with ``npu_shim.uninstall()`` in force for its forward (the
model module binds ``prepare_vision_attention_metadata`` by name; the shim's function hands
the call to upstream's once uninstalled). The float64 reference is the same tower (same
weights, rounded to the tower's dtype first) in float64 with every ``VisionAscendAttention``
replaced by :func:`npu_shim.testing.reference.attention_f64` over the tower's own
``cu_seqlens`` (the definition of attention within each segment).
"""
import contextlib
import importlib
import os
import tempfile
import types

__all__ = ["TOWERS", "GRIDS", "setup", "config", "build", "pixel_values", "forward", "reference_forward",
           "relative_error"]

# Two forwards: three images (one of them two frames), then two. h, w multiples of 2 (the 2x2
# merge); Qwen2.5-VL's windows are 4 x 4 merged units (window_size 112 / 2 / 14).
GRIDS = ([[1, 8, 8], [2, 4, 12], [1, 12, 8]], [[1, 4, 4], [1, 8, 12]])
# GLM-4V's position embedding takes one grid row per segment (t = 1: images; sglang's GLM-4V
# model hands videos frame by frame).
GRIDS_ONE_FRAME = ([[1, 8, 8], [1, 4, 12], [1, 12, 8]], [[1, 4, 4], [1, 8, 12]])
# |tower - float64 tower| / max |float64 tower|; measured worst: see the tests.
TOLERANCES = {"bfloat16": 5e-2, "float16": 1e-2}


def _qwen2_5_vl_config():
    from transformers.models.qwen2_5_vl.configuration_qwen2_5_vl import Qwen2_5_VLVisionConfig

    return Qwen2_5_VLVisionConfig(depth=4, hidden_size=128, num_heads=2, intermediate_size=256,
                                  out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                                  temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1, 3],
                                  in_channels=3, hidden_act="silu")


def _qwen3_vl_config():
    from transformers.models.qwen3_vl.configuration_qwen3_vl import Qwen3VLVisionConfig

    return Qwen3VLVisionConfig(depth=3, hidden_size=128, num_heads=2, intermediate_size=256,
                               out_hidden_size=64, patch_size=16, spatial_merge_size=2,
                               temporal_patch_size=2, num_position_embeddings=64,
                               deepstack_visual_indexes=[1], in_channels=3, hidden_act="gelu_pytorch_tanh")


def _glm4v_config():
    from transformers.models.glm4v.configuration_glm4v import Glm4vVisionConfig

    from sglang.srt.layers.attention import vision_utils

    config = Glm4vVisionConfig(depth=3, hidden_size=128, num_heads=2, intermediate_size=256, out_hidden_size=64,
                               patch_size=14, spatial_merge_size=2, temporal_patch_size=2, image_size=112,
                               in_channels=3, hidden_act="silu", rms_norm_eps=1e-5)
    # what Glm4vForConditionalGeneration does to its config before building the tower
    vision_utils.update_vit_attn_dummy_heads_config(types.SimpleNamespace(vision_config=config))
    return config


TOWERS = {
    "Qwen2.5-VL": types.SimpleNamespace(module="sglang.srt.models.qwen2_5_vl", cls="Qwen2_5_VisionTransformer",
                                        config=_qwen2_5_vl_config, kwargs={"norm_eps": 1e-6}, also=(), grids=GRIDS),
    "Qwen3-VL": types.SimpleNamespace(module="sglang.srt.models.qwen3_vl", cls="Qwen3VLMoeVisionModel",
                                      config=_qwen3_vl_config, kwargs={"norm_eps": 1e-6},
                                      # its rotary table (get_rope): sglang's RotaryEmbedding takes
                                      # vLLM's CUDA kernel off NPU/CPU; only its cos/sin cache is read
                                      also=("sglang.srt.layers.rotary_embedding.base",), grids=GRIDS),
    "GLM-4V": types.SimpleNamespace(module="sglang.srt.models.glm4v", cls="Glm4vVisionModel",
                                    config=_glm4v_config, kwargs={}, also=("sglang.srt.layers.rotary_embedding.base",),
                                    grids=GRIDS_ONE_FRAME),
}

_STATE = {}


def setup():
    """Emulation, the shim, sglang's server args (NPU vision backend) and a one-rank process
    group; the tower modules imported. Returns {tower name: model module}.

    The server args are published again on every call: sglang keeps one set per process, and
    another test may have published its own since (``cp_case.set_cpu_server_args``, without
    the vision backend); a tower built then would get sglang's SDPA vision attention."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    if "modules" in _STATE:
        set_global_server_args_for_scheduler(_STATE["server_args"])
        return _STATE["modules"]
    import npu_shim
    from npu_shim import emulation

    emulation.install()
    npu_shim.install()
    _STATE["server_args"] = ServerArgs(model_path="dummy", device="cpu", mm_attention_backend="ascend_attn")
    set_global_server_args_for_scheduler(_STATE["server_args"])
    from sglang.srt.distributed import parallel_state

    if not parallel_state.model_parallel_is_initialized():
        handle, path = tempfile.mkstemp(prefix="npu_shim_sglang_towers_")
        os.close(handle)
        os.unlink(path)
        parallel_state.init_distributed_environment(world_size=1, rank=0, local_rank=0,
                                                    distributed_init_method="file://" + path, backend="gloo")
        import inspect

        if "tensor_model_parallel_size" in inspect.signature(parallel_state.initialize_model_parallel).parameters:
            parallel_state.initialize_model_parallel(tensor_model_parallel_size=1)
        else:       # later releases read the widths from the server args (1 here)
            parallel_state.initialize_model_parallel()
    importlib.import_module("sglang.srt.layers.attention.vision")
    _STATE["modules"] = {name: importlib.import_module(spec.module) for name, spec in TOWERS.items()}
    return _STATE["modules"]


@contextlib.contextmanager
def npu(name):
    """The vision module and tower ``name``'s model module see an NPU (sglang_vision.npu_platform)."""
    from npu_shim.testing import sglang_vision

    also = [importlib.import_module(module) for module in TOWERS[name].also]
    with sglang_vision.npu_platform(setup()[name], *also) as vision:
        yield vision


def _init_weights(model, seed):
    import torch

    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in sorted(model.named_parameters()):
            noise = torch.randn(param.shape, generator=gen, dtype=torch.float32)
            if "norm" in pname and pname.endswith("weight"):
                param.copy_(1 + 0.1 * noise)
            elif param.dim() >= 2:
                param.copy_(noise * (2.0 / param[0].numel()) ** 0.5)
            else:
                param.copy_(0.02 * noise)


def config(name, head_dim=None):
    """Tower ``name``'s tiny config; ``head_dim``: its attention head dim instead of 64 (the hidden
    size made ``num_heads * head_dim``, as the real towers' is: Qwen2.5-VL 16 x 80)."""
    made = TOWERS[name].config()
    if head_dim is not None:
        made.hidden_size = made.num_heads * int(head_dim)
    return made


def build(name, dtype, *, seed=0, head_dim=None, vision_config=None):
    """sglang's tower ``name`` from its tiny config (:func:`config`; ``vision_config``: this one
    instead, e.g. a saved model's), random weights of ``seed``, in ``dtype``."""
    import torch

    spec = TOWERS[name]
    previous = torch.get_default_dtype()
    # as sglang's model loader builds a model: under the model dtype as torch's default (its
    # LayerNorm keeps float32 parameters, and says so in its own dtype attribute)
    torch.set_default_dtype(dtype)
    try:
        with npu(name):
            # use_data_parallel: the tower whole on this rank (sglang's --mm-enable-dp-encoder), so the
            # one-rank groups are enough on every release (0.5.23 reads its TP rank from a runtime
            # context that only a scheduler process writes)
            made = vision_config if vision_config is not None else config(name, head_dim)
            tower = getattr(setup()[name], spec.cls)(made, prefix="visual",
                                                     use_data_parallel=True, **spec.kwargs)
    finally:
        torch.set_default_dtype(previous)
    _init_weights(tower, seed)
    return tower.eval()


def pixel_values(tower, grid, seed=0):
    import torch

    weight = tower.patch_embed.proj.weight
    tokens = sum(t * h * w for t, h, w in grid)
    return torch.randn(tokens, weight[0].numel(), generator=torch.Generator().manual_seed(seed)).to(weight.dtype)


@contextlib.contextmanager
def _side(upstream):
    import npu_shim

    if not upstream:
        yield
        return
    npu_shim.uninstall()
    try:
        yield
    finally:
        npu_shim.install()


def forward(name, tower, x, grid, *, upstream=False, strict=False):
    """One tower forward as sglang's model makes it, under a sync counter with the tower and
    ``x`` as device stand-ins: (output, counter, recorded NPU calls)."""
    import torch

    from npu_shim.testing import count_host_syncs, record_npu_calls
    from npu_shim.testing.sglang_vision import counting_as_npu

    grid_thw = torch.tensor(grid, dtype=torch.long)
    with npu(name), _side(upstream), torch.inference_mode():
        with count_host_syncs(device_tensors=[x], device_modules=[tower], follow_placement=True,
                              strict=strict) as syncs, counting_as_npu(syncs), record_npu_calls() as calls:
            out = tower(x, grid_thw=grid_thw)
    return out, syncs, calls


def _attention_f64(layer, q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=None, **kwargs):
    import torch

    from npu_shim.testing.reference import attention_f64

    metadata = kwargs.get("forward_metadata")
    if cu_seqlens is None and metadata is not None:
        cu_seqlens = metadata.cu_seqlens
    if not isinstance(cu_seqlens, torch.Tensor):
        cu_seqlens = cu_seqlens.get() if hasattr(cu_seqlens, "get") else torch.tensor(cu_seqlens)
    return attention_f64(q, k, v, cu_seqlens.tolist(), scale=softmax_scale).to(q.dtype)


def reference_forward(name, x, grid, *, seed=0, head_dim=None):
    """The tower with the weights of ``seed`` rounded to ``x.dtype``, in float64, every vision
    attention :func:`attention_f64` (no emulated op: those take no float64)."""
    import torch

    ref = build(name, x.dtype, seed=seed, head_dim=head_dim).double()
    with npu(name) as vision:
        for layer in ref.modules():
            if isinstance(layer, vision.VisionAscendAttention):
                layer.forward = types.MethodType(_attention_f64, layer)
            if isinstance(vars(layer).get("dtype"), torch.dtype):     # sglang's LayerNorm casts to it
                layer.dtype = torch.float64
    grid_thw = torch.tensor(grid, dtype=torch.long)
    with npu(name), torch.inference_mode():
        return tower_output(ref(x.double(), grid_thw=grid_thw))


def tower_output(out):
    """The image embeddings of a tower's output (Qwen3-VL also returns deepstack features,
    concatenated on the last dimension in 0.5.x: compared whole)."""
    return out[0] if isinstance(out, tuple) else out


def relative_error(out, ref):
    """max |out - ref| / max |ref| (no floor)."""
    out = tower_output(out)
    return ((out.double() - ref).abs().max() / ref.abs().max()).item()


class Forward(types.SimpleNamespace):
    """One forward of a tower on both sides: ``grid``, ``out``/``syncs``/``calls`` (the shim),
    ``up``/``up_syncs``/``up_calls`` (upstream; None, with ``up_failure`` the op's refusal, where
    upstream cannot run: 0.5.16 with two images or more), ``error`` / ``up_error`` (the shim's /
    upstream's output vs float64, :func:`relative_error`)."""

    def sites(self, upstream=False):
        """Where the reads were made: ``{"file:line in function": count}``."""
        from collections import Counter

        return dict(Counter(e.location for e in (self.up_syncs if upstream else self.syncs).events))


def side_by_side(name, dtype, *, seed=0):
    """Tower ``name`` in ``dtype`` (one set of weights) over each grid of its spec, upstream and
    the shim: a list of :class:`Forward`."""
    tower = build(name, dtype, seed=seed)
    runs = []
    for index, grid in enumerate(TOWERS[name].grids):
        x = pixel_values(tower, grid, seed=index)
        try:
            up, up_syncs, up_calls = forward(name, tower, x, grid, upstream=True)
            up_failure = None
        except ValueError as exc:       # 0.5.16: per-image lengths to FIA TND, refused as the op does
            if "actual_seq_lengths" not in str(exc):
                raise
            up, up_syncs, up_calls, up_failure = None, None, None, str(exc)
        out, syncs, calls = forward(name, tower, x, grid)
        ref = reference_forward(name, x, grid, seed=seed)
        runs.append(Forward(index=index, grid=grid, out=out, syncs=syncs, calls=calls, up=up, up_syncs=up_syncs,
                            up_calls=up_calls, up_failure=up_failure, error=relative_error(out, ref),
                            up_error=None if up is None else relative_error(up, ref)))
    return runs
