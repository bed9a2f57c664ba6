"""MiMo-V2-Flash (K head dim 192, V 128, a sliding-window layer with learnable sinks) with vLLM's own
``MiMoV2Attention`` on CPU: what upstream does per release, and what the shim does.

Patches: ``vllm.mimo_v2_v_head_dim`` / ``vllm.mimo_v2_flash_v_head_dim`` (vLLM 0.20 - 0.30: no DiffKV
backend, the platform's backend with the layer's own V head dim) with
``vllm.ascend_attention_v_head_dim`` (vllm-ascend 0.20 - 0.30: such a layer served by vllm-ascend's own
FIA v2 call over separate K and V caches); ``NPU_SHIM_VLLM_MIMO_PAD_V=1``: V padded to the key head
dim instead, a layer with sinks then refused at build unless ``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1``
(the FIA v2 call it would make is not on the op's page); ``vllm.mimo_v2_flash_sinks_refuse`` (vLLM
0.15 - 0.19, whose model pads V itself: a layer with sinks refused at build with the same message,
instead of the first forward's refused op call) and ``vllm.sinks_refuse`` (vllm-ascend 0.14.0rc1: a
layer with sinks refused at build).
Layers from :mod:`npu_shim.testing.mimo` (tiny sizes).

What is exercised: the layer build (upstream's ``__init__`` and the patched one), the backend the
layer gets (vllm-ascend's ``AscendAttentionBackend`` through the platform's answer, stand-in named in
:mod:`npu_shim.testing.mimo`), the KV-cache spec the layer gives vLLM's KV-cache manager, the cache
shape vllm-ascend's model runner asks its backend for (``get_kv_cache_shape``) and a K and a V cache
allocated from them; the layer forward (prefill of a sequence, then a decode step) with the
attention computed by a float64 reference on what the layer hands ``self.attn`` (the padded V), so
the model-side edits are checked against attention with V 128 from the definition (sinks and the
window included); and vllm-ascend's own ``AscendAttentionBackendImpl.forward`` on the emulated
torch_npu ops, a prefill then a decode step over paged K/V caches, bfloat16, with the patch's pad
and cut around it (:func:`npu_shim.testing.mimo.ascend_prefill_decode`). Not exercised: vllm-ascend's
model runner itself (its metadata builder, its cache allocation, ACL graphs): the metadata and
caches are built here as the runner builds them for one sequence.
"""
import contextlib

import pytest

PAD = ("vllm.mimo_v2_v_head_dim", "vllm.mimo_v2_flash_v_head_dim")
IMPL_PATCH = "vllm.ascend_attention_v_head_dim"
NATIVE = PAD + (IMPL_PATCH,)
REFUSED = (r"MiMoV2Attention layer 'model\.layers\.\d+\.self_attn\.attn' \(learnable sinks, K head dim 192, "
           r"V head dim 128\): not built with V padded to 192\..*npu_fused_infer_attention_score_v2.*"
           r"op-plugin revision 5e735e5.*GQA和PA场景不支持V_D等于192.*仅支持value的d小于等于128.*"
           r"vLLM's own model makes the same padded call in the releases where it pads V itself\. "
           r"NPU_SHIM_VLLM_MIMO_PAD_SINKS=1 builds it padded anyway")


def _ascend_or_skip():
    from npu_shim.testing import mimo

    try:
        return mimo.import_ascend_backend()
    except Exception as exc:  # the emulation of vllm_ascend.attention.attention_v1's imports
        pytest.skip("vllm_ascend.attention.attention_v1 does not import under the emulation: %s: %s"
                    % (type(exc).__name__, exc))


def _ascend_impl():
    """vllm-ascend's ``AscendAttentionBackendImpl`` (its backend asked under the CPU config)."""
    from vllm.config import set_current_vllm_config

    from npu_shim.testing import mimo

    backend = _ascend_or_skip()
    with set_current_vllm_config(mimo.setup()):
        return backend.get_impl_cls()


@pytest.fixture(scope="module")
def mimo():
    from npu_shim.testing import mimo

    mimo.setup()
    return mimo


@pytest.mark.claimed(*NATIVE)
@pytest.mark.patch(*NATIVE)
def test_patches_applied(mimo):
    import npu_shim
    from npu_shim.testing.claims import claimed_family

    impl = _ascend_impl()                  # imports vllm-ascend's attention module (the patch's target)
    module = mimo.model_module()
    name = PAD[0] if module.__name__.endswith(".mimo_v2") else PAD[1]
    for patch in (name, IMPL_PATCH):
        row = next(r for r in npu_shim.status() if r["name"] == patch)
        assert row["state"] == "applied" and row["family"] == claimed_family(patch).name, row
    cls = module.MiMoV2Attention
    assert cls.__init__.__npu_shim_patch__ == cls.forward.__npu_shim_patch__ == name
    assert impl.forward_impl.__npu_shim_patch__ == impl.forward_fused_infer_attention.__npu_shim_patch__ \
        == IMPL_PATCH


