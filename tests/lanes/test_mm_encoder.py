"""Patch ``vllm.mm_encoder_attn`` on the real vllm-ascend wheels (lanes vllm-0.13 .. vllm-0.17).

What runs here is upstream code at the pinned versions: vLLM's
``MMEncoderAttention`` and vllm-ascend's ``AscendMMEncoderAttention``. The only
stand-in is torch_npu (npu-shim's emulation of the documented ops). Every
numerical claim is checked against ``npu_shim.testing.attention_f64`` (float64,
from the definition of attention), never against the code under test.

Two classes are compared side by side in one process:

* ``stack.patched``: ``vllm_ascend.ops.mm_encoder_attention.AscendMMEncoderAttention``
  after the shim's import hook patched it (the real installation path);
* ``stack.upstream``: the same upstream file executed a second time under another
  module name, which the shim does not watch: untouched upstream code, with its
  own module globals (0.15.0rc1's ``seq_lens_cpu_cache`` included).

"On the device": on this CPU-only machine ``cu_seqlens`` tensors are marked as
device stand-ins for :func:`npu_shim.testing.count_host_syncs`; copying one to the
host counts as a sync, exactly where an NPU tensor would sync.
"""
import importlib
import importlib.util
import inspect
import os
import textwrap
import types

import pytest

from npu_shim.testing.claims import claimed_family
from npu_shim.testing.errors import Tolerance

pytestmark = [pytest.mark.claimed("vllm.mm_encoder_attn", implemented_in="npu_shim.patches.vllm_ascend.mm_encoder.v013"),
              pytest.mark.patch("vllm.mm_encoder_attn"),
              pytest.mark.float32_math]  # the layer-level math checks: float32 vs float64 (see conftest)

TARGET = "vllm_ascend.ops.mm_encoder_attention"
PATCH_NAME = "vllm.mm_encoder_attn"
UPSTREAM_COPY = "npu_shim_tests_upstream_mm_encoder_attention"
LAYERS = 27                      # Qwen2.5-VL / Qwen3-VL vision towers
F32_TOL = dict(atol=2e-5, rtol=2e-5)
# float32 layer vs float64: measured worst 9.0e-7 (vllm-0.13)
TOL = Tolerance("layer 0.13 float32 vs float64", 8e-6)
# the towers' dtypes vs float64 (absolute; |ref| <= ~3): measured worst bfloat16 7.6e-3, float16 9.7e-4
# (vllm-0.13)
HW_TOL = {"bfloat16": Tolerance("layer 0.13 bfloat16 vs float64", 2e-2, "bfloat16"),
          "float16": Tolerance("layer 0.13 float16 vs float64", 3e-3, "float16")}


def import_target_without_ops_init():
    """Import ``vllm_ascend.ops.mm_encoder_attention`` without running
    ``vllm_ascend/ops/__init__.py``.

    That ``__init__`` imports compiled Ascend ops (``register_custom_ops``,
    fused MoE, triton kernels) which cannot load off an NPU, and the module under
    test needs none of them. So, unless the real package is already imported, an
    empty package module is registered as ``vllm_ascend.ops`` with the real
    ``__path__`` (``module_from_spec`` of the real spec, not executed); the real
    submodule file is then imported from it. Nothing else of vllm-ascend is
    replaced. vLLM stays off the NPU platform: ``VLLM_PLUGINS`` (the lanes set
    ``npu_shim``; empty if unset) does not name ``ascend``, so vllm-ascend's
    platform plugin never activates.
    """
    os.environ.setdefault("VLLM_PLUGINS", "")  # the lanes use "npu_shim"; never "ascend"
    from npu_shim.testing.isolation import import_vllm_ascend_ops_module

    return import_vllm_ascend_ops_module()


@pytest.fixture(scope="module")
def stack():
    import npu_shim
    from npu_shim import emulation

    # The one stand-in: torch_npu resolves to npu-shim's emulation of the documented ops.
    emulation.install()
    npu_shim.install()
    module = import_target_without_ops_init()
    row = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)
    assert row["state"] == "applied", row

    spec = importlib.util.spec_from_file_location(UPSTREAM_COPY, module.__file__)
    upstream_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upstream_module)

    from vllm.config import DeviceConfig, VllmConfig
    from vllm.platforms import current_platform

    assert current_platform.device_type in ("cpu", ""), (
        "vLLM must stay off the NPU platform here, got %r" % current_platform)
    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    return types.SimpleNamespace(
        module=module,
        patched=module.AscendMMEncoderAttention,
        upstream_module=upstream_module,
        upstream=upstream_module.AscendMMEncoderAttention,
        config=config,
        status=row,
        vllm_ascend_version=row["versions"]["vllm-ascend"],
    )


def build(stack, cls, *, heads, head_dim, kv_heads=None, scale=None, prefix="visual.blocks.0.attn"):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(stack.config):
        return cls(num_heads=heads, head_size=head_dim, scale=scale, num_kv_heads=kv_heads,
                   prefix=prefix)


def make_qkv(layout, bsz, seq, heads, kv_heads, head_dim, *, dtype=None, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)

    def one(n):
        shape = (bsz, seq, n, head_dim) if layout == "4d" else (bsz, seq, n * head_dim)
        return torch.randn(shape, generator=gen).to(dtype or torch.float32)

    return one(heads), one(kv_heads), one(kv_heads)


