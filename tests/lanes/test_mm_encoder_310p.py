"""Patch ``vllm.mm_encoder_attn_310p`` on the real vllm-ascend wheels, emulated SoC Ascend310P3.

What runs is upstream code at the pinned versions: vLLM's ``MMEncoderAttention``
and vllm-ascend's ``AscendMMEncoderAttention310``
(``vllm_ascend._310p.ops.mm_encoder_attention``). torch_npu is npu-shim's
emulation of the documented ops, reporting an Ascend310P3
(``NPU_SHIM_EMULATE_SOC``), so its ``_npu_flash_attention_unpad`` enforces the
310P constraints (head sizes multiples of 16, value head size = key head size).

Layers are built the way vLLM builds them on a 310P: the Ascend class is
registered as the out-of-tree ``"MMEncoderAttention"`` with
``CustomOp.register_oot`` -- a named stand-in for vllm-ascend's
``register_ascend_customop``, which imports every compiled Ascend op -- and
vLLM's own ``MMEncoderAttention(...)`` constructor hands back the Ascend class.

Two classes side by side in one process: ``stack.patched`` (the module after the
shim's import hook patched it) and ``stack.upstream`` (the same file executed a
second time under another name, which the shim does not watch). Every numerical
claim is checked against ``npu_shim.testing.attention_f64``. On this CPU-only
machine ``cu_seqlens`` tensors are marked as device stand-ins for
``count_host_syncs``: copying one to the host counts exactly where an NPU
tensor would be copied.
"""
import contextlib
import importlib.util
import inspect
import json
import os
import textwrap
import types

import pytest

import npu_shim
from npu_shim.testing.errors import Tolerance

pytestmark = [pytest.mark.claimed("vllm.mm_encoder_attn_310p"),
              pytest.mark.patch("vllm.mm_encoder_attn_310p"),
              pytest.mark.float32_math]  # the layer-level math checks: float32 vs float64 (see conftest)

TARGET = "vllm_ascend._310p.ops.mm_encoder_attention"
CLASS_NAME = "AscendMMEncoderAttention310"
PATCH_NAME = "vllm.mm_encoder_attn_310p"
# the families of vLLM 0.18+, whose 310P class subclasses vLLM's MMEncoderAttention (0.14.0rc1's
# subclasses Ascend's and does not pad 72)
VLLM_SUBCLASS = ("npu_shim.patches.vllm_ascend.mm_encoder.v018_310p", "npu_shim.patches.vllm_ascend.mm_encoder.v023_310p")
UPSTREAM_COPY = "npu_shim_tests_upstream_mm_encoder_attention_310p"
SOC = "Ascend310P3"
LAYERS = 27
# max |layer - float64| (absolute; inputs N(0, 1)): float32 measured worst 9.0e-7 (vllm-0.18)
TOL = Tolerance("layer 310P float32 vs float64", 8e-6)
# the 310P tower's dtype: float16 measured worst 9.6e-4 (vllm-0.18)
HW_TOL = Tolerance("layer 310P float16 vs float64", 3e-3, "float16")


def family_module(name):
    """The module of the family ``name`` of the patch under test (its replacements name it)."""
    from npu_shim.patches.vllm_ascend.mm_encoder_attn_310p import PATCH

    return next(f.implementation for f in PATCH.families if f.name == name)


def expected_family():
    """The family the declaration claims for the installed release (its fences)."""
    from npu_shim.testing.claims import claimed_family

    return claimed_family(PATCH_NAME).name


@pytest.fixture(autouse=True)
def soc_310p(monkeypatch):
    monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", SOC)


@pytest.fixture(scope="module")
def stack():
    import npu_shim
    from npu_shim import emulation

    os.environ.setdefault("VLLM_PLUGINS", "")   # the lanes use "npu_shim"; never "ascend"
    emulation.install()                          # the one stand-in: torch_npu's documented ops
    npu_shim.install()
    from npu_shim.testing.isolation import import_vllm_ascend_module

    module = import_vllm_ascend_module(TARGET)
    row = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)
    assert row["state"] == "applied", row

    spec = importlib.util.spec_from_file_location(UPSTREAM_COPY, module.__file__)
    upstream_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upstream_module)

    from vllm.config import DeviceConfig, VllmConfig
    from vllm.platforms import current_platform

    assert current_platform.device_type in ("cpu", ""), current_platform
    version = row["versions"]["vllm-ascend"]
    return types.SimpleNamespace(
        module=module, patched=getattr(module, CLASS_NAME),
        upstream_module=upstream_module, upstream=getattr(upstream_module, CLASS_NAME),
        config=VllmConfig(device_config=DeviceConfig(device="cpu")), status=row,
        version=version, pads=not version.startswith("0.14."),
        always_4d=version.startswith("0.14."))