# ---------------------------------------------------------------------------------------------
# Before: upstream's __init__ on each release (the model hands the layer a DiffKV backend).

# Upstream's DiffKV path by the releases whose code the tests below read (the release ranges are
# the markers': vLLM before 0.24 selects FlashAttention's DiffKV backend, whose sliding-window
# layer needs a name vLLM's module lacks; from 0.24 Triton's, packing K|V in one last dim until
# 0.29, which drops its get_kv_cache_shape)
FLASH_DIFFKV = pytest.mark.claimed(*PAD, pinned={"vllm": "<0.24"})
TRITON_PACKED = pytest.mark.claimed(PAD[0], pinned={"vllm": ">=0.24,<0.29"})
TRITON_NO_SHAPE = pytest.mark.claimed(PAD[0], pinned={"vllm": ">=0.29"})


@FLASH_DIFFKV
@pytest.mark.patch(*PAD)
def test_upstream_diffkv_path_fails_on_ascend_flash(mimo):
    init = mimo.upstream_init()
    full = mimo.build_layer("full", init=init)
    assert full.attn.attn_backend.__name__ == "FlashAttentionDiffKVBackend"
    with pytest.raises(NameError, match="flash_attn_supports_sinks"):
        mimo.build_layer("swa", init=init)


@TRITON_PACKED
@pytest.mark.patch(*PAD)
def test_upstream_diffkv_path_fails_on_ascend_triton_packed(mimo):
    for backend in _upstream_triton_backends(mimo):
        # packed K|V in one last dim: no leading 2 for vllm-ascend's runner to split K and V by
        shape = backend.get_kv_cache_shape(8, 16, mimo.KV_HEADS, mimo.HEAD_DIM)
        assert shape[-1] == mimo.HEAD_DIM + mimo.V_HEAD_DIM and shape[0] != 2, shape


@TRITON_NO_SHAPE
@pytest.mark.patch(*PAD)
def test_upstream_diffkv_path_fails_on_ascend_triton(mimo):
    for backend in _upstream_triton_backends(mimo):
        with pytest.raises(AttributeError, match="get_kv_cache_shape"):
            backend.get_kv_cache_shape(8, 16, mimo.KV_HEADS, mimo.HEAD_DIM)


def _upstream_triton_backends(mimo):
    """The backend of each kind of layer upstream's __init__ builds (Triton's DiffKV backend)."""
    init = mimo.upstream_init()
    backends = []
    for kind in mimo.KINDS:
        layer = mimo.build_layer(kind, init=init)
        backend = layer.attn.attn_backend
        assert backend.__name__ == "TritonAttentionDiffKVBackend"
        # the DiffKV backends keep the value head dim on the class: upstream set it for every model
        assert backend.head_size_v == mimo.V_HEAD_DIM
        backends.append(backend)
    return backends


# ---------------------------------------------------------------------------------------------
# After: the patched layer on vllm-ascend's backend.

def _kv_cache(mimo, layer, backend, num_blocks=4):
    """The layer's spec, the shape vllm-ascend's runner asks its backend for, and K/V caches."""
    import torch

    spec = mimo.kv_cache_spec(layer)
    shape = backend.get_kv_cache_shape(num_blocks, spec.block_size, spec.num_kv_heads, spec.head_size)
    assert shape[0] == 2, shape                         # vllm-ascend: K and V, split on dim 0
    head_size_v = getattr(spec, "head_size_v", spec.head_size)
    key = torch.zeros(shape[1:], dtype=spec.dtype)
    value = torch.zeros((*shape[1:-1], head_size_v), dtype=spec.dtype)
    assert spec.page_size_bytes == spec.block_size * spec.num_kv_heads * (spec.head_size + head_size_v) \
        * key.element_size()
    return spec, key, value


@contextlib.contextmanager
def _upstream_impl(mimo):
    """Inside the block, vllm-ascend's impl runs upstream's forward_impl and
    forward_fused_infer_attention (the patched ones restored after)."""
    impl = _ascend_impl()
    patched = {name: vars(impl)[name] for name in ("forward_impl", "forward_fused_infer_attention")}
    for name, function in patched.items():
        setattr(impl, name, function.__wrapped_upstream__)
    try:
        yield impl
    finally:
        for name, function in patched.items():
            setattr(impl, name, function)


