"""MiMo-V2-Flash's QKV projection (K 192, V 128) as a vllm-ascend worker builds it: ``vllm.ascend_qkv_v_head_size``.

The layers are vLLM's own ``MiMoV2Attention`` (:mod:`npu_shim.testing.mimo`, tiny sizes: hidden 64,
4 heads over 2 KV heads), built inside :func:`npu_shim.testing.mimo.ascend_registrations`: vllm-ascend's
own ``init_ascend_config`` and ``register_ascend_customop`` have run, so vLLM's
``PluggableLayer.__new__`` hands the model vllm-ascend's ``AscendQKVParallelLinear`` for its
``QKVParallelLinear`` (and ``AscendRowParallelLinear``, ``AscendRotaryEmbedding`` for the others),
as at worker start. The checkpoint (separate ``q_proj`` / ``k_proj`` / ``v_proj`` / ``o_proj``
tensors, as MiMo-V2-Flash ships them) is loaded through the model's own ``MiMoV2Model.load_weights``
(its stacked-parameter mapping, vLLM's weight loaders); the layer's own ``forward`` then runs.

Stand-ins, each named: the registration's own (:func:`npu_shim.testing.mimo.ascend_registrations`:
import placeholders for ``scipy`` and ``fla_npu`` while it imports, a model config that is not MLA,
vllm-ascend's gemm op registered for CPU with upstream's own function); the ``self`` of
``MiMoV2Model.load_weights`` is a module holding the one layer under its checkpoint name, with the
model class's own methods, no experts and no quantization (:func:`_load`); the attention (``self.attn``) is the
float64 reference of :func:`npu_shim.testing.mimo.sink_attention_f64` on what the layer hands it
(vllm-ascend's attention for this layer is tested in test_mimo_v2_flash.py).
"""
import contextlib
import inspect

import pytest

PATCH = "vllm.ascend_qkv_v_head_size"
pytestmark = [pytest.mark.claimed(PATCH), pytest.mark.patch(PATCH)]
TOKENS = 6


@pytest.fixture(scope="module")
def mimo():
    from npu_shim.testing import mimo

    mimo.setup()
    return mimo


def _linear_class():
    import sys

    return sys.modules["vllm_ascend.ops.linear"].AscendQKVParallelLinear


@contextlib.contextmanager
def _upstream_init():
    """Inside the block, ``AscendQKVParallelLinear.__init__`` is upstream's (the patched one after)."""
    cls = _linear_class()
    patched = vars(cls)["__init__"]
    cls.__init__ = patched.__wrapped_upstream__
    try:
        yield
    finally:
        cls.__init__ = patched


def _pads_v_itself(mimo):
    """Whether the release's own ``MiMoV2Attention.forward`` pads V to the key head dim (vLLM up to
    0.19): then the attention gets V 192 wide, zeros past 128, and a sliding-window layer (sinks) is
    refused at build by ``vllm.mimo_v2_flash_sinks_refuse`` unless ``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1``."""
    forward = mimo.attention_class().forward
    return "functional.pad" in inspect.getsource(getattr(forward, "__wrapped_upstream__", forward))


def _build(mimo, kind, upstream=False, **overrides):
    """A ``MiMoV2Attention`` of ``kind`` built with vllm-ascend's registrations in effect (``upstream``:
    with upstream's ``AscendQKVParallelLinear.__init__``). Where the model pads V itself, a layer with
    sinks is built with ``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1`` (its refusal is another patch's subject)."""
    sinks = mimo.padded(sinks=True) if _pads_v_itself(mimo) and kind == "swa" else contextlib.nullcontext()
    with mimo.ascend_registrations(), mimo.ascend_backend(), (_upstream_init() if upstream
                                                                else contextlib.nullcontext()), sinks:
        return mimo.build_layer(kind, **overrides)