@contextlib.contextmanager
def registered_as_mm_encoder_attention(cls):
    """Stand-in for vllm-ascend's register_ascend_customop (which imports every compiled
    Ascend op): register ``cls`` as the out-of-tree "MMEncoderAttention", as it does when
    is_310p(); unregistered on the way out so that both classes can be built in turn."""
    from vllm.model_executor import custom_op
    from vllm.model_executor.custom_op import CustomOp

    # vLLM 0.14 keeps the registry on the class, later releases in the module.
    op_registry_oot = vars(custom_op).get("op_registry_oot", None)
    if op_registry_oot is None:
        op_registry_oot = CustomOp.op_registry_oot
    assert "MMEncoderAttention" not in op_registry_oot
    CustomOp.register_oot(_decorated_op_cls=cls, name="MMEncoderAttention")
    try:
        yield
    finally:
        op_registry_oot.pop("MMEncoderAttention", None)


def build(stack, cls, *, heads=4, head_dim=80, kv_heads=None, scale=None, count=1,
          prefix="visual.blocks.{}.attn"):
    """``count`` layers from vLLM's own constructor, which hands back ``cls``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    with registered_as_mm_encoder_attention(cls), set_current_vllm_config(stack.config):
        layers = [MMEncoderAttention(num_heads=heads, head_size=head_dim, scale=scale,
                                     num_kv_heads=kv_heads, prefix=prefix.format(i))
                  for i in range(count)]
    assert all(type(layer) is cls for layer in layers)
    return layers if count > 1 else layers[0]


def qkv(layout, bsz, seq, heads, kv_heads, head_dim, *, seed=0, dtype=None):
    import torch

    gen = torch.Generator().manual_seed(seed)

    def one(n):
        shape = (bsz, seq, n, head_dim) if layout == "4d" else (bsz, seq, n * head_dim)
        return torch.randn(shape, generator=gen).to(dtype or torch.float32)

    return one(heads), one(kv_heads), one(kv_heads)


def reference(stack, q, k, v, cu, *, heads, kv_heads, head_dim, scale=None):
    """float64 attention of the packed tokens, shaped like the release's output."""
    from npu_shim.testing import attention_f64

    bsz, seq = q.shape[:2]
    out = attention_f64(q.reshape(bsz * seq, heads, head_dim), k.reshape(bsz * seq, kv_heads, head_dim),
                        v.reshape(bsz * seq, kv_heads, head_dim), cu, scale=scale)
    if q.dim() == 4 or stack.always_4d:
        return out.reshape(bsz, seq, heads, head_dim)
    return out.reshape(bsz, seq, heads * head_dim)


def max_err(out, ref):
    return (out.double() - ref).abs().max().item()


def packed(lengths, dtype="int32"):
    import torch
    from npu_shim.testing import dense_segments

    return torch.tensor(dense_segments(lengths), dtype=getattr(torch, dtype))


def head_dims(stack):
    # 72 (MoonViT) is padded to 128 from 0.18.0rc1 on; 0.14.0rc1 does not pad, and the 310P
    # kernel takes head sizes that are multiples of 16 only.
    return (64, 72, 80, 128) if stack.pads else (64, 80, 128)


# ------------------------------------------------------- status and op call


def test_status_names_the_family(stack):
    assert stack.status["family"] == expected_family()
    assert stack.status["reason"] == "vllm-ascend %s" % stack.version
    ours, original = vars(stack.patched)["forward_oot"], vars(stack.upstream)["forward_oot"]
    assert os.path.join("npu_shim", "patches", "vllm_ascend", "mm_encoder", "v0") in ours.__code__.co_filename
    assert family_module(stack.status["family"]) in ours.__doc__
    assert ours.__wrapped_upstream__.__code__.co_filename == stack.module.__file__
    assert inspect.signature(ours) == inspect.signature(original)
    assert "__init__" not in vars(stack.patched) or vars(stack.patched)["__init__"].__code__.co_filename \
        == stack.module.__file__