@pytest.mark.claimed(*NATIVE)
@pytest.mark.patch(*NATIVE)
def test_native_layers_build_on_the_ascend_backend(mimo):
    """Both layers (the sliding one with its sinks) built on vllm-ascend's backend with the model's
    own V head dim 128; the KV-cache spec carries it, and the runner's K and V caches are 192 and
    128 wide: (192 + 128) per token and KV head, not (192 + 192)."""
    backend = _ascend_or_skip()
    asked = []
    with mimo.ascend_backend(asked):
        layers = {kind: mimo.build_layer(kind) for kind in mimo.KINDS}
    assert [a["head_size"] for a in asked] == [mimo.HEAD_DIM, mimo.HEAD_DIM]
    for kind, layer in layers.items():
        assert layer.attn.attn_backend is backend
        assert layer.attn.head_size == mimo.HEAD_DIM and layer.attn.head_size_v == mimo.V_HEAD_DIM
        spec, key, value = _kv_cache(mimo, layer, backend)
        assert (spec.head_size, spec.head_size_v) == (mimo.HEAD_DIM, mimo.V_HEAD_DIM)
        assert (key.shape[-1], value.shape[-1]) == (mimo.HEAD_DIM, mimo.V_HEAD_DIM)
        assert (type(spec).__name__ == "SlidingWindowSpec") == (kind == "swa")
    assert layers["swa"].attn.impl.sinks is layers["swa"].attention_sink_bias
    assert layers["full"].attn.impl.sinks is None


# the window edge: a sequence whose decode query (position 19) has its window (W 4) at 16-19 and
# the key the op's band reading adds (15) in a block vLLM's KV manager has freed (the null block)
EDGE = dict(tokens=19, block_size=16, num_blocks=3, null_block=True)


@contextlib.contextmanager
def _window_edge_switch():
    """NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE=1 in this process's settings inside the block."""
    import os

    from npu_shim import _config

    previous = _config.use_settings(_config.Settings(dict(os.environ, NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE="1")))
    try:
        yield
    finally:
        _config.use_settings(previous)


@pytest.mark.claimed(*NATIVE)
@pytest.mark.patch(*NATIVE)
@pytest.mark.parametrize("kind,dtype", [("full", "bfloat16"), ("full", "float16"), ("swa", "bfloat16")])
def test_native_layer_matches_the_reference(mimo, kind, dtype):
    """vllm-ascend's own impl forward on the emulated ops, in the dtypes the hardware takes: a
    prefill of 6 tokens, then one decode step over the paged K (192) and V (128) caches, against
    attention with V 128 from the definition in float64, sinks included; within the output
    dtype's rounding (2**-7 of max |ref| for bfloat16, 2**-10 for float16). The sliding layer's
    window (16) is past the sequence: see test_native_window_edge_is_the_models for the edge; its
    sinks are bfloat16 only (test_native_float16_sink_layer_is_refused_by_the_op)."""
    import torch

    _ascend_or_skip()
    dtype = getattr(torch, dtype)
    with mimo.ascend_backend():
        layer = mimo.build_layer(kind, dtype=dtype, **({"sliding_window_size": 16} if kind == "swa" else {}))
    got, expected = mimo.ascend_prefill_decode(layer)
    assert got.shape == expected.shape == (7, mimo.HEADS * mimo.V_HEAD_DIM)
    err = (got - expected).abs().max().item()
    assert err <= (2 ** -7 if dtype is torch.bfloat16 else 2 ** -10) * expected.abs().max().item(), err


@pytest.mark.claimed(*NATIVE)
@pytest.mark.patch(*NATIVE)
def test_native_float16_sink_layer_is_refused_by_the_op(mimo):
    """A float16 model's sliding layer hands FIA v2 its float16 sinks (vllm-ascend passes the
    parameter as it is); the op page lists learnable_sink as bfloat16 only, and the emulation
    refuses it as the page does, naming the rule."""
    import torch

    _ascend_or_skip()
    with mimo.ascend_backend():
        layer = mimo.build_layer("swa", dtype=torch.float16, sliding_window_size=16)
    assert layer.attn.impl.sinks.dtype is torch.float16
    with pytest.raises(ValueError, match=r"npu_fused_infer_attention_score_v2: learnable_sink must be bfloat16 "
                                         r"\(the op page, op-plugin 5e735e5: .数据类型支持`bfloat16`.\), got "
                                         r"torch\.float16"):
        mimo.ascend_prefill_decode(layer)


@pytest.mark.claimed(*NATIVE)
@pytest.mark.patch(*NATIVE)
def test_native_window_edge_is_the_models(mimo):
    """At the window's edge the sliding layer (V 128, sinks, W 4) attends to the model's W keys: 19
    prefill tokens and a decode step at position 19, 16-token blocks, block 0 the null block (large
    random K/V) that vLLM's KV manager leaves in the block table for the first block once it lies
    wholly before the window. The patch passes pre_tokens = W - 1 (the op's band admits
    pre_tokens + 1 keys); upstream's W would read key 15, the null block's last row, and key
    i - W of every prefill query. Equal to the float64 reference with W (HF's definition) within
    bfloat16 rounding."""
    import torch

    _ascend_or_skip()
    with mimo.ascend_backend():
        layer = mimo.build_layer("swa", dtype=torch.bfloat16)
    assert layer.attn.sliding_window == mimo.WINDOW
    got, expected = mimo.ascend_prefill_decode(layer, **EDGE)
    assert got.shape == expected.shape == (20, mimo.HEADS * mimo.V_HEAD_DIM)
    err = (got - expected).abs().max().item()
    assert err <= 2 ** -7 * expected.abs().max().item(), err