def reference(q, k, v, cu, *, heads, kv_heads, head_dim, scale=None):
    """float64 attention of the packed tokens, shaped like upstream's output."""
    from npu_shim.testing import attention_f64

    bsz, seq = q.shape[:2]
    out = attention_f64(q.reshape(bsz * seq, heads, head_dim),
                        k.reshape(bsz * seq, kv_heads, head_dim),
                        v.reshape(bsz * seq, kv_heads, head_dim), cu, scale=scale)
    return out.reshape(q.shape) if q.dim() == 4 else out.reshape(bsz, seq, heads * head_dim)


def max_err(out, ref):
    return (out.double() - ref).abs().max().item()


def lengths_case(cu_mode):
    """(bsz, seq, cu tensor or None, cu for the reference)."""
    import torch
    from npu_shim.testing import dense_segments

    if cu_mode == "none":  # three equal images in a batch of 3, as Hunyuan-OCR passes them
        return 3, 7, None, dense_segments([7, 7, 7])
    cum = dense_segments([5, 1, 9, 3])  # four images packed into one sequence
    return 1, cum[-1], torch.tensor(cum, dtype=torch.int32), cum


def sync_counter(cu_mode, cu):
    """Count what an NPU would sync: a device cu_seqlens stand-in, or (for None) every
    tensor the layer builds itself, since upstream 0.13 builds it on query.device.
    Placement is followed there: a tensor made on the host (the patch's seq_len, which
    the op reads on the host) is host data, one made on query.device is not."""
    from npu_shim.testing import count_host_syncs

    if cu_mode == "device":
        return count_host_syncs(device_tensors=[cu])
    none = cu_mode == "none"
    return count_host_syncs(cpu_is_device=none, follow_placement=none)


# --------------------------------------------------------------- 1. equivalence


@pytest.mark.parametrize("head_dim", [64, 72, 80, 128])
@pytest.mark.parametrize("cu_mode", ["none", "host", "device"])
@pytest.mark.parametrize("layout", ["3d", "4d"])
def test_patched_equals_upstream_and_reference(stack, layout, cu_mode, head_dim):
    import torch

    heads = 4
    bsz, seq, cu, ref_cu = lengths_case(cu_mode)
    q, k, v = make_qkv(layout, bsz, seq, heads, heads, head_dim, seed=head_dim)
    patched = build(stack, stack.patched, heads=heads, head_dim=head_dim)
    upstream = build(stack, stack.upstream, heads=heads, head_dim=head_dim)

    with sync_counter(cu_mode, cu) as syncs:
        out = patched.forward_oot(q, k, v, cu)
    expected = upstream.forward_oot(q, k, v, cu)
    ref = reference(q, k, v, ref_cu, heads=heads, kv_heads=heads, head_dim=head_dim)

    assert out.shape == expected.shape == ref.shape
    assert out.dtype == expected.dtype == q.dtype
    assert out.is_contiguous()
    torch.testing.assert_close(out, expected, **F32_TOL)
    assert max_err(out, ref) < TOL
    assert max_err(expected, ref) < TOL
    assert syncs.count == (1 if cu_mode == "device" else 0), syncs.summary()


def test_cu_seqlens_none_costs_no_sync(stack):
    """cu_seqlens=None (uniform lengths, e.g. Hunyuan-OCR): the patch builds host ints,
    no tensor at all, so even counting every tensor as a device tensor finds no sync.
    0.13.0/0.14.0rc1 build the uniform cu_seqlens on ``query.device`` and copy it back in
    every layer; 0.15.0rc1 builds it on the CPU (no sync there either)."""
    bsz, seq, _, _ = lengths_case("none")
    q, k, v = make_qkv("4d", bsz, seq, 2, 2, 64)
    patched = build(stack, stack.patched, heads=2, head_dim=64)
    with sync_counter("none", None) as ours:
        patched.forward_oot(q, k, v, None)
    assert ours.count == 0, ours.summary()

    source = inspect.getsource(stack.upstream.forward_oot)
    if "device=query.device" in source:
        upstream = build(stack, stack.upstream, heads=2, head_dim=64)
        with sync_counter("none", None) as up:
            upstream.forward_oot(q, k, v, None)
        assert up.count == 1, up.summary()
    else:
        assert 'device="cpu"' in source and "device=query.device" not in source


@pytest.mark.hardware_dtypes
@pytest.mark.parametrize("dtype_name", ["float16", "bfloat16"])
def test_low_precision_keeps_dtype_and_shape(stack, dtype_name):
    import torch

    dtype = getattr(torch, dtype_name)
    bsz, seq, cu, ref_cu = lengths_case("device")
    q, k, v = make_qkv("3d", bsz, seq, 4, 4, 80, dtype=dtype, seed=3)
    patched = build(stack, stack.patched, heads=4, head_dim=80)
    upstream = build(stack, stack.upstream, heads=4, head_dim=80)
    out = patched.forward_oot(q, k, v, cu)
    expected = upstream.forward_oot(q, k, v, cu)
    ref = reference(q, k, v, ref_cu, heads=4, kv_heads=4, head_dim=80)
    assert out.dtype == expected.dtype == dtype
    assert out.shape == expected.shape
    assert torch.equal(out, expected)
    assert max_err(out, ref) < HW_TOL[dtype_name]