def test_op_call_is_upstreams(stack):
    """The same op with the same arguments as upstream: K/V repeated, head dim padded by the
    release's rule, per-segment host lengths in upstream's dtype, ``out=``; at the default
    scale the outputs are equal bit for bit."""
    import torch
    from npu_shim.testing import record_npu_calls

    cu = packed([5, 1, 9, 3])
    q, k, v = qkv("4d", 1, 18, 4, 4, 80, seed=9)
    patched, upstream = build(stack, stack.patched), build(stack, stack.upstream)
    with record_npu_calls() as ours:
        out = patched.forward_oot(q, k, v, cu)
    with record_npu_calls() as theirs:
        expected = upstream.forward_oot(q, k, v, cu)
    assert [c.name for c in ours] == [c.name for c in theirs] == ["_npu_flash_attention_unpad"]
    mine, their = ours[0], theirs[0]
    assert set(mine.kwargs) == set(their.kwargs)
    for name in ("query", "key", "value", "out"):
        assert mine.arg(name).shape == their.arg(name).shape, name
    assert mine.arg("query").shape[-1] == (128 if stack.pads else 80)
    assert torch.equal(mine.arg("seq_len"), their.arg("seq_len"))
    assert mine.arg("seq_len").dtype == their.arg("seq_len").dtype == torch.int32
    assert mine.arg("seq_len").device.type == "cpu"
    for name in ("scale_value", "num_heads", "num_kv_heads"):
        assert mine.arg(name) == their.arg(name), name
    assert out.shape == expected.shape and torch.equal(out, expected)
    assert max_err(out, reference(stack, q, k, v, cu, heads=4, kv_heads=4, head_dim=80)) < TOL


def test_seq_len_keeps_upstreams_dtype(stack):
    """An int64 cu_seqlens: 0.18.0rc1+ pass int64 lengths (torch.diff keeps the dtype),
    0.14.0rc1 converts to int32; the patch does the same."""
    from npu_shim.testing import record_npu_calls

    cu = packed([7, 11], dtype="int64")
    q, k, v = qkv("4d", 1, 18, 2, 2, 64, seed=4)
    dtypes = []
    for cls in (stack.patched, stack.upstream):
        with record_npu_calls() as calls:
            build(stack, cls, heads=2, head_dim=64).forward_oot(q, k, v, cu)
        dtypes.append(calls[0].arg("seq_len").dtype)
    assert dtypes[0] == dtypes[1]
    assert str(dtypes[0]) == ("torch.int32" if stack.version.startswith("0.14.") else "torch.int64")


# ------------------------------------------------------------- correctness


@pytest.mark.hardware_dtypes
@pytest.mark.parametrize("layout", ["3d", "4d"])
def test_float16_as_on_310p(stack, layout):
    """What the 310P tower runs: float16, the only dtype the 310P op takes. Equal to upstream
    bit for bit at the default scale, the model's scale honoured, within the float16
    tolerance of float64; float32 reaching the op here is an error."""
    import torch

    for head_dim in head_dims(stack):
        cu = packed([5, 1, 9, 3])
        q, k, v = qkv(layout, 1, 18, 4, 4, head_dim, seed=head_dim, dtype=torch.float16)
        out = build(stack, stack.patched, head_dim=head_dim).forward_oot(q, k, v, cu)
        expected = build(stack, stack.upstream, head_dim=head_dim).forward_oot(q, k, v, cu)
        assert out.dtype == torch.float16 and torch.equal(out, expected), head_dim
        assert max_err(out, reference(stack, q, k, v, cu, heads=4, kv_heads=4, head_dim=head_dim)) < HW_TOL
        scaled = build(stack, stack.patched, head_dim=head_dim, scale=0.05).forward_oot(q, k, v, cu)
        asked = reference(stack, q, k, v, cu, heads=4, kv_heads=4, head_dim=head_dim, scale=0.05)
        assert max_err(scaled, asked) < HW_TOL
        with pytest.raises(ValueError, match="_npu_flash_attention_unpad: query has dtype float32"):
            build(stack, stack.patched, head_dim=head_dim).forward_oot(q.float(), k.float(), v.float(), cu)