@pytest.mark.claimed(*NATIVE)
@pytest.mark.patch(*NATIVE)
def test_equal_head_dims_sliding_layer_is_upstreams_unless_switched(mimo):
    """A standard sliding layer (K = V = 128, sinks, W 4) at the window edge of
    test_native_window_edge_is_the_models: by default the patched impl gives what upstream's gives,
    bit for bit (pre_tokens = W: W + 1 keys under the op's band, the null block's row included, so
    it misses the reference with W); with NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE=1 it passes W - 1 and
    equals the float64 reference with W within bfloat16 rounding."""
    import torch

    _ascend_or_skip()
    with mimo.ascend_backend():
        layer = mimo.build_layer("swa", dtype=torch.bfloat16, head_dim=128, v_head_dim=128)
    patched, expected = mimo.ascend_prefill_decode(layer, **EDGE)
    with _upstream_impl(mimo):
        upstream, _ = mimo.ascend_prefill_decode(layer, **EDGE)
    assert torch.equal(patched, upstream)
    tolerance = 2 ** -7 * expected.abs().max().item()
    assert (upstream - expected).abs().max().item() > 10 * tolerance
    with _window_edge_switch():
        switched, _ = mimo.ascend_prefill_decode(layer, **EDGE)
    err = (switched - expected).abs().max().item()
    assert err <= tolerance, err


@pytest.mark.claimed(*NATIVE)
@pytest.mark.patch(*NATIVE)
def test_upstream_impl_fails_a_native_layer_and_the_model_refuses_it(mimo):
    """Before (upstream's impl methods): a layer with V 128 fails at its first forward (the full
    layer's FIA v1 output viewed with head_size 192, or the op refusing the call); after the
    patch it serves (above). With the impl unpatched, the model side refuses the layer at build,
    naming the way out, instead of failing mid-request."""
    import torch

    with mimo.ascend_backend():
        layer = mimo.build_layer("full", dtype=torch.bfloat16)
    with _upstream_impl(mimo):
        with pytest.raises((RuntimeError, NotImplementedError, ValueError)):
            mimo.ascend_prefill_decode(layer)
        with mimo.ascend_backend(), pytest.raises(NotImplementedError, match=(
                r"MiMoV2Attention layer '.*' \(K head dim 192, V head dim 128\): not built on "
                r"vllm_ascend\.attention\.attention_v1\.AscendAttentionBackendImpl.*"
                r"vllm\.ascend_attention_v_head_dim is not patched.*NPU_SHIM_VLLM_MIMO_PAD_V=1")):
            mimo.build_layer("full")


@pytest.mark.claimed(*NATIVE)
@pytest.mark.patch(*NATIVE)
def test_equal_head_dims_take_upstreams_impl_calls(mimo):
    """A standard layer (K = V = 128) through vllm-ascend's impl: the patched methods give what
    upstream's give, bit for bit (prefill and the paged-attention decode)."""
    import torch

    with mimo.ascend_backend():
        layer = mimo.build_layer("full", dtype=torch.bfloat16, head_dim=128, v_head_dim=128)
    patched, _ = mimo.ascend_prefill_decode(layer)
    with _upstream_impl(mimo):
        upstream, _ = mimo.ascend_prefill_decode(layer)
    assert torch.equal(patched, upstream)


@pytest.mark.claimed(*PAD)
@pytest.mark.patch(*PAD)
def test_no_class_global_value_head_dim(mimo):
    """A MiMo layer and a standard layer (V = K = 128) in one process each keep their own value head
    dim, and the patched layer sets nothing on a DiffKV backend class."""
    backend = _ascend_or_skip()
    layer_module = mimo.model_module()
    diffkv = []
    for name in ("FlashAttentionDiffKVBackend",):
        if hasattr(layer_module, name):
            diffkv.append(getattr(layer_module, name))
    before = [getattr(c, "head_size_v", None) for c in diffkv]
    with mimo.ascend_backend():
        mimo_layer = mimo.build_layer("full")
        standard = mimo.build_layer("full", head_dim=128, v_head_dim=128)
    assert [getattr(c, "head_size_v", None) for c in diffkv] == before
    spec = mimo.kv_cache_spec(mimo_layer)
    assert (spec.head_size, spec.head_size_v) == (mimo.HEAD_DIM, mimo.V_HEAD_DIM)
    spec = mimo.kv_cache_spec(standard)
    assert spec.head_size == 128 and getattr(spec, "head_size_v", 128) == 128
    assert standard.attn.attn_backend is backend