@pytest.mark.parametrize("layout", ["3d", "4d"])
def test_gqa(stack, layout):
    """GQA (8 query heads, 2 KV heads). Upstream repeats K/V to 8 heads and still passes
    num_kv_heads=2 to _npu_flash_attention_unpad, whose documented key/value carry
    num_kv_heads heads: the emulated op rejects that call. The patch repeats K/V as
    upstream does and passes the head count of the repeated tensors (8)."""
    heads, kv_heads, head_dim = 8, 2, 80
    bsz, seq, cu, ref_cu = lengths_case("device")
    q, k, v = make_qkv(layout, bsz, seq, heads, kv_heads, head_dim, seed=11)
    patched = build(stack, stack.patched, heads=heads, head_dim=head_dim, kv_heads=kv_heads)
    with sync_counter("device", cu) as syncs:
        out = patched.forward_oot(q, k, v, cu)
    ref = reference(q, k, v, ref_cu, heads=heads, kv_heads=kv_heads, head_dim=head_dim)
    assert out.shape == ref.shape and out.dtype == q.dtype
    assert max_err(out, ref) < TOL
    assert syncs.count == 1

    upstream = build(stack, stack.upstream, heads=heads, head_dim=head_dim, kv_heads=kv_heads)
    with pytest.raises(ValueError, match="num_kv_heads=2 but key/value have 8/8 heads"):
        upstream.forward_oot(q, k, v, cu)


@pytest.mark.parametrize("layout", ["3d", "4d"])
def test_non_default_scale_is_honoured_where_upstream_ignores_it(stack, layout):
    heads, head_dim, scale = 4, 72, 0.05
    bsz, seq, cu, ref_cu = lengths_case("host")
    q, k, v = make_qkv(layout, bsz, seq, heads, heads, head_dim, seed=5)
    patched = build(stack, stack.patched, heads=heads, head_dim=head_dim, scale=scale)
    upstream = build(stack, stack.upstream, heads=heads, head_dim=head_dim, scale=scale)
    out = patched.forward_oot(q, k, v, cu)
    wrong = upstream.forward_oot(q, k, v, cu)
    asked = reference(q, k, v, ref_cu, heads=heads, kv_heads=heads, head_dim=head_dim, scale=scale)
    default = reference(q, k, v, ref_cu, heads=heads, kv_heads=heads, head_dim=head_dim)

    assert patched.scale_value == scale
    assert max_err(out, asked) < TOL
    # Upstream computes with head_size ** -0.5 whatever the model asked for.
    assert max_err(wrong, default) < TOL
    assert max_err(wrong, asked) > 0.05


@pytest.mark.parametrize("soc", [None, "Ascend310P3"])
def test_op_call_is_upstreams_on_every_soc(stack, monkeypatch, soc):
    """Upstream 0.13-0.17 call _npu_flash_attention_unpad on every SoC: the patch makes the
    same call with the same layout (K/V repeated, head dim padded to 128 by upstream's
    rule, per-segment host lengths, ``out=``); at the default scale the outputs are equal
    bit for bit."""
    import torch
    from npu_shim.testing import record_npu_calls

    if soc:
        monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", soc)
    patched = build(stack, stack.patched, heads=4, head_dim=80)
    upstream = build(stack, stack.upstream, heads=4, head_dim=80)
    bsz, seq, cu, ref_cu = lengths_case("device")
    q, k, v = make_qkv("4d", bsz, seq, 4, 4, 80, seed=9)
    with record_npu_calls() as ours:
        out = patched.forward_oot(q, k, v, cu)
    with record_npu_calls() as theirs:
        expected = upstream.forward_oot(q, k, v, cu)
    assert [c.name for c in ours] == [c.name for c in theirs] == ["_npu_flash_attention_unpad"]
    mine, upstream_call = ours[0], theirs[0]
    assert set(mine.kwargs) == set(upstream_call.kwargs)
    for name in ("query", "key", "value", "out"):
        assert mine.arg(name).shape == upstream_call.arg(name).shape, name
    assert mine.arg("query").shape[-1] == 128
    assert torch.equal(mine.arg("seq_len"), upstream_call.arg("seq_len"))
    assert mine.arg("seq_len").device.type == "cpu" and mine.arg("seq_len").dtype == torch.int32
    for name in ("scale_value", "num_heads", "num_kv_heads"):
        assert mine.arg(name) == upstream_call.arg(name), name
    assert torch.equal(out, expected)
    assert max_err(out, reference(q, k, v, ref_cu, heads=4, kv_heads=4, head_dim=80)) < TOL