@pytest.mark.parametrize("cu_mode", ["none", "host", "device"])
@pytest.mark.parametrize("layout", ["3d", "4d"])
def test_equal_to_upstream_at_default_scale(stack, layout, cu_mode):
    import torch
    from npu_shim.testing import count_host_syncs

    for head_dim in head_dims(stack):
        if cu_mode == "none":          # bsz images of equal size, no cu_seqlens
            bsz, seq, cu, ref_cu = 3, 7, None, [0, 7, 14, 21]
        else:
            bsz, seq, cu = 1, 18, packed([5, 1, 9, 3])
            ref_cu = cu
        q, k, v = qkv(layout, bsz, seq, 4, 4, head_dim, seed=head_dim)
        patched = build(stack, stack.patched, head_dim=head_dim)
        upstream = build(stack, stack.upstream, head_dim=head_dim)
        with count_host_syncs(device_tensors=[cu] if cu_mode == "device" else []) as syncs:
            out = patched.forward_oot(q, k, v, cu)
        expected = upstream.forward_oot(q, k, v, cu)
        ref = reference(stack, q, k, v, ref_cu, heads=4, kv_heads=4, head_dim=head_dim)
        assert out.shape == expected.shape == ref.shape and out.is_contiguous()
        assert torch.equal(out, expected), head_dim
        assert max_err(out, ref) < TOL
        assert syncs.count == (1 if cu_mode == "device" else 0), syncs.summary()


@pytest.mark.parametrize("layout", ["3d", "4d"])
def test_the_models_scale_is_honoured(stack, layout):
    """Upstream passes head_size ** -0.5 whatever scale the model gave."""
    cu = packed([5, 1, 9, 3])
    q, k, v = qkv(layout, 1, 18, 4, 4, 80, seed=5)
    out = build(stack, stack.patched, scale=0.05).forward_oot(q, k, v, cu)
    wrong = build(stack, stack.upstream, scale=0.05).forward_oot(q, k, v, cu)
    asked = reference(stack, q, k, v, cu, heads=4, kv_heads=4, head_dim=80, scale=0.05)
    default = reference(stack, q, k, v, cu, heads=4, kv_heads=4, head_dim=80)
    assert max_err(out, asked) < TOL
    assert max_err(wrong, default) < TOL and max_err(wrong, asked) > 0.5


def test_gqa_head_count_matches_the_repeated_kv(stack):
    """8 query heads, 2 KV heads. Upstream repeats K/V to 8 heads and still passes
    num_kv_heads=2, which the documented op rejects (the emulation raises); the patch passes
    the head count of the tensors it hands over and matches the reference."""
    cu = packed([5, 1, 9, 3])
    q, k, v = qkv("4d", 1, 18, 8, 2, 80, seed=11)
    out = build(stack, stack.patched, heads=8, kv_heads=2).forward_oot(q, k, v, cu)
    assert max_err(out, reference(stack, q, k, v, cu, heads=8, kv_heads=2, head_dim=80)) < TOL
    with pytest.raises(ValueError, match="num_kv_heads=2 but key/value have 8/8 heads"):
        build(stack, stack.upstream, heads=8, kv_heads=2).forward_oot(q, k, v, cu)


def test_layer_made_with_new(stack):
    """As vllm-ascend's own unit tests build it: ``__new__`` and the attributes forward_oot
    reads. The patch builds its state from them on first use."""
    import torch

    def bare(cls):
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.num_heads, layer.num_kv_heads, layer.head_size = 4, 4, 80
        layer.enable_pad, layer.scale_value = stack.pads, 80 ** -0.5   # what upstream reads
        layer.support_approximate_calculation = False                  # read from 0.23.0rc1 on
        return layer

    q, k, v = qkv("4d", 2, 3, 4, 4, 80, seed=13)
    out = bare(stack.patched).forward_oot(q, k, v)
    assert torch.equal(out, bare(stack.upstream).forward_oot(q, k, v))
    assert max_err(out, reference(stack, q, k, v, [0, 3, 6], heads=4, kv_heads=4, head_dim=80)) < TOL


# ------------------------------------------------------ copies per forward


def tower_forward(layers, q, k, v, cu, **kwargs):
    return [layer.forward_oot(q, k, v, cu, **kwargs) for layer in layers]