@pytest.mark.claimed(*PAD)
@pytest.mark.patch(*PAD)
def test_equal_head_dims_take_upstreams_path(mimo):
    """A layer whose V head dim equals its K head dim (a standard layer: 128 / 128) gets what
    upstream gives it: the platform's backend, head_size_v = head_size, and a forward equal to
    upstream's forward bit for bit (nothing padded, nothing cut)."""
    import torch

    _ascend_or_skip()
    with mimo.ascend_backend():
        patched = mimo.build_layer("swa", head_dim=128, v_head_dim=128)
        upstream = mimo.build_layer("swa", init=mimo.upstream_init(), head_dim=128, v_head_dim=128)
    for layer in (patched, upstream):
        assert getattr(layer.attn, "head_size_v", 128) == layer.attn.head_size == 128
    assert type(patched.attn.attn_backend) is type(upstream.attn.attn_backend)

    class Attention(torch.nn.Module):            # the same deterministic stand-in on both sides
        head_size_v = 128

        def forward(self, q, k, v):
            return v.repeat_interleave(2, dim=-1)[:, :q.shape[-1]] * q.sigmoid()

    forward = mimo.attention_class().forward
    hidden, positions = torch.randn(5, mimo.HIDDEN, generator=torch.Generator().manual_seed(1)), torch.arange(5)
    patched._modules["attn"] = Attention()
    with torch.no_grad():
        assert torch.equal(forward(patched, positions, hidden), forward.__wrapped_upstream__(patched, positions, hidden))


# ---------------------------------------------------------------------------------------------
# NPU_SHIM_VLLM_MIMO_PAD_V=1: V padded to the key head dim.

@pytest.mark.claimed(*PAD)
@pytest.mark.patch(*PAD)
def test_padded_sink_layer_refused_at_build(mimo):
    """Padded, the sliding-window layer (learnable sinks) is refused at build, naming the layer
    and the op page's rules; the full layer (no sinks) builds padded."""
    import torch

    _ascend_or_skip()
    with mimo.ascend_backend(), mimo.padded():
        full = mimo.build_layer("full")
        with pytest.raises(NotImplementedError, match=REFUSED):
            mimo.build_layer("swa")
        with pytest.raises(NotImplementedError, match=REFUSED):
            mimo.build_layer("swa", dtype=torch.bfloat16, sliding_window_size=16)
    assert full.attn.head_size == full.attn.head_size_v == mimo.HEAD_DIM


@pytest.mark.claimed(*PAD)
@pytest.mark.patch(*PAD)
def test_padded_layers_build_on_the_ascend_backend(mimo):
    """NPU_SHIM_VLLM_MIMO_PAD_V=1 and NPU_SHIM_VLLM_MIMO_PAD_SINKS=1: both layers built padded on
    vllm-ascend's backend, 192-wide V caches."""
    backend = _ascend_or_skip()
    with mimo.ascend_backend(), mimo.padded(sinks=True):
        layers = {kind: mimo.build_layer(kind) for kind in mimo.KINDS}
    for kind, layer in layers.items():
        assert layer.attn.attn_backend is backend
        assert layer.attn.head_size_v == mimo.HEAD_DIM
        assert layer.v_head_dim == mimo.V_HEAD_DIM       # the model's projections keep V 128
        spec, key, value = _kv_cache(mimo, layer, backend)
        assert spec.head_size == spec.head_size_v == mimo.HEAD_DIM
        assert key.shape[-1] == value.shape[-1] == mimo.HEAD_DIM
    assert layers["swa"].attn.impl.sinks is layers["swa"].attention_sink_bias


