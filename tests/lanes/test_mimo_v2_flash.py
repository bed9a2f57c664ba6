"""MiMo-V2-Flash (K head dim 192, V 128, a sliding-window layer with learnable sinks) with vLLM's own
``MiMoV2Attention`` on CPU: what upstream does per release, and what the shim does.

Patches: ``vllm.mimo_v2_pad_v`` / ``vllm.mimo_v2_flash_pad_v`` (vLLM 0.20 - 0.30: V padded to the
key head dim, the platform's backend; a layer with sinks refused at build unless
``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1``, since the FIA v2 call it would make is not on the op's page),
``vllm.mimo_v2_flash_sinks_refuse`` (vLLM 0.15 - 0.19, whose model pads V itself: a layer with sinks
refused at build with the same message, instead of the first forward's refused op call) and
``vllm.sinks_refuse`` (vllm-ascend 0.14.0rc1: a layer with sinks refused at build).
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
import importlib.metadata

import pytest
from packaging.version import Version

PAD = ("vllm.mimo_v2_pad_v", "vllm.mimo_v2_flash_pad_v")
REFUSED = (r"MiMoV2Attention layer 'model\.layers\.\d+\.self_attn\.attn' \(learnable sinks, K head dim 192, "
           r"V head dim 128\): not built with V padded to 192\..*npu_fused_infer_attention_score_v2.*"
           r"op-plugin revision 5e735e5.*GQA和PA场景不支持V_D等于192.*仅支持value的d小于等于128.*"
           r"vLLM's own model makes the same padded call in the releases where it pads V itself\. "
           r"NPU_SHIM_VLLM_MIMO_PAD_SINKS=1 builds it padded anyway")


def _vllm():
    return Version(importlib.metadata.version("vllm"))


def _ascend_or_skip():
    from npu_shim.testing import mimo

    try:
        return mimo.import_ascend_backend()
    except Exception as exc:  # the emulation of vllm_ascend.attention.attention_v1's imports
        pytest.skip("vllm_ascend.attention.attention_v1 does not import under the emulation: %s: %s"
                    % (type(exc).__name__, exc))


@pytest.fixture(scope="module")
def mimo():
    from npu_shim.testing import mimo

    mimo.setup()
    return mimo


@pytest.mark.claimed(*PAD)
@pytest.mark.patch(*PAD)
def test_pad_patch_applied(mimo):
    import npu_shim
    from npu_shim.testing.claims import claimed_family

    module = mimo.model_module()
    name = PAD[0] if module.__name__.endswith(".mimo_v2") else PAD[1]
    row = next(r for r in npu_shim.status() if r["name"] == name)
    assert row["state"] == "applied" and row["family"] == claimed_family(name).name, row
    cls = module.MiMoV2Attention
    assert cls.__init__.__npu_shim_patch__ == cls.forward.__npu_shim_patch__ == name


# ---------------------------------------------------------------------------------------------
# Before: upstream's __init__ on each release (the model hands the layer a DiffKV backend).

@pytest.mark.claimed(*PAD)
@pytest.mark.patch(*PAD)
def test_upstream_diffkv_path_fails_on_ascend(mimo):
    version = _vllm()
    init = mimo.upstream_init()
    if version < Version("0.24"):
        full = mimo.build_layer("full", init=init)
        assert full.attn.attn_backend.__name__ == "FlashAttentionDiffKVBackend"
        with pytest.raises(NameError, match="flash_attn_supports_sinks"):
            mimo.build_layer("swa", init=init)
        return
    for kind in mimo.KINDS:
        layer = mimo.build_layer(kind, init=init)
        backend = layer.attn.attn_backend
        assert backend.__name__ == "TritonAttentionDiffKVBackend"
        if version < Version("0.29"):
            # packed K|V in one last dim: no leading 2 for vllm-ascend's runner to split K and V by
            shape = backend.get_kv_cache_shape(8, 16, mimo.KV_HEADS, mimo.HEAD_DIM)
            assert shape[-1] == mimo.HEAD_DIM + mimo.V_HEAD_DIM and shape[0] != 2, shape
        else:
            with pytest.raises(AttributeError, match="get_kv_cache_shape"):
                backend.get_kv_cache_shape(8, 16, mimo.KV_HEADS, mimo.HEAD_DIM)
    # the DiffKV backends keep the value head dim on the class: upstream set it for every model
    assert backend.head_size_v == mimo.V_HEAD_DIM


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


@pytest.mark.claimed(*PAD)
@pytest.mark.patch(*PAD)
def test_sink_layer_refused_at_build_by_default(mimo):
    """The sliding-window layer (learnable sinks) is refused at build, naming the layer and the
    op page's rules; the full layer (no sinks) builds padded."""
    import torch

    _ascend_or_skip()
    with mimo.ascend_backend():
        full = mimo.build_layer("full")
        with pytest.raises(NotImplementedError, match=REFUSED):
            mimo.build_layer("swa")
        with pytest.raises(NotImplementedError, match=REFUSED):
            mimo.build_layer("swa", dtype=torch.bfloat16, sliding_window_size=16)
    assert full.attn.head_size == getattr(full.attn, "head_size_v", mimo.HEAD_DIM) == mimo.HEAD_DIM