def test_27_layers_copy_once_per_forward_under_inference_mode(stack):
    """vLLM runs encoders under torch.inference_mode(). Upstream copies cu_seqlens in every
    layer (27); the patch once per forward, also for a second forward with new lengths and
    for the same buffer rewritten in place between two forwards (no version counter under
    inference mode)."""
    import torch
    from npu_shim.engine import counters
    from npu_shim.testing import count_host_syncs

    q, k, v = qkv("4d", 1, 18, 4, 4, 80, seed=1)
    upstream = build(stack, stack.upstream, count=LAYERS)
    patched = build(stack, stack.patched, count=LAYERS)
    counters.reset()
    with torch.inference_mode():
        cu = packed([5, 1, 9, 3])
        with count_host_syncs(device_tensors=[cu]) as up:
            tower_forward(upstream, q, k, v, cu)
        with count_host_syncs(device_tensors=[cu]) as first:
            outs = tower_forward(patched, q, k, v, cu)
        counters = counters.snapshot()[PATCH_NAME]
        second_cu = packed([12, 2, 4])
        with count_host_syncs(device_tensors=[second_cu]) as second:
            outs2 = tower_forward(patched, q, k, v, second_cu)
        second_cu.copy_(packed([3, 1, 14]))            # the same buffer, rewritten in place
        with count_host_syncs(device_tensors=[second_cu]) as third:
            outs3 = tower_forward(patched, q, k, v, second_cu)
    assert (up.count, first.count, second.count, third.count) == (LAYERS, 1, 1, 1)
    assert counters["calls"] == LAYERS and npu_shim.stats()[PATCH_NAME]["family"] == stack.status["family"]
    # _stats counts transfers of real device tensors only; the CPU stand-ins are counted above.
    assert counters["host_copies"] == counters["upstream_host_copies"] == 0
    for outputs, lengths in ((outs, [5, 1, 9, 3]), (outs2, [12, 2, 4]), (outs3, [3, 1, 14])):
        ref = reference(stack, q, k, v, packed(lengths), heads=4, kv_heads=4, head_dim=80)
        assert max(max_err(o, ref) for o in outputs) < TOL, lengths
    assert max_err(outs3[0], reference(stack, q, k, v, packed([12, 2, 4]), heads=4, kv_heads=4,
                                       head_dim=80)) > 1e-2   # the rewrite really changed the lengths


def test_host_cu_seqlens_and_none_cost_no_copy(stack):
    """A host cu_seqlens, or none (upstream 0.14.0rc1 builds that one on query.device and
    copies it back per layer; counted here by treating every tensor as a device tensor,
    placement followed: the patch's seq_len is made on the host, and handing it to the op
    is no read, while a tensor made on query.device is a device tensor)."""
    from npu_shim.testing import count_host_syncs

    q, k, v = qkv("4d", 3, 6, 4, 4, 80, seed=2)
    patched = build(stack, stack.patched, count=4)
    with count_host_syncs(cpu_is_device=True, follow_placement=True) as none_given:
        tower_forward(patched, q, k, v, None)
    assert none_given.count == 0, none_given.summary()
    source = inspect.getsource(stack.upstream.forward_oot)
    if stack.version.startswith("0.14."):
        assert "device=query.device" in source
        with count_host_syncs(cpu_is_device=True, follow_placement=True) as upstream_none:
            tower_forward(build(stack, stack.upstream, count=4), q, k, v, None)
        assert upstream_none.count == 4, upstream_none.summary()
    else:   # upstream builds that one on the host: no copy there either
        assert 'device="cpu"' in source and "device=query.device" not in source
    host_cu = packed([6, 6, 6])
    with count_host_syncs() as host:
        tower_forward(patched, q.reshape(1, 18, 4, 80), k.reshape(1, 18, 4, 80),
                      v.reshape(1, 18, 4, 80), host_cu)
    assert host.count == 0