def _run_layer(mimo, layer, tokens, generator):
    """The layer's forward on a prefill of ``tokens`` and a decode step after it, ``self.attn``
    standing in as float64 attention over the cached K and V it is handed (what the backend does
    with its cache); returns outputs and what the reference says they must be."""
    import torch

    cache = {"k": [], "v": [], "q": []}
    window = layer.attn.sliding_window or None
    sinks = getattr(layer, "attention_sink_bias", None)

    class CachedAttention(torch.nn.Module):
        def forward(self, q, k, v):
            n = q.shape[0]
            cache["q"].append(q), cache["k"].append(k), cache["v"].append(v)
            keys, values = torch.cat(cache["k"]), torch.cat(cache["v"])
            head_v = values.shape[-1] // layer.num_kv_heads
            t = keys.shape[0]
            queries = torch.cat([torch.zeros(t - n, q.shape[1], dtype=q.dtype), q])
            out = mimo.sink_attention_f64(queries.view(t, layer.num_heads, -1),
                                          keys.view(t, layer.num_kv_heads, -1),
                                          values.view(t, layer.num_kv_heads, head_v),
                                          sinks=sinks, window=window, scale=layer.scaling)
            return out[t - n:].reshape(n, -1).to(q.dtype)

    real = layer.attn
    layer.__dict__["_modules"]["attn"] = CachedAttention()
    layer.attn.sliding_window, layer.attn.head_size_v = real.sliding_window, real.head_size_v
    try:
        hidden = torch.randn(tokens + 1, mimo.HIDDEN, generator=generator)
        positions = torch.arange(tokens + 1)
        with torch.no_grad():
            prefill = layer(positions[:tokens], hidden[:tokens])
            decode = layer(positions[tokens:], hidden[tokens:])
            qkv, _ = layer.qkv_proj(hidden)
            q, k, v = qkv.split([layer.q_size, layer.k_size, layer.v_size], dim=-1)
            q, k = layer.rotary_emb(positions, q, k)
            expected = mimo.reference_layer_attention(layer_like(layer, real), q, k, v)
            expected, _ = layer.o_proj(expected.to(hidden.dtype))
    finally:
        layer.__dict__["_modules"]["attn"] = real
    return torch.cat([prefill, decode]), expected


def layer_like(layer, attn):
    import types

    return types.SimpleNamespace(num_heads=layer.num_heads, num_kv_heads=layer.num_kv_heads,
                                 head_dim=layer.head_dim, v_head_dim=layer.v_head_dim,
                                 scaling=layer.scaling, attn=attn,
                                 attention_sink_bias=getattr(layer, "attention_sink_bias", None))


@pytest.mark.claimed(*PAD)
@pytest.mark.patch(*PAD)
@pytest.mark.parametrize("kind", ["full", "swa"])
@pytest.mark.parametrize("pad", [False, True], ids=["native", "padded"])
def test_layer_forward_matches_the_reference(mimo, kind, pad):
    """Prefill (6 tokens, past the window of 4) and one decode step: the patched forward (native:
    V 128 handed to the attention as it is; padded: V padded to 192, the output cut back to 128)
    equals attention with V 128 from the definition, sinks and window included, within float32
    rounding. Padded, the sliding layer is built with NPU_SHIM_VLLM_MIMO_PAD_SINKS=1 (refused by
    default); no torch_npu op is called here."""
    import torch

    _ascend_or_skip()
    with mimo.ascend_backend(), (mimo.padded(sinks=True) if pad else contextlib.nullcontext()):
        layer = mimo.build_layer(kind)
    got, expected = _run_layer(mimo, layer, 6, torch.Generator().manual_seed(3))
    assert got.shape == expected.shape == (7, mimo.HIDDEN)
    err = (got.double() - expected.double()).abs().max().item()
    assert err < 1e-4, err


@pytest.mark.claimed(*PAD)
@pytest.mark.patch(*PAD)
def test_padded_impl_prefill_and_decode_match_the_reference(mimo):
    """Padded: vllm-ascend's own impl forward on the emulated ops, bfloat16: the full layer, a
    prefill of 6 tokens then one decode step over the paged caches, V padded to 192 and the output
    cut to 128 as the patched forward does, against attention with V 128 from the definition.
    Within bfloat16 rounding of the output."""
    import torch

    _ascend_or_skip()
    with mimo.ascend_backend(), mimo.padded():
        layer = mimo.build_layer("full", dtype=torch.bfloat16)
    got, expected = mimo.ascend_prefill_decode(layer)
    assert got.shape == expected.shape == (7, mimo.HEADS * mimo.V_HEAD_DIM)
    err = (got - expected).abs().max().item()
    assert err <= 2 ** -7 * expected.abs().max().item(), err


@pytest.mark.claimed(*PAD)
@pytest.mark.patch(*PAD)
def test_sink_layer_built_by_the_switch_is_refused_by_the_op(mimo):
    """NPU_SHIM_VLLM_MIMO_PAD_V=1, NPU_SHIM_VLLM_MIMO_PAD_SINKS=1: the sliding layer (sinks, GQA,
    window 16) builds padded, and
    vllm-ascend's impl hands npu_fused_infer_attention_score_v2 V_D 192 on a paged cache with
    learnable_sink, which the op's page does not take: the emulation refuses it, as documented
    (what a CANN following that page would do)."""
    import torch

    _ascend_or_skip()
    with mimo.ascend_backend(), mimo.padded(sinks=True):
        layer = mimo.build_layer("swa", dtype=torch.bfloat16, sliding_window_size=16)
    assert layer.attn.impl.sinks is layer.attention_sink_bias
    with pytest.raises(NotImplementedError, match="npu_fused_infer_attention_score_v2.*(GQA和PA场景不支持V_D等于192"
                                                  "|仅支持value的d小于等于128)"):
        mimo.ascend_prefill_decode(layer)