def test_padding_follows_upstreams_rule(stack):
    """64 < D < 128 is padded to 128 (0.13.0/0.14.0rc1: while USE_OPTIMIZED_MODEL, default on);
    64 and 128 are not; the layer exposes what it uses as upstream 0.15+ does."""
    from npu_shim.testing import record_npu_calls

    for head_dim, width in ((64, 64), (72, 128), (80, 128), (128, 128)):
        layer = build(stack, stack.patched, heads=2, head_dim=head_dim)
        assert layer.enable_pad is (width != head_dim)
        # The model's scale where vLLM gives one (vLLM 0.17 writes 1.0 / head_dim ** 0.5, one unit
        # in the last place from upstream vllm-ascend's head_dim ** -0.5 at 72), else head_dim ** -0.5.
        assert layer.scale_value == (head_dim ** -0.5 if layer.scale is None else layer.scale)
        assert layer.scale_value == pytest.approx(head_dim ** -0.5, rel=1e-15)
        bsz, seq, cu, _ = lengths_case("host")
        q, k, v = make_qkv("4d", bsz, seq, 2, 2, head_dim)
        with record_npu_calls() as calls:
            layer.forward_oot(q, k, v, cu)
        assert calls[0].arg("query").shape[-1] == width


def test_constructor_arguments_as_upstream(stack):
    """Positional or keyword, the patched __init__ takes exactly upstream's arguments."""
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(stack.config):
        layer = stack.patched(4, 72, 0.05, 2, "visual.blocks.0.attn")
        assert (layer.num_heads, layer.head_size, layer.scale, layer.num_kv_heads,
                layer.layer_name) == (4, 72, 0.05, 2, "visual.blocks.0.attn")
        assert layer.scale_value == 0.05
        for cls in (stack.patched, stack.upstream):
            with pytest.raises(TypeError):
                cls(4, 72, no_such_argument=1)


def test_patched_layer_deepcopies_and_pickles(stack):
    """Upstream layers can be deep-copied and pickled; the patched ones too (the layer's
    state is not copied; the clone rebuilds it from its own attributes)."""
    import copy
    import pickle

    import torch

    layer = build(stack, stack.patched, heads=4, head_dim=72, scale=0.05)
    bsz, seq, cu, ref_cu = lengths_case("host")
    q, k, v = make_qkv("4d", bsz, seq, 4, 4, 72, seed=8)
    expected = layer.forward_oot(q, k, v, cu)
    for clone in (copy.deepcopy(layer), pickle.loads(pickle.dumps(layer))):
        assert type(clone) is stack.patched and clone is not layer
        assert clone.scale == 0.05
        assert torch.equal(clone.forward_oot(q, k, v, cu), expected)
    upstream = copy.deepcopy(build(stack, stack.upstream, heads=4, head_dim=72, scale=0.05))
    assert torch.equal(upstream.forward_oot(q, k, v, cu),
                       build(stack, stack.upstream, heads=4, head_dim=72).forward_oot(q, k, v, cu))


# ------------------------------------------------------------ 2. host syncs


def _stack_of(stack, cls, prefix_format, *, heads=4, head_dim=80):
    return [build(stack, cls, heads=heads, head_dim=head_dim, prefix=prefix_format.format(i))
            for i in range(LAYERS)]


def _forward(layers, q, k, v, cu):
    return [layer.forward_oot(q, k, v, cu) for layer in layers]


def test_27_layers_upstream_syncs_per_layer_patched_once(stack):
    import torch
    from npu_shim.testing import count_host_syncs, dense_segments

    q, k, v = make_qkv("4d", 1, 18, 4, 4, 80, seed=1)
    cu = torch.tensor(dense_segments([5, 1, 9, 3]), dtype=torch.int32)
    ref = reference(q, k, v, cu, heads=4, kv_heads=4, head_dim=80)
    upstream = _stack_of(stack, stack.upstream, "visual.blocks.{}.attn")
    patched = _stack_of(stack, stack.patched, "visual.blocks.{}.attn")

    with count_host_syncs(device_tensors=[cu]) as up:
        _forward(upstream, q, k, v, cu)
    with count_host_syncs(device_tensors=[cu]) as ours:
        outs = _forward(patched, q, k, v, cu)
    assert up.count == LAYERS, up.summary()
    assert ours.count == 1, ours.summary()
    assert all(max_err(o, ref) < TOL for o in outs)

    # Next forward, new images: a new cu_seqlens tensor -> one new sync, new lengths used.
    cu2 = torch.tensor(dense_segments([12, 2, 4]), dtype=torch.int32)
    ref2 = reference(q, k, v, cu2, heads=4, kv_heads=4, head_dim=80)
    with count_host_syncs(device_tensors=[cu2]) as second:
        outs2 = _forward(patched, q, k, v, cu2)
    assert second.count == 1, second.summary()
    assert all(max_err(o, ref2) < TOL for o in outs2)
    assert max_err(outs2[-1], ref) > 1e-2  # the lengths really changed the result

    # The same tensor rewritten in place (a reused buffer) is seen through its version.
    cu2[1:] = torch.tensor(dense_segments([3, 1, 14])[1:], dtype=torch.int32)
    ref3 = reference(q, k, v, cu2, heads=4, kv_heads=4, head_dim=80)
    with count_host_syncs(device_tensors=[cu2]) as third:
        outs3 = _forward(patched, q, k, v, cu2)
    assert third.count == 1, third.summary()
    assert all(max_err(o, ref3) < TOL for o in outs3)