@pytest.mark.claimed(*PAD)
@pytest.mark.patch(*PAD)
def test_patched_layers_build_on_the_ascend_backend(mimo):
    """NPU_SHIM_VLLM_MIMO_PAD_SINKS=1: both layers built padded on vllm-ascend's backend."""
    backend = _ascend_or_skip()
    asked = []
    with mimo.ascend_backend(asked), mimo.pad_sinks():
        layers = {kind: mimo.build_layer(kind) for kind in mimo.KINDS}
    assert [a["head_size"] for a in asked] == [mimo.HEAD_DIM, mimo.HEAD_DIM]
    for kind, layer in layers.items():
        assert layer.attn.attn_backend is backend
        assert getattr(layer.attn, "head_size_v", mimo.HEAD_DIM) == mimo.HEAD_DIM
        assert layer.v_head_dim == mimo.V_HEAD_DIM       # the model's projections keep V 128
        spec, key, value = _kv_cache(mimo, layer, backend)
        assert spec.head_size == mimo.HEAD_DIM and getattr(spec, "head_size_v", mimo.HEAD_DIM) == mimo.HEAD_DIM
        assert key.shape[-1] == value.shape[-1] == mimo.HEAD_DIM
        assert (type(spec).__name__ == "SlidingWindowSpec") == (kind == "swa")
    assert layers["swa"].attn.impl.sinks is layers["swa"].attention_sink_bias


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
    assert mimo.kv_cache_spec(mimo_layer).head_size == mimo.HEAD_DIM
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
        def forward(self, q, k, v):
            return v.repeat_interleave(2, dim=-1)[:, :q.shape[-1]] * q.sigmoid()

    forward = mimo.attention_class().forward
    hidden, positions = torch.randn(5, mimo.HIDDEN, generator=torch.Generator().manual_seed(1)), torch.arange(5)
    patched._modules["attn"] = Attention()
    with torch.no_grad():
        assert torch.equal(forward(patched, positions, hidden), forward.__wrapped_upstream__(patched, positions, hidden))


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
    layer.attn.sliding_window = real.sliding_window
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
def test_padded_layer_matches_the_reference(mimo, kind):
    """Prefill (6 tokens, past the window of 4) and one decode step: the patched forward (V padded to
    192, the output cut back to 128) equals attention with V 128 from the definition, sinks and
    window included, within float32 rounding. The sliding layer is built with
    NPU_SHIM_VLLM_MIMO_PAD_SINKS=1 (refused by default); no torch_npu op is called here."""
    import torch

    _ascend_or_skip()
    with mimo.ascend_backend(), mimo.pad_sinks():
        layer = mimo.build_layer(kind)
    got, expected = _run_layer(mimo, layer, 6, torch.Generator().manual_seed(3))
    assert got.shape == expected.shape == (7, mimo.HIDDEN)
    err = (got.double() - expected.double()).abs().max().item()
    assert err < 1e-4, err


@pytest.mark.claimed(*PAD)
@pytest.mark.patch(*PAD)
def test_ascend_impl_prefill_and_decode_match_the_reference(mimo):
    """vllm-ascend's own impl forward on the emulated ops, bfloat16 (what the hardware takes): the
    full layer, a prefill of 6 tokens then one decode step over the paged caches, V padded to 192
    and the output cut to 128 as the patched forward does, against attention with V 128 from the
    definition. Within bfloat16 rounding of the output."""
    import torch

    _ascend_or_skip()
    with mimo.ascend_backend():
        layer = mimo.build_layer("full", dtype=torch.bfloat16)
    got, expected = mimo.ascend_prefill_decode(layer)
    assert got.shape == expected.shape == (7, mimo.HEADS * mimo.V_HEAD_DIM)
    err = (got - expected).abs().max().item()
    assert err <= 2 ** -7 * expected.abs().max().item(), err


@pytest.mark.claimed(*PAD)
@pytest.mark.patch(*PAD)
def test_sink_layer_built_by_the_switch_is_refused_by_the_op(mimo):
    """NPU_SHIM_VLLM_MIMO_PAD_SINKS=1: the sliding layer (sinks, GQA, window 16) builds padded, and
    vllm-ascend's impl hands npu_fused_infer_attention_score_v2 V_D 192 on a paged cache with
    learnable_sink, which the op's page does not take: the emulation refuses it, as documented
    (what a CANN following that page would do)."""
    import torch

    _ascend_or_skip()
    with mimo.ascend_backend(), mimo.pad_sinks():
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
    with mimo.ascend_backend(), (mimo.pad_sinks() if how == "switch" else contextlib.nullcontext()):
        layer = mimo.build_layer("swa", init=init, dtype=torch.bfloat16, sliding_window_size=16)
    assert layer.attn.head_size == mimo.HEAD_DIM and layer.v_head_dim == mimo.V_HEAD_DIM
    assert layer.attn.impl.sinks is layer.attention_sink_bias is not None
    with pytest.raises((NotImplementedError, ValueError), match=FIRST_FORWARD[band_mask]):
        mimo.ascend_prefill_decode(layer)


@pytest.mark.claimed(SINKS)
@pytest.mark.patch(SINKS)
def test_padded_sink_layer_refused_at_build(mimo):
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