# ---------------------------------------------------------------------------------------------
# vLLM 0.14.1 / vllm-ascend 0.14.0rc1: the model pads V itself; vllm-ascend drops the sinks.

@pytest.mark.claimed("vllm.sinks_refuse")
@pytest.mark.patch("vllm.sinks_refuse")
def test_ascend_014_refuses_a_layer_with_sinks(mimo):
    from vllm.config import set_current_vllm_config

    backend = _ascend_or_skip()
    with set_current_vllm_config(mimo.setup()):
        impl = backend.get_impl_cls()
    with mimo.ascend_backend():
        full = mimo.build_layer("full")        # no sinks: upstream's __init__, untouched
        assert type(full.attn.impl) is impl
        with pytest.raises(NotImplementedError, match="learnable sinks.*dropped"):
            mimo.build_layer("swa")
    # before: upstream's __init__ takes the sinks into **kwargs and keeps nothing of them
    patched = impl.__init__
    impl.__init__ = patched.__wrapped_upstream__
    try:
        with mimo.ascend_backend():
            swa = mimo.build_layer("swa")
    finally:
        impl.__init__ = patched
    assert swa.attention_sink_bias is not None
    assert not any(value is swa.attention_sink_bias for value in vars(swa.attn.impl).values())


# ---------------------------------------------------------------------------------------------
# vLLM 0.15 - 0.19 / vllm-ascend 0.15.0rc1 - 0.19.1rc1: the model pads V itself and passes the
# sinks; vllm-ascend serves a layer with sinks with FIA v2 (V_D 192, GQA, paged, learnable_sink).

SINKS = "vllm.mimo_v2_flash_sinks_refuse"
# what the emulated FIA v2 says of the padded sink layer's first call: vllm-ascend 0.15.0rc1 - 0.18.0
# pass their band mask (swa_mask) with sparse_mode 4, refused first; 0.19.1rc1 the compressed mask,
# then the page's V_D rule
FIRST_FORWARD = {True: r"npu_fused_infer_attention_score_v2: sparse_mode=4: atten_mask must be the compressed",
                 False: r"npu_fused_infer_attention_score_v2.*GQA和PA场景不支持V_D等于192"}


def _passes_band_mask():
    """Whether this vllm-ascend's metadata carries the sliding layers' band mask (``swa_mask``)."""
    import dataclasses
    import sys

    from npu_shim.testing import mimo

    _ascend_or_skip()
    metadata = sys.modules[mimo.ASCEND_BACKEND[0]].AscendMetadata
    return "swa_mask" in {f.name for f in dataclasses.fields(metadata)}


@pytest.mark.claimed(SINKS)
@pytest.mark.patch(SINKS)
def test_sinks_refuse_patch_applied(mimo):
    import npu_shim
    from npu_shim.testing.claims import claimed_family

    cls = mimo.attention_class()                                # imports the model module
    row = next(r for r in npu_shim.status() if r["name"] == SINKS)
    assert row["state"] == "applied" and row["family"] == claimed_family(SINKS).name, row
    assert cls.__init__.__npu_shim_patch__ == SINKS
    assert not hasattr(cls.forward, "__npu_shim_patch__")       # upstream's forward pads V itself


@pytest.mark.claimed(SINKS)
@pytest.mark.patch(SINKS)
@pytest.mark.parametrize("how", ["upstream", "switch"])
def test_padded_sink_layer_builds_then_its_first_forward_raises(mimo, how):
    """Before (upstream's ``__init__``), and after with NPU_SHIM_VLLM_MIMO_PAD_SINKS=1: the sliding
    layer (sinks, GQA, window 16) builds with V padded to 192 on vllm-ascend's backend, and the first
    forward, mid-request, hands npu_fused_infer_attention_score_v2 a call its page does not take."""
    import contextlib

    import torch

    band_mask = _passes_band_mask()
    init = mimo.upstream_init() if how == "upstream" else None
    with mimo.ascend_backend(), (mimo.padded(sinks=True) if how == "switch" else contextlib.nullcontext()):
        layer = mimo.build_layer("swa", init=init, dtype=torch.bfloat16, sliding_window_size=16)
    assert layer.attn.head_size == mimo.HEAD_DIM and layer.v_head_dim == mimo.V_HEAD_DIM
    assert layer.attn.impl.sinks is layer.attention_sink_bias is not None
    with pytest.raises((NotImplementedError, ValueError), match=FIRST_FORWARD[band_mask]):
        mimo.ascend_prefill_decode(layer)