def test_two_encoders_interleaved_stay_correct(stack):
    """Image and video towers (or two models) in one process, run layer by layer
    alternately: nothing one stack caches can leak into the other."""
    import torch
    from npu_shim.testing import count_host_syncs, dense_segments

    qa, ka, va = make_qkv("4d", 1, 16, 4, 4, 80, seed=21)
    qb, kb, vb = make_qkv("4d", 1, 16, 4, 4, 80, seed=22)
    cu_a = torch.tensor(dense_segments([4, 12]), dtype=torch.int32)
    cu_b = torch.tensor(dense_segments([10, 6]), dtype=torch.int32)  # same total, other split
    ref_a = reference(qa, ka, va, cu_a, heads=4, kv_heads=4, head_dim=80)
    ref_b = reference(qb, kb, vb, cu_b, heads=4, kv_heads=4, head_dim=80)
    tower_a = _stack_of(stack, stack.patched, "visual.blocks.{}.attn")
    tower_b = _stack_of(stack, stack.patched, "video_tower.blocks.{}.attn")
    with count_host_syncs(device_tensors=[cu_a, cu_b]) as syncs:
        for layer_a, layer_b in zip(tower_a, tower_b):
            assert max_err(layer_a.forward_oot(qa, ka, va, cu_a), ref_a) < TOL
            assert max_err(layer_b.forward_oot(qb, kb, vb, cu_b), ref_b) < TOL
    assert syncs.count == 2, syncs.summary()  # one per encoder forward


QWEN25_VL_DEPTH, QWEN25_VL_FULL_ATTENTION = 32, (7, 15, 23, 31)


def qwen25_vl_like_forward(layers, q, k, v, cu_full, cu_window):
    """Qwen2.5-VL's vision tower: windowed attention in every layer but 7/15/23/31,
    which attend over whole images; vLLM hands each layer the matching cu_seqlens."""
    return [layer.forward_oot(q, k, v, cu_full if i in QWEN25_VL_FULL_ATTENTION else cu_window)
            for i, layer in enumerate(layers)]


def _qwen25_vl_case():
    import torch
    from npu_shim.testing import dense_segments

    q, k, v = make_qkv("4d", 1, 24, 4, 4, 80, seed=51)
    cu_full = torch.tensor(dense_segments([16, 8]), dtype=torch.int32)            # two images
    cu_window = torch.tensor(dense_segments([4, 4, 4, 4, 4, 4]), dtype=torch.int32)  # windows
    ref_full = reference(q, k, v, cu_full, heads=4, kv_heads=4, head_dim=80)
    ref_window = reference(q, k, v, cu_window, heads=4, kv_heads=4, head_dim=80)
    refs = [ref_full if i in QWEN25_VL_FULL_ATTENTION else ref_window for i in range(QWEN25_VL_DEPTH)]
    return q, k, v, cu_full, cu_window, refs


def test_qwen25_vl_full_and_window_layers(stack):
    """Two cu_seqlens tensors per forward (full and windowed attention): one sync per
    distinct tensor, so 2 per forward instead of 32, and every layer uses its own."""
    from npu_shim.testing import count_host_syncs

    q, k, v, cu_full, cu_window, refs = _qwen25_vl_case()
    layers = [build(stack, stack.patched, heads=4, head_dim=80, prefix="visual.blocks.%d.attn" % i)
              for i in range(QWEN25_VL_DEPTH)]
    upstream = [build(stack, stack.upstream, heads=4, head_dim=80, prefix="visual.blocks.%d.attn" % i)
                for i in range(QWEN25_VL_DEPTH)]
    with count_host_syncs(device_tensors=[cu_full, cu_window]) as ours:
        outs = qwen25_vl_like_forward(layers, q, k, v, cu_full, cu_window)
    with count_host_syncs(device_tensors=[cu_full, cu_window]) as up:
        qwen25_vl_like_forward(upstream, q, k, v, cu_full, cu_window)
    assert ours.count == 2, ours.summary()
    assert up.count == QWEN25_VL_DEPTH, up.summary()
    assert max(max_err(o, r) for o, r in zip(outs, refs)) < TOL


def test_inference_mode_tensors(stack):
    """vLLM runs encoders under torch.inference_mode(): cu_seqlens is an inference tensor
    (no version counter). A fresh tensor per forward, as vLLM builds it, is seen."""
    import torch
    from npu_shim.testing import count_host_syncs, dense_segments

    layers = _stack_of(stack, stack.patched, "visual.blocks.{}.attn")
    q, k, v = make_qkv("4d", 1, 18, 4, 4, 80, seed=61)
    for lengths in ([5, 1, 9, 3], [9, 9], [1, 17]):
        with torch.inference_mode():
            cu = torch.tensor(dense_segments(lengths), dtype=torch.int32)
            with count_host_syncs(device_tensors=[cu]) as syncs:
                outs = _forward(layers, q, k, v, cu)
        ref = reference(q, k, v, cu, heads=4, kv_heads=4, head_dim=80)
        assert syncs.count == 1, syncs.summary()
        assert max(max_err(o, ref) for o in outs) < TOL


# ---------------------------------------------------------------- 3. prefixes


@pytest.mark.parametrize("prefix", ["", "attn", "vision_tower.attn", "visual2.blocks.0.attn",
                                    "model.layers.1.visual.blocks.10.attn"])