def test_two_towers_alternating(stack):
    """Image and video towers (or two models) run layer by layer alternately."""
    from npu_shim.testing import count_host_syncs

    qa, ka, va = qkv("4d", 1, 16, 4, 4, 80, seed=21)
    qb, kb, vb = qkv("4d", 1, 16, 4, 4, 80, seed=22)
    cu_a, cu_b = packed([4, 12]), packed([10, 6])
    ref_a = reference(stack, qa, ka, va, cu_a, heads=4, kv_heads=4, head_dim=80)
    ref_b = reference(stack, qb, kb, vb, cu_b, heads=4, kv_heads=4, head_dim=80)
    tower_a = build(stack, stack.patched, count=LAYERS)
    tower_b = build(stack, stack.patched, count=LAYERS, prefix="video_tower.blocks.{}.attn")
    with count_host_syncs(device_tensors=[cu_a, cu_b]) as syncs:
        for layer_a, layer_b in zip(tower_a, tower_b):
            assert max_err(layer_a.forward_oot(qa, ka, va, cu_a), ref_a) < TOL
            assert max_err(layer_b.forward_oot(qb, kb, vb, cu_b), ref_b) < TOL
    assert syncs.count == 2, syncs.summary()


# ------------------------------------------------- shapes the towers pass


def test_qwen25_vl_full_and_window_layers(stack):
    """Qwen2.5-VL: windowed attention in every layer but 7/15/23/31 (whole images), each
    with its own cu_seqlens: one copy per distinct tensor, 2 per forward instead of 32."""
    from npu_shim.testing import count_host_syncs

    full_layers = (7, 15, 23, 31)
    q, k, v = qkv("4d", 1, 24, 4, 4, 80, seed=51)
    cu_full, cu_window = packed([16, 8]), packed([4] * 6)
    refs = {id(cu): reference(stack, q, k, v, cu, heads=4, kv_heads=4, head_dim=80)
            for cu in (cu_full, cu_window)}

    def forward(layers):
        cus = [cu_full if i in full_layers else cu_window for i in range(len(layers))]
        return [(layer.forward_oot(q, k, v, cu), cu) for layer, cu in zip(layers, cus)]

    with count_host_syncs(device_tensors=[cu_full, cu_window]) as ours:
        outs = forward(build(stack, stack.patched, count=32))
    with count_host_syncs(device_tensors=[cu_full, cu_window]) as up:
        forward(build(stack, stack.upstream, count=32))
    assert (ours.count, up.count) == (2, 32)
    assert max(max_err(out, refs[id(cu)]) for out, cu in outs) < TOL


@pytest.mark.claimed(PATCH_NAME, implemented_in=VLLM_SUBCLASS)   # vLLM 0.18+ has the hook
def test_qwen3_vl_lengths_from_vllms_hook(stack):
    """Qwen3-VL asks MMEncoderAttention.maybe_compute_seq_lens once per forward (vLLM
    0.18+). With the 310P class registered that reaches vLLM's own method (the 310P class
    defines none), which gives None off FlashInfer: every layer gets cu_seqlens only, and
    upstream copies it per layer."""
    import numpy as np
    from npu_shim.testing import count_host_syncs
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    layers = build(stack, stack.patched, count=4)
    cu_np = np.array([0, 8, 8, 20], dtype=np.int32)         # a padded (empty) segment, as vLLM pads
    with registered_as_mm_encoder_attention(stack.patched):
        sequence_lengths = MMEncoderAttention.maybe_compute_seq_lens(layers[0].attn_backend, cu_np, "cpu")
    assert sequence_lengths is None
    cu = packed([8, 0, 12])
    q, k, v = qkv("4d", 1, 20, 4, 4, 80, seed=7)
    with count_host_syncs(device_tensors=[cu]) as syncs:
        outs = tower_forward(layers, q, k, v, cu, max_seqlen=None, sequence_lengths=sequence_lengths)
    assert syncs.count == 1
    ref = reference(stack, q, k, v, cu, heads=4, kv_heads=4, head_dim=80)
    assert max(max_err(o, ref) for o in outs) < TOL


@pytest.mark.claimed(PATCH_NAME, implemented_in=VLLM_SUBCLASS)
def test_moonvit_packed_qkv_views(stack):
    """MoonViT unbinds one packed QKV projection into strided views (16 heads of 72; 0.14.0rc1
    does not pad 72, which the 310P kernel cannot take, so it is left out there)."""
    import torch
    from npu_shim.testing import count_host_syncs

    assert stack.pads
    heads, head_dim, lengths = 16, 72, [40, 24, 56]
    total = sum(lengths)
    xqkv = torch.randn(total, 3, heads, head_dim, generator=torch.Generator().manual_seed(3))
    xq, xk, xv = torch.unbind(xqkv, dim=-3)
    q, k, v = (x.unsqueeze(0) for x in (xq, xk, xv))
    assert not q.is_contiguous()
    cu = packed(lengths)
    layers = build(stack, stack.patched, heads=heads, head_dim=head_dim, scale=head_dim ** -0.5, count=3)
    with count_host_syncs(device_tensors=[cu]) as syncs:
        outs = tower_forward(layers, q, k, v, cu)
    ref = reference(stack, q, k, v, cu, heads=heads, kv_heads=heads, head_dim=head_dim)
    assert syncs.count == 1 and max(max_err(o, ref) for o in outs) < TOL