@pytest.mark.claimed(SINKS)
@pytest.mark.patch(SINKS)
def test_pre_020_sink_layer_refused_at_build(mimo):
    """After: the sliding layer is refused while it is built, before vLLM registers its attention
    layer, naming the layer and the op page's rules; a layer with sinks whose V is not padded
    (V = K = 128) and the full layer (no sinks) build as upstream builds them."""
    import torch

    _ascend_or_skip()
    registered = mimo.setup().compilation_config.static_forward_context
    with mimo.ascend_backend():
        for overrides in ({}, dict(dtype=torch.bfloat16, sliding_window_size=16)):
            before = set(registered)
            with pytest.raises(NotImplementedError, match=REFUSED):
                mimo.build_layer("swa", **overrides)
            assert set(registered) == before
        full = mimo.build_layer("full")
        unpadded = mimo.build_layer("swa", head_dim=128, v_head_dim=128)
    assert full.attn.impl.sinks is None and full.attn.head_size == mimo.HEAD_DIM
    assert unpadded.attn.impl.sinks is unpadded.attention_sink_bias is not None


@pytest.mark.claimed(SINKS)
@pytest.mark.patch(SINKS)
def test_full_layer_serves_on_the_ascend_impl(mimo):
    """The full layer (no sinks), built by the patched ``__init__``, through vllm-ascend's own impl on
    the emulated ops (FIA v1 TND, K = V = 192, GQA, paged decode), bfloat16: a prefill of 6 tokens
    and one decode step, V padded and the output cut as upstream's forward does, against attention
    with V 128 from the definition. Within bfloat16 rounding of the output."""
    import torch

    _ascend_or_skip()
    with mimo.ascend_backend():
        layer = mimo.build_layer("full", dtype=torch.bfloat16)
    got, expected = mimo.ascend_prefill_decode(layer)
    assert got.shape == expected.shape == (7, mimo.HEADS * mimo.V_HEAD_DIM)
    err = (got - expected).abs().max().item()
    assert err <= 2 ** -7 * expected.abs().max().item(), err


@pytest.mark.claimed(SINKS, pinned={"vllm": ">=0.18"})
@pytest.mark.patch(SINKS)
def test_pre_020_value_head_dim_has_no_sliding_cache(mimo):
    """Why vLLM 0.18 / 0.19 with vllm-ascend 0.18.0 / 0.19.1rc1 (the releases whose runner reads
    ``head_size_v``; 0.15 - 0.17's does not) are not served natively (K 192 / V 128), shown with
    their own classes:
    vLLM's ``Attention`` built as a native build would build the two layers (``head_size_v`` 128;
    the sliding one with a window and sinks) gives the full layer a spec with ``head_size_v`` 128
    but the sliding layer a ``SlidingWindowSpec`` without one (vLLM adds it in 0.20), so
    vllm-ascend's runner allocates that layer's V cache 192 wide (it reads ``head_size_v`` only
    where the spec has it), and the two page sizes do not divide (vLLM's
    ``unify_kv_cache_spec_page_size`` raises NotImplementedError for such a hybrid model). Handed
    that 192-wide V cache, vllm-ascend's impl fails the sliding layer's first cache write,
    mid-request."""
    import torch
    from vllm.config import set_current_vllm_config

    _ascend_or_skip()
    attention = mimo.model_module().Attention
    with mimo.ascend_backend():
        layers = {kind: mimo.build_layer("full", dtype=torch.bfloat16, sliding_window_size=window)
                  for kind, window in (("full", -1), ("swa", 16))}
        with set_current_vllm_config(mimo.setup()):
            for kind, layer in layers.items():
                sinks = layer.attention_sink_bias = torch.nn.Parameter(
                    torch.randn(mimo.HEADS, dtype=torch.bfloat16) * 0.3, requires_grad=False) if kind == "swa" \
                    else None
                layer.attn = attention(mimo.HEADS, mimo.HEAD_DIM, layer.scaling, num_kv_heads=mimo.KV_HEADS,
                                       head_size_v=mimo.V_HEAD_DIM, per_layer_sliding_window=layer.attn.sliding_window,
                                       prefix=layer.attn.layer_name + ".native", sinks=sinks).to(torch.bfloat16)
    specs = {kind: mimo.kv_cache_spec(layer) for kind, layer in layers.items()}
    assert type(specs["swa"]).__name__ == "SlidingWindowSpec" and not hasattr(specs["swa"], "head_size_v")
    assert specs["full"].head_size_v == mimo.V_HEAD_DIM
    sizes = sorted(spec.page_size_bytes for spec in specs.values())
    assert sizes[1] % sizes[0] != 0, sizes
    with pytest.raises(ValueError, match=r"_npu_reshape_and_cache: cache heads/dims .* do not match key/value"):
        mimo.ascend_prefill_decode(layers["swa"], value_cache_width=specs["swa"].head_size)