def test_any_prefix_works(stack, prefix):
    bsz, seq, cu, ref_cu = lengths_case("device")
    q, k, v = make_qkv("3d", bsz, seq, 4, 4, 64, seed=2)
    layer = build(stack, stack.patched, heads=4, head_dim=64, prefix=prefix)
    out = layer.forward_oot(q, k, v, cu)
    assert max_err(out, reference(q, k, v, ref_cu, heads=4, kv_heads=4, head_dim=64)) < TOL
    assert not hasattr(layer, "layer_index")


# ---------------------------------------------------- installed / disabled paths


def test_status_and_replaced_methods(stack):
    from npu_shim.patches.vllm_ascend.mm_encoder_attn import PATCH

    assert stack.status["reason"] == "vllm-ascend %s" % stack.vllm_ascend_version
    assert stack.status["family"] == claimed_family(PATCH_NAME).name
    for path in PATCH.replaces:
        name = path.split(".")[1]
        ours = vars(stack.patched)[name]
        original = vars(stack.upstream)[name]
        assert ours.__code__.co_filename.endswith(os.path.join("patches", "vllm_ascend", "mm_encoder", "v013.py"))
        assert original.__code__.co_filename == stack.module.__file__
        assert inspect.signature(ours) == inspect.signature(original)


SUBPROCESS_BODY = r'''
import json, torch, npu_shim, wrapt
from npu_shim import emulation
from npu_shim.testing import attention_f64, count_host_syncs, record_npu_calls
if os.environ.get("TEST_CHANGE_SHAPE"):
    # A release inside the window whose class has another shape (the 0.18+ hook): runs
    # before the shim's post-import hook (hooks run in registration order).
    def change_shape(module):
        module.AscendMMEncoderAttention.maybe_compute_seq_lens = classmethod(lambda cls: None)
    wrapt.register_post_import_hook(change_shape, TARGET)
emulation.install()
from npu_shim.emulation.dtypes import float32_not_on_hardware
_float32 = float32_not_on_hardware(); _float32.__enter__()   # this module's float32 math checks (float32_math)
try:
    module = import_target_without_ops_init()
except Exception as exc:
    print(json.dumps({"raised": type(exc).__name__, "message": str(exc)}))
    raise SystemExit(0)
row = next(r for r in npu_shim.status() if r["name"] == "vllm.mm_encoder_attn")
cls = module.AscendMMEncoderAttention
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    layers = [cls(num_heads=4, head_size=72, scale=0.05, prefix="visual.blocks.%d.attn" % i)
              for i in range(3)]
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 18, 4, 72, generator=gen) for _ in range(3))
cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
with count_host_syncs(device_tensors=[cu]) as syncs, record_npu_calls() as calls:
    outs = [layer.forward_oot(q, k, v, cu) for layer in layers]
flat = lambda x: x.reshape(18, 4, 72)
err = lambda scale: max((o.double() - attention_f64(flat(q), flat(k), flat(v), cu, scale=scale)
                         .reshape(o.shape)).abs().max().item() for o in outs)
torch.save(outs[0], OUT)
forward_file = cls.forward_oot.__code__.co_filename
npu_shim.uninstall()
print(json.dumps({"state": row["state"], "reason": row["reason"], "family": row["family"],
                  "syncs": syncs.count, "ops": sorted({c.name for c in calls}),
                  "init_file": cls.__init__.__code__.co_filename,
                  "forward_file": forward_file,
                  "forward_file_after_uninstall": cls.forward_oot.__code__.co_filename,
                  "module_file": module.__file__,
                  "err_asked_scale": err(0.05), "err_default_scale": err(72 ** -0.5)}))
'''


def _run_in_fresh_interpreter(run_python, make_env, tmp_path, **env):
    import json

    out = tmp_path / "out.pt"
    code = "\n".join([
        "import importlib, importlib.util, os, sys",
        "TARGET = %r" % TARGET,
        "OUT = %r" % str(out),
        textwrap.dedent(inspect.getsource(import_target_without_ops_init)),
        SUBPROCESS_BODY,
    ])
    proc = run_python(code, env=make_env(VLLM_PLUGINS="", **env), timeout=300)
    return json.loads(proc.stdout.strip().splitlines()[-1]), out


def test_disabled_is_exactly_upstream(stack, run_python, make_env, tmp_path):
    """NPU_SHIM_DISABLE=vllm.mm_encoder_attn: upstream's own methods run, with upstream's
    per-layer syncs and ignored scale, and the very same output as the untouched copy."""
    import torch

    result, out = _run_in_fresh_interpreter(
        run_python, make_env, tmp_path, NPU_SHIM_DISABLE=PATCH_NAME)
    assert result["state"] == "disabled", result
    assert result["init_file"] == result["forward_file"] == result["module_file"]
    assert result["syncs"] == 3
    assert result["err_default_scale"] < TOL < 0.05 < result["err_asked_scale"]

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 18, 4, 72, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    upstream = build(stack, stack.upstream, heads=4, head_dim=72, scale=0.05)
    assert torch.equal(torch.load(out), upstream.forward_oot(q, k, v, cu))


def test_enabled_in_a_fresh_interpreter_and_uninstall_restores(stack, run_python, make_env, tmp_path):
    result, _ = _run_in_fresh_interpreter(run_python, make_env, tmp_path)
    assert result["state"] == "applied" and result["family"] == claimed_family(PATCH_NAME).name, result
    assert result["forward_file"] != result["module_file"]
    assert result["forward_file_after_uninstall"] == result["module_file"]
    assert result["syncs"] == 1
    assert result["ops"] == ["_npu_flash_attention_unpad"]
    assert result["err_asked_scale"] < TOL