@pytest.mark.claimed(PATCH_NAME, implemented_in="npu_shim.patches.vllm_ascend.mm_encoder.v023_310p")
def test_0_23_op_choice_follows_upstreams(stack):
    """0.23.0rc1+: upstream calls _npu_flash_attention_unpad_v2(..., kernel_type=2) when the
    layer recorded support_approximate_calculation (torch_npu has the op). The emulation has
    no such op (the torch_npu API reference does not document it), so upstream and the patch
    both take _npu_flash_attention_unpad; a layer that claims the capability makes both reach
    for the v2 op, which this torch_npu lacks. A layer made with ``__new__`` (no recorded
    capability) fails upstream; the patch asks upstream's own probe."""
    import torch
    import torch_npu

    assert family_module(stack.status["family"]).endswith(".v023_310p")
    assert not hasattr(torch_npu, "_npu_flash_attention_unpad_v2")
    q, k, v = qkv("4d", 1, 6, 4, 4, 80, seed=17)
    cu = packed([6])
    for cls in (stack.patched, stack.upstream):
        layer = build(stack, cls)
        assert layer.support_approximate_calculation is False
        layer.support_approximate_calculation = True
        with pytest.raises(AttributeError, match="_npu_flash_attention_unpad_v2"):
            layer.forward_oot(q, k, v, cu)

    def bare(cls):
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.num_heads, layer.num_kv_heads, layer.head_size = 4, 4, 80
        layer.enable_pad, layer.scale_value = True, 80 ** -0.5
        return layer

    with pytest.raises(AttributeError, match="support_approximate_calculation"):
        bare(stack.upstream).forward_oot(q, k, v, cu)
    out = bare(stack.patched).forward_oot(q, k, v, cu)
    assert max_err(out, reference(stack, q, k, v, cu, heads=4, kv_heads=4, head_dim=80)) < TOL


# -------------------------------------------- installed / disabled / strict


def test_selftest_module(stack):
    from npu_shim.selftest import run_one, vllm_mm_encoder_attn_310p as selftest

    assert set(selftest.run(device="cpu")) == {"max_abs_err", "tolerance", "host_syncs", "seconds", "detail"}
    result = run_one(PATCH_NAME, device="cpu")
    assert result["ok"], result["verdict"]
    assert (result["host_syncs"], result["expected_host_syncs"]) == (1, 1)
    assert stack.status["family"] in result["detail"]


def test_uninstall_restores_upstream_and_install_applies_again(stack):
    import npu_shim

    ours = vars(stack.patched)["forward_oot"]
    try:
        npu_shim.uninstall()
        assert vars(stack.patched)["forward_oot"] is ours.__wrapped_upstream__
        assert vars(stack.patched)["forward_oot"].__code__.co_filename == stack.module.__file__
        row = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)
        assert row["state"] == "disabled" and row["family"] is None
    finally:
        npu_shim.install()       # the target is imported: the hook applies the patch again
    row = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)
    assert row["state"] == "applied" and row["family"] == stack.status["family"]
    assert vars(stack.patched)["forward_oot"].__wrapped_upstream__ is ours.__wrapped_upstream__


def test_a_shape_no_family_knows_is_skipped_with_every_reason(stack):
    from npu_shim.engine import guards
    from npu_shim.patch import TargetMismatch
    from npu_shim.patches.vllm_ascend.mm_encoder_attn_310p import PATCH

    class Reshaped(stack.upstream):
        def forward_oot(self, query, key, value, cu_seqlens=None):
            raise AssertionError("never called")

    Reshaped.__name__ = Reshaped.__qualname__ = CLASS_NAME
    module = types.ModuleType(TARGET)
    setattr(module, CLASS_NAME, Reshaped)
    with pytest.raises(TargetMismatch, match="no family accepts AscendMMEncoderAttention310") as info:
        guards.select_family(PATCH, module)
    assert "%s (vllm-ascend" % expected_family() in str(info.value)
    assert "forward_oot takes ('self', 'query', 'key', 'value', 'cu_seqlens')" in str(info.value)