def _checkpoint(layer, seed=11):
    """Checkpoint-shaped tensors for ``layer`` (float32), named as in ``MiMoV2Model``'s checkpoint."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    base = layer.attn.layer_name.rpartition(".attn")[0].partition("model.")[2]   # layers.N.self_attn
    hidden = layer.qkv_proj.input_size
    shapes = {"q_proj": (layer.num_heads * layer.head_dim, hidden),
              "k_proj": (layer.num_kv_heads * layer.head_dim, hidden),
              "v_proj": (layer.num_kv_heads * layer.v_head_dim, hidden),
              "o_proj": (hidden, layer.num_heads * layer.v_head_dim)}
    weights = {"%s.%s.weight" % (base, name): torch.randn(shape, generator=generator) * 0.2
               for name, shape in shapes.items()}
    if getattr(layer, "attention_sink_bias", None) is not None:
        weights[base + ".attention_sink_bias"] = torch.randn(layer.num_heads, generator=generator)
    return base, weights


def _load(mimo, layer, weights):
    """``weights`` loaded into ``layer`` by the model's own ``MiMoV2Model.load_weights``, its ``self``
    a module holding the layer under its checkpoint name, with the model class's methods, no
    experts and no quantization (``quant_config`` None, read by vLLM 0.20's). Returns the loaded parameter names."""
    import torch

    model_class = mimo.model_module().MiMoV2Model
    methods = {name: value for name, value in vars(model_class).items()
               if inspect.isfunction(value) and name not in ("__init__", "forward")}
    methods.update(get_expert_mapping=lambda self: [], quant_config=None)       # no experts, not quantized
    stand_in = type("MiMoV2ModelStandIn", (torch.nn.Module,), methods)()
    index = layer.attn.layer_name.split(".")[2]
    stand_in.layers = torch.nn.Module()
    holder = torch.nn.Module()
    holder.self_attn = layer
    stand_in.layers.add_module(index, holder)
    with torch.no_grad():
        return stand_in.load_weights(iter(weights.items()))


def _forward(mimo, layer):
    """The layer's own forward over one prefill of :data:`TOKENS` tokens, ``self.attn`` the float64
    reference attention; returns (output, the v the layer handed the attention, hidden, positions).
    Where the model pads V itself, the attention gets V padded with zeros (checked here) and its output
    as wide, which the model cuts: the returned v is its first ``v_head_dim`` columns per head."""
    import torch

    seen = {}
    sinks = getattr(layer, "attention_sink_bias", None)
    window = layer.attn.sliding_window or None

    class ReferenceAttention(torch.nn.Module):
        def forward(self, q, k, v):
            t = q.shape[0]
            v = v.view(t, layer.num_kv_heads, -1)
            assert not v[..., layer.v_head_dim:].any(), "V padded with non-zeros"
            seen["v"] = v[..., :layer.v_head_dim].reshape(t, -1)
            out = mimo.sink_attention_f64(q.view(t, layer.num_heads, -1), k.view(t, layer.num_kv_heads, -1),
                                          v, sinks=sinks, window=window, scale=layer.scaling)
            return out.reshape(t, -1).to(q.dtype)

    real = layer.attn
    layer.__dict__["_modules"]["attn"] = ReferenceAttention()
    layer.attn.sliding_window, layer.attn.head_size_v = real.sliding_window, real.head_size_v
    hidden = torch.randn(TOKENS, mimo.HIDDEN, generator=torch.Generator().manual_seed(5))
    positions = torch.arange(TOKENS)
    try:
        with torch.no_grad():
            output = layer(positions, hidden)
    finally:
        layer.__dict__["_modules"]["attn"] = real
    return output, seen.get("v"), hidden, positions


def _reference(mimo, layer, weights, base, hidden, positions):
    """The layer's output from the checkpoint in float64: q/k/v projected, q and k rotated by the
    layer's rotary (upstream's, not under test), attention from the definition, o_proj."""
    import torch

    w = {name.rpartition(".")[0].rpartition(".")[2]: tensor.double() for name, tensor in weights.items()
         if name.endswith(".weight")}
    x = hidden.double()
    q, k, v = x @ w["q_proj"].T, x @ w["k_proj"].T, x @ w["v_proj"].T
    with torch.no_grad():
        q_rot, k_rot = layer.rotary_emb(positions, q.float().clone(), k.float().clone())
    t = x.shape[0]
    sinks = weights.get(base + ".attention_sink_bias")
    out = mimo.sink_attention_f64(q_rot.double().view(t, layer.num_heads, -1),
                                  k_rot.double().view(t, layer.num_kv_heads, -1),
                                  v.view(t, layer.num_kv_heads, layer.v_head_dim), sinks=sinks,
                                  window=layer.attn.sliding_window or None, scale=layer.scaling)
    return out.reshape(t, -1) @ w["o_proj"].T, v


def test_patch_applied(mimo):
    import npu_shim
    from npu_shim.testing.claims import claimed_family

    with mimo.ascend_registrations() as registry:
        cls = _linear_class()
        assert registry["QKVParallelLinear"] is cls
    row = next(r for r in npu_shim.status() if r["name"] == PATCH)
    assert row["state"] == "applied" and row["family"] == claimed_family(PATCH).name, row
    assert cls.__init__.__npu_shim_patch__ == PATCH


def test_registration_is_scoped(mimo):
    """Outside the block the process builds vLLM's own QKVParallelLinear (the other lane tests
    build so); inside, vllm-ascend's class."""
    inside = _build(mimo, "full")
    with mimo.ascend_backend():
        outside = mimo.build_layer("full")
    assert type(inside.qkv_proj) is _linear_class()
    assert type(outside.qkv_proj).__module__ == "vllm.model_executor.layers.linear"


def test_upstream_projection_is_too_wide_and_the_forward_raises(mimo):
    """Before (upstream's ``__init__``, vllm-ascend's registrations in effect): V sized with the K
    head dim, a 1,536-wide qkv against the model's split sizes [768, 384, 256]; the checkpoint loads
    (vLLM's loader writes V's 256 rows and leaves 128 uninitialised) and the model's forward raises
    at its split, mid-request (the engine's profile run on a worker)."""
    for kind in mimo.KINDS:
        layer = _build(mimo, kind, upstream=True)
        assert type(layer.qkv_proj) is _linear_class()
        assert layer.qkv_proj.output_sizes == [768, 384, 384]
        assert tuple(layer.qkv_proj.weight.shape) == (1536, mimo.HIDDEN)
        assert [layer.q_size, layer.k_size, layer.v_size] == [768, 384, 256]
        base, weights = _checkpoint(layer)
        _load(mimo, layer, weights)
        with pytest.raises(RuntimeError, match="split"):
            _forward(mimo, layer)


@pytest.mark.parametrize("kind", ["full", "swa"])
def test_checkpoint_loads_into_a_v_head_size_slice(mimo, kind):
    """After: built as the worker builds it, the projection is 768 + 384 + 256 = 1,408 wide, and the
    model's own ``load_weights`` puts the checkpoint's q/k/v tensors there exactly, in order, every
    row written (no uninitialised row left)."""
    import torch

    layer = _build(mimo, kind)
    assert type(layer.qkv_proj) is _linear_class()
    assert layer.qkv_proj.output_sizes == [layer.q_size, layer.k_size, layer.v_size] == [768, 384, 256]
    assert layer.qkv_proj.output_size == 1408
    with torch.no_grad():
        layer.qkv_proj.weight.fill_(float("nan"))
    base, weights = _checkpoint(layer)
    loaded = _load(mimo, layer, weights)
    assert base + ".qkv_proj.weight" in loaded and base + ".o_proj.weight" in loaded
    expected = torch.cat([weights["%s.%s_proj.weight" % (base, s)] for s in "qkv"])
    assert torch.equal(layer.qkv_proj.weight.data, expected)


@pytest.mark.parametrize("kind", ["full", "swa"])
def test_layer_forward_matches_the_float64_reference(mimo, kind):
    """After: the layer's own forward (``AscendQKVParallelLinear.forward`` through vllm-ascend's gemm
    op, the model's split, rotary, o_proj) on the loaded checkpoint: the V handed to the attention
    is the checkpoint's ``v_proj`` of the input, and the output is the float64 reference's, within
    float32 rounding."""
    layer = _build(mimo, kind)
    base, weights = _checkpoint(layer)
    _load(mimo, layer, weights)
    output, v, hidden, positions = _forward(mimo, layer)
    expected, v_expected = _reference(mimo, layer, weights, base, hidden, positions)
    assert v.shape == v_expected.shape == (TOKENS, mimo.KV_HEADS * mimo.V_HEAD_DIM)
    assert (v.double() - v_expected).abs().max().item() <= 1e-5 * v_expected.abs().max().item()
    assert output.shape == expected.shape == (TOKENS, mimo.HIDDEN)
    err = (output.double() - expected).abs().max().item()
    assert err <= 1e-5 * expected.abs().max().item(), err


def test_equal_head_dims_build_as_upstream(mimo):
    """A layer whose V head dim equals K's (128 / 128, every other model): the patched ``__init__``
    sizes it as upstream's does, and the forward on the same weights is bit for bit upstream's."""
    import torch

    patched = _build(mimo, "full", head_dim=128, v_head_dim=128)
    upstream = _build(mimo, "full", upstream=True, head_dim=128, v_head_dim=128)
    assert patched.qkv_proj.output_sizes == upstream.qkv_proj.output_sizes == [512, 256, 256]
    assert patched.qkv_proj.output_size == upstream.qkv_proj.output_size == 1024
    _, weights = _checkpoint(patched)
    _load(mimo, patched, weights)
    _load(mimo, upstream, dict(zip([n.replace(patched.attn.layer_name.split(".")[2],
                                              upstream.attn.layer_name.split(".")[2], 1) for n in weights],
                                   weights.values())))
    assert torch.equal(_forward(mimo, patched)[0], _forward(mimo, upstream)[0])