def test_tnd_switch_uses_the_shims_fusion_kernel(stack, run_python, make_env, tmp_path):
    """NPU_SHIM_MM_ENCODER_TND=1: npu-shim's TND npu_fusion_attention instead of upstream's op."""
    result, _ = _run_in_fresh_interpreter(run_python, make_env, tmp_path, NPU_SHIM_MM_ENCODER_TND="1")
    assert result["state"] == "applied", result
    assert result["ops"] == ["npu_fusion_attention"]
    assert result["syncs"] == 1
    assert result["err_asked_scale"] < TOL


def test_strict_mode_raises_on_a_mismatch_inside_the_window(stack, run_python, make_env, tmp_path):
    result, _ = _run_in_fresh_interpreter(run_python, make_env, tmp_path, TEST_CHANGE_SHAPE="1",
                                          NPU_SHIM_STRICT="1")
    assert result["raised"] == "PatchError", result
    assert claimed_family(PATCH_NAME).name in result["message"] and "maybe_compute_seq_lens" in result["message"]


# -------------------------------------------------- layers built outside the patched __init__, buffers rewritten in place


def test_layer_made_with_new_works(stack):
    """A layer the patched __init__ did not build (vllm-ascend's unit tests make them with
    __new__): the patched forward builds its state from the layer's own attributes."""
    import torch

    def bare(cls):
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.num_heads, layer.num_kv_heads, layer.head_size, layer.scale = 4, 4, 80, 0.1
        return layer

    bsz, seq, cu, ref_cu = lengths_case("device")
    q, k, v = make_qkv("4d", bsz, seq, 4, 4, 80, seed=71)
    out = bare(stack.patched).forward_oot(q, k, v, cu)
    ref = reference(q, k, v, ref_cu, heads=4, kv_heads=4, head_dim=80, scale=0.1)
    assert max_err(out, ref) < TOL


def test_inference_buffer_rewritten_in_place_between_forwards(stack):
    """Under torch.inference_mode() a tensor has no version counter: a cu_seqlens buffer
    rewritten in place between two forwards must still give the new lengths (one read per
    forward, by the first layer that reads it again)."""
    import torch
    from npu_shim.testing import count_host_syncs, dense_segments

    layers = _stack_of(stack, stack.patched, "visual.blocks.{}.attn")
    q, k, v = make_qkv("4d", 1, 18, 4, 4, 80, seed=72)
    with torch.inference_mode():
        cu = torch.tensor(dense_segments([5, 1, 9, 3]), dtype=torch.int32)
        for lengths in ([5, 1, 9, 3], [2, 10, 3, 3]):
            cu.copy_(torch.tensor(dense_segments(lengths), dtype=torch.int32))
            with count_host_syncs(device_tensors=[cu]) as syncs:
                outs = _forward(layers, q, k, v, cu)
            ref = reference(q, k, v, dense_segments(lengths), heads=4, kv_heads=4, head_dim=80)
            assert syncs.count == 1, syncs.summary()
            assert max(max_err(o, ref) for o in outs) < TOL
    assert cu.is_inference()


# ------------------------------------------------ 5. vllm-ascend 0.15.0rc1 only

# vllm-ascend 0.15.0rc1 takes the seed's prefix-digit cache branch whenever
# vllm_version_is(<the installed vLLM>) is False: with the vLLM it was developed against
# after the lane's (the seed: "requires vllm PR 33674"), or with VLLM_VERSION set
# (vllm-ascend's documented override). These tests set VLLM_VERSION to the next minor
# release of the installed vLLM to reach that upstream code. vllm_version_is is
# functools.cache'd, so its cache is cleared on the way in and out: the same as
# a process started with that VLLM_VERSION.
# the one release whose module keeps seq_lens_cpu_cache (the subject of the tests below)
SEQ_LENS_CPU_CACHE = pytest.mark.claimed(PATCH_NAME, pinned={"vllm-ascend": ("0.15.0rc1",)})


def installed_and_next_vllm():
    """(the installed vLLM's version, the next minor release's) as vllm_version_is spells them."""
    from importlib.metadata import version

    from packaging.version import Version

    installed = Version(version("vllm"))
    return str(installed), "%d.%d.0" % (installed.major, installed.minor + 1)


@pytest.fixture
def cache_branch(stack, monkeypatch):
    from vllm_ascend.utils import vllm_version_is

    if "seq_lens_cpu_cache" not in vars(stack.upstream_module):
        pytest.fail("cache_branch is for the release whose module keeps seq_lens_cpu_cache")
    installed, later = installed_and_next_vllm()
    monkeypatch.setenv("VLLM_VERSION", later)
    vllm_version_is.cache_clear()
    assert not vllm_version_is(installed)
    stack.upstream_module.seq_lens_cpu_cache = None
    yield stack
    stack.upstream_module.seq_lens_cpu_cache = None
    monkeypatch.delenv("VLLM_VERSION")
    vllm_version_is.cache_clear()