SUBPROCESS_BODY = r'''
import json, os, sys, torch
os.environ["NPU_SHIM_EMULATE_SOC"] = "Ascend310P3"
import npu_shim
from npu_shim import emulation
from npu_shim.testing import count_host_syncs
from npu_shim.testing.isolation import import_vllm_ascend_module
emulation.install()
from npu_shim.emulation.dtypes import float32_not_on_hardware
_float32 = float32_not_on_hardware(); _float32.__enter__()   # this module's float32 math checks (float32_math)
if MODE == "mismatch":
    import wrapt
    def reshape_upstream(module):   # runs before the shim's hook: a shape no family knows
        def forward_oot(self, query, key, value, cu_seqlens=None):
            raise AssertionError("never called")
        module.AscendMMEncoderAttention310.forward_oot = forward_oot
    wrapt.register_post_import_hook(reshape_upstream, TARGET)
try:
    module = import_vllm_ascend_module(TARGET)
except Exception as exc:
    print(json.dumps({"raised": type(exc).__name__, "message": str(exc)}))
    sys.exit(0)
cls = module.AscendMMEncoderAttention310
row = next(r for r in npu_shim.status() if r["name"] == "vllm.mm_encoder_attn_310p")
if MODE == "mismatch":
    print(json.dumps({"state": row["state"], "reason": row["reason"]}))
    sys.exit(0)
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    layers = [cls(num_heads=4, head_size=80, scale=0.05, prefix="visual.blocks.%d.attn" % i)
              for i in range(3)]
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 18, 4, 80, generator=gen) for _ in range(3))
cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
with count_host_syncs(device_tensors=[cu]) as syncs:
    outs = [layer.forward_oot(q, k, v, cu) for layer in layers]
torch.save(outs[0], OUT)
print(json.dumps({"state": row["state"], "family": row["family"], "syncs": syncs.count,
                  "forward_file": cls.__dict__["forward_oot"].__code__.co_filename,
                  "module_file": module.__file__}))
'''


def run_fresh(run_python, make_env, tmp_path, mode="plain", **env):
    out = tmp_path / "out.pt"
    code = "TARGET = %r\nOUT = %r\nMODE = %r\n%s" % (TARGET, str(out), mode, SUBPROCESS_BODY)
    proc = run_python(code, env=make_env(VLLM_PLUGINS="", **env), timeout=300)
    return json.loads(proc.stdout.strip().splitlines()[-1]), out


@pytest.mark.claimed(PATCH_NAME, per_family=True)
def test_disabled_is_exactly_upstream(stack, run_python, make_env, tmp_path):
    """NPU_SHIM_DISABLE=vllm.mm_encoder_attn_310p: upstream's own forward_oot runs, with its
    per-layer copy and ignored scale, and the very same output as the untouched copy."""
    import torch

    result, out = run_fresh(run_python, make_env, tmp_path, NPU_SHIM_DISABLE=PATCH_NAME)
    assert result["state"] == "disabled" and result["family"] is None, result
    assert result["forward_file"] == result["module_file"]
    assert result["syncs"] == 3                      # upstream's copy per layer
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 18, 4, 80, generator=gen) for _ in range(3))
    upstream = build(stack, stack.upstream, scale=0.05)
    assert torch.equal(torch.load(out), upstream.forward_oot(q, k, v, packed([5, 1, 9, 3])))


@pytest.mark.claimed(PATCH_NAME, per_family=True)
def test_strict_mode_raises_on_a_shape_no_family_knows(run_python, make_env, tmp_path):
    """Inside the version window, the installed class reshaped (another post-import hook runs
    before the shim's): NPU_SHIM_STRICT=1 raises from the import of the target."""
    strict, _ = run_fresh(run_python, make_env, tmp_path, mode="mismatch", NPU_SHIM_STRICT="1")
    assert strict.get("raised") == "PatchError", strict
    assert "no family accepts AscendMMEncoderAttention310" in strict["message"]