@SEQ_LENS_CPU_CACHE
def test_015_prefix_without_digits_raises_upstream_works_patched(cache_branch):
    stack = cache_branch
    with pytest.raises(ValueError, match="invalid literal for int"):
        build(stack, stack.upstream, heads=4, head_dim=64, prefix="vision_tower.attn")
    layer = build(stack, stack.patched, heads=4, head_dim=64, prefix="vision_tower.attn")
    bsz, seq, cu, ref_cu = lengths_case("device")
    q, k, v = make_qkv("4d", bsz, seq, 4, 4, 64)
    out = layer.forward_oot(q, k, v, cu)
    assert max_err(out, reference(q, k, v, ref_cu, heads=4, kv_heads=4, head_dim=64)) < TOL


@SEQ_LENS_CPU_CACHE
def test_015_two_encoders_alternating_upstream_wrong_patched_right(cache_branch):
    import torch
    from npu_shim.testing import count_host_syncs, dense_segments

    stack = cache_branch
    qa, ka, va = make_qkv("4d", 1, 16, 4, 4, 80, seed=31)
    qb, kb, vb = make_qkv("4d", 1, 16, 4, 4, 80, seed=32)
    cu_a = torch.tensor(dense_segments([4, 12]), dtype=torch.int32)
    cu_b = torch.tensor(dense_segments([10, 6]), dtype=torch.int32)
    ref_a = reference(qa, ka, va, cu_a, heads=4, kv_heads=4, head_dim=80)
    ref_b = reference(qb, kb, vb, cu_b, heads=4, kv_heads=4, head_dim=80)

    def alternate(cls):
        tower_a = _stack_of(stack, cls, "visual.blocks.{}.attn")
        tower_b = _stack_of(stack, cls, "video_tower.blocks.{}.attn")
        errors_a, errors_b = [], []
        with count_host_syncs(device_tensors=[cu_a, cu_b]) as syncs:
            for layer_a, layer_b in zip(tower_a, tower_b):
                errors_a.append(max_err(layer_a.forward_oot(qa, ka, va, cu_a), ref_a))
                errors_b.append(max_err(layer_b.forward_oot(qb, kb, vb, cu_b), ref_b))
        return errors_a, errors_b, syncs.count

    up_a, up_b, up_syncs = alternate(stack.upstream)
    # Layer 0 of each tower refreshes the one global; every later layer of tower A
    # reads tower B's lengths.
    assert up_a[0] < TOL and all(e > 1e-2 for e in up_a[1:]), up_a
    assert all(e < TOL for e in up_b)
    assert up_syncs == 2

    ours_a, ours_b, our_syncs = alternate(stack.patched)
    assert max(ours_a + ours_b) < TOL
    assert our_syncs == 2


@SEQ_LENS_CPU_CACHE
def test_015_qwen25_vl_full_attention_layers_get_window_lengths_upstream(cache_branch):
    """The seed's cache refreshes at layer 0, a windowed layer in Qwen2.5-VL: the
    full-attention layers 7/15/23/31 then attend within windows upstream."""
    stack = cache_branch
    q, k, v, cu_full, cu_window, refs = _qwen25_vl_case()
    for cls in (stack.upstream, stack.patched):
        layers = [build(stack, cls, heads=4, head_dim=80, prefix="visual.blocks.%d.attn" % i)
                  for i in range(QWEN25_VL_DEPTH)]
        errors = [max_err(o, r) for o, r in zip(qwen25_vl_like_forward(layers, q, k, v, cu_full,
                                                                       cu_window), refs)]
        wrong = {i for i, e in enumerate(errors) if e > 1e-2}
        right = {i for i, e in enumerate(errors) if e < TOL}
        if cls is stack.upstream:
            assert wrong == set(QWEN25_VL_FULL_ATTENTION), errors
        else:
            assert right == set(range(QWEN25_VL_DEPTH)), errors
        assert wrong | right == set(range(QWEN25_VL_DEPTH))


@SEQ_LENS_CPU_CACHE
def test_015_prefix_with_other_digits_reads_another_encoders_lengths(cache_branch):
    """'visual2.blocks.0.attn' parses to layer index 20: upstream never refreshes for this
    tower and uses whatever the previous encoder cached."""
    import torch
    from npu_shim.testing import dense_segments

    stack = cache_branch
    qa, ka, va = make_qkv("4d", 1, 16, 4, 4, 64, seed=41)
    qb, kb, vb = make_qkv("4d", 1, 16, 4, 4, 64, seed=42)
    cu_a = torch.tensor(dense_segments([4, 12]), dtype=torch.int32)
    cu_b = torch.tensor(dense_segments([10, 6]), dtype=torch.int32)
    ref_b = reference(qb, kb, vb, cu_b, heads=4, kv_heads=4, head_dim=64)

    for cls, ok in ((stack.upstream, False), (stack.patched, True)):
        first = build(stack, cls, heads=4, head_dim=64, prefix="visual.blocks.0.attn")
        second = build(stack, cls, heads=4, head_dim=64, prefix="visual2.blocks.0.attn")
        first.forward_oot(qa, ka, va, cu_a)
        err = max_err(second.forward_oot(qb, kb, vb, cu_b), ref_b)
        assert (err < TOL) if ok else (err > 1e-2), (cls, err)
    assert build(stack, stack.upstream, heads=4, head_dim=64,
                 prefix="visual2.blocks.0.attn").layer_index == 20
