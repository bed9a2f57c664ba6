"""Patch ``vllm.mm_encoder_attn``, fused-infer families (lanes vllm-0.22, latest-vllm).

vllm-ascend 0.22.1rc1 (family v022) and 0.26.0rc1 (family v023, which serves
0.23.0rc1 and later) on the real wheels, with vLLM 0.22.1 / 0.26.0. The only
stand-in is torch_npu (npu-shim's emulation of the documented ops).

Layers are built the way vLLM builds them: vllm-ascend's
``register_ascend_customop`` registers ``AscendMMEncoderAttention`` as the
out-of-tree ``"MMEncoderAttention"``; it also imports every compiled Ascend op,
so this module does only that one registration, with vLLM's own
``CustomOp.register_oot`` (the named stand-in for ``register_ascend_customop``),
and vLLM's ``MMEncoderAttention(...)`` then hands back the Ascend class.

``upstream``: the same vllm-ascend file executed a second time under a module
name the shim does not watch (untouched upstream code, same emulated op).
Every numerical claim is checked against ``npu_shim.testing.attention_f64``.
On this CPU-only machine ``cu_seqlens`` tensors are marked as device stand-ins
for :func:`npu_shim.testing.count_host_syncs`.
"""
import importlib.util
import inspect
import os
import re
import textwrap
import types

import pytest

from npu_shim.testing.claims import claimed_family
from npu_shim.testing.errors import Tolerance

FUSED_INFER = ("npu_shim.patches.vllm_ascend.mm_encoder.v022", "npu_shim.patches.vllm_ascend.mm_encoder.v023")   # where the fused-infer families live
pytestmark = [pytest.mark.claimed("vllm.mm_encoder_attn", implemented_in=FUSED_INFER),
              pytest.mark.patch("vllm.mm_encoder_attn"),
              pytest.mark.float32_math]  # the layer-level math checks: float32 vs float64 (see conftest)

PATCH_NAME = "vllm.mm_encoder_attn"
UPSTREAM_COPY = "npu_shim_tests_upstream_mm_encoder_attention_fia"
LAYERS = 27                                   # MoonViT (Kimi-VL) / Qwen3-VL towers
HEADS, HEAD_DIM = 16, 72                      # MoonViT: padded 72 -> 128 by upstream's rule
IMAGES = (24, 40, 16)                         # three images packed into one sequence
# float32 layer vs float64: measured worst 1.1e-6 (latest-vllm)
TOL = Tolerance("layer FIA float32 vs float64", 8e-6)
# the A2 tower's dtype vs float64 (absolute; |ref| <= ~3): measured worst 7.5e-3 (latest-vllm)
HW_TOL = Tolerance("layer FIA bfloat16 vs float64", 2e-2, "bfloat16")


def import_target_without_ops_init():
    """``vllm_ascend.ops.mm_encoder_attention`` without ``vllm_ascend/ops/__init__.py``
    (it imports compiled Ascend ops); see npu_shim.testing.isolation."""
    os.environ.setdefault("VLLM_PLUGINS", "")  # the lanes use "npu_shim"; never "ascend"
    from npu_shim.testing.isolation import import_vllm_ascend_ops_module

    return import_vllm_ascend_ops_module()


@pytest.fixture(scope="module")
def stack():
    import npu_shim
    from npu_shim import emulation
    from vllm.config import DeviceConfig, VllmConfig
    from vllm.model_executor.custom_op import CustomOp, op_registry_oot

    emulation.install()
    npu_shim.install()
    module = import_target_without_ops_init()
    row = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)
    assert row["state"] == "applied", row
    if "MMEncoderAttention" not in op_registry_oot:
        # Stand-in for vllm_ascend.utils.register_ascend_customop (see the module docstring).
        CustomOp.register_oot(module.AscendMMEncoderAttention, name="MMEncoderAttention")

    spec = importlib.util.spec_from_file_location(UPSTREAM_COPY, module.__file__)
    upstream_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upstream_module)
    version = row["versions"]["vllm-ascend"]
    return types.SimpleNamespace(
        module=module, patched=module.AscendMMEncoderAttention,
        upstream=upstream_module.AscendMMEncoderAttention, upstream_module=upstream_module,
        config=VllmConfig(device_config=DeviceConfig(device="cpu")), status=row,
        version=version, family=claimed_family(PATCH_NAME).name,
        family_module=claimed_family(PATCH_NAME).implementation,
        ignores_scale=claimed_family(PATCH_NAME).implementation == FUSED_INFER[0])   # the v022 family's code


def npu_shim_stats():
    import npu_shim

    return npu_shim.stats()


def vllm_layers(stack, n, *, heads=HEADS, head_dim=HEAD_DIM, kv_heads=None, scale=None,
                prefix="vision_tower.encoder.blocks.%d.attn"):
    """``n`` layers from vLLM's own constructor (which hands back the Ascend class)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    with set_current_vllm_config(stack.config):
        layers = [MMEncoderAttention(num_heads=heads, head_size=head_dim, scale=scale,
                                     num_kv_heads=kv_heads, prefix=prefix % i) for i in range(n)]
    assert all(type(layer) is stack.patched for layer in layers)
    return layers


def upstream_layers(stack, n, **kw):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(stack.config):
        return [stack.upstream(num_heads=kw.get("heads", HEADS), head_size=kw.get("head_dim", HEAD_DIM),
                               scale=kw.get("scale"), num_kv_heads=kw.get("kv_heads"))
                for _ in range(n)]


def cu_tensor(lengths):
    import torch
    from npu_shim.testing import dense_segments

    return torch.tensor(dense_segments(lengths), dtype=torch.int32)


def moonvit_qkv(tokens, *, heads=HEADS, head_dim=HEAD_DIM, seed=0, dtype=None):
    """MoonViT's ``attention_qkvpacked``: q/k/v are unbound views of one packed
    (S, 3, N, D) tensor, each handed over as ``x.unsqueeze(0)`` (1, S, N, D)."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    xqkv = torch.randn(tokens, 3, heads, head_dim, generator=gen).to(dtype or torch.float32)
    return tuple(x.unsqueeze(0) for x in torch.unbind(xqkv, dim=-3))


def reference(q, k, v, cu, scale=None):
    from npu_shim.testing import attention_f64

    flat = [x.reshape(-1, x.shape[-2], x.shape[-1]) for x in (q, k, v)]
    return attention_f64(*flat, cu, scale=scale).reshape(q.shape)


def max_err(out, ref):
    return (out.double() - ref).abs().max().item()


def tower(layers, q, k, v, cu, **kw):
    """One encoder forward: every layer once, as the towers' ``for blk in self.blocks``."""
    return [layer.forward_oot(q, k, v, cu_seqlens=cu, **kw) for layer in layers]


# ---------------------------------------------------------------- status, shape


def test_status_names_the_family_and_only_forward_oot_is_replaced(stack):
    from npu_shim.engine import counters

    assert stack.status["family"] == stack.family
    assert stack.status["reason"] == "vllm-ascend %s" % stack.version
    assert npu_shim_stats()[PATCH_NAME]["family"] == stack.family
    ours = vars(stack.patched)["forward_oot"]
    assert ours.__code__.co_filename.endswith(os.path.join("patches", "vllm_ascend", "mm_encoder", "fia.py"))
    assert ours.__wrapped_upstream__.__code__.co_filename == stack.module.__file__
    assert inspect.signature(ours) == inspect.signature(vars(stack.upstream)["forward_oot"])
    assert vars(stack.patched)["__init__"].__code__.co_filename == stack.module.__file__


def test_each_family_refuses_the_other_ones_code(stack):
    """Decided by structure: v022 refuses 0.23+'s class and v023 refuses 0.22.1rc1's."""
    from npu_shim.patch import FamilyContext, TargetMismatch
    from npu_shim.patches.vllm_ascend.mm_encoder import v022, v023

    accepting, refusing = (v022, v023) if stack.family_module == v022.__name__ else (v023, v022)
    accepting.check(stack.upstream, FamilyContext(PATCH_NAME))
    with pytest.raises(TargetMismatch):
        refusing.check(stack.upstream, FamilyContext(PATCH_NAME))


def test_structural_check_refuses_a_changed_op_call(stack):
    """A class of this release whose ``_run_vit_fia`` calls another op: refused, with its name."""
    from npu_shim.engine import guards
    from npu_shim.patch import TargetMismatch
    from npu_shim.patches.vllm_ascend.mm_encoder_attn import PATCH

    def _run_vit_fia(self, query, key, value, *args, **kwargs):
        return stack.upstream_module.torch_npu.npu_fusion_attention(query, key, value)

    changed = type("AscendMMEncoderAttention", (stack.upstream,), {
        "forward_oot": vars(stack.upstream)["forward_oot"],
        "_forward_eager_fia": vars(stack.upstream)["_forward_eager_fia"],
        "_run_vit_fia": _run_vit_fia})
    with pytest.raises(TargetMismatch, match="%s .*_run_vit_fia no longer refers to "
                       "npu_fused_infer_attention_score" % re.escape(stack.family)):
        guards.select_family(PATCH, types.SimpleNamespace(__name__="changed", AscendMMEncoderAttention=changed))


# ------------------------------------------------------ MoonViT: copies, numbers


def test_moonvit_27_layers_one_copy_per_forward_same_output_as_upstream(stack):
    import torch
    from npu_shim.testing import count_host_syncs, record_npu_calls

    q, k, v = moonvit_qkv(sum(IMAGES))
    cu = cu_tensor(IMAGES)
    patched = vllm_layers(stack, LAYERS, scale=HEAD_DIM ** -0.5)   # MoonViT passes its scale
    upstream = upstream_layers(stack, LAYERS, scale=HEAD_DIM ** -0.5)
    with torch.inference_mode():
        with count_host_syncs(device_tensors=[cu]) as ours, record_npu_calls() as our_calls:
            outs = tower(patched, q, k, v, cu)
        with count_host_syncs(device_tensors=[cu]) as theirs, record_npu_calls() as their_calls:
            expected = tower(upstream, q, k, v, cu)
    assert theirs.count == LAYERS, theirs.summary()    # upstream: one copy per layer
    assert ours.count == 1, ours.summary()
    ref = reference(q, k, v, cu)
    for out, exp in zip(outs, expected):
        assert out.shape == exp.shape == q.shape and out.is_contiguous()
        assert torch.equal(out, exp)
        assert max_err(out, ref) < TOL
    # The op call is upstream's: same op, same arguments, once per layer.
    assert [c.name for c in our_calls] == [c.name for c in their_calls] == \
        ["npu_fused_infer_attention_score"] * LAYERS
    for ours_call, theirs_call in zip(our_calls, their_calls):
        assert ours_call.kwargs.keys() == theirs_call.kwargs.keys()
        for name, value in theirs_call.kwargs.items():
            mine = ours_call.kwargs[name]
            if isinstance(value, torch.Tensor):
                assert mine.shape == value.shape and torch.equal(mine, value), name
            else:
                assert mine == value, name
    call = our_calls[0].kwargs
    assert call["input_layout"] == "TND" and call["sparse_mode"] == 0 and call["block_size"] == 128
    assert call["actual_seq_lengths"] == call["actual_seq_lengths_kv"] == [24, 64, 80]


@pytest.mark.hardware_dtypes
def test_bfloat16_as_on_a2(stack):
    """What the A2 tower runs: bfloat16 (the op takes no float32). Equal to upstream bit for
    bit at the default scale, the model's scale honoured, within the bfloat16 tolerance of
    float64. A scale off by 1e-3 moves the output by less than bfloat16 resolves: the
    float32 checks of this module are what catch that."""
    import torch

    q, k, v = moonvit_qkv(sum(IMAGES), seed=3, dtype=torch.bfloat16)
    cu = cu_tensor(IMAGES)
    with torch.inference_mode():
        outs = tower(vllm_layers(stack, 3), q, k, v, cu)
        expected = tower(upstream_layers(stack, 3), q, k, v, cu)
        scaled = vllm_layers(stack, 1, scale=0.05)[0].forward_oot(q, k, v, cu_seqlens=cu)
    assert all(o.dtype == torch.bfloat16 and torch.equal(o, e) for o, e in zip(outs, expected))
    assert max_err(outs[-1], reference(q, k, v, cu)) < HW_TOL
    assert max_err(scaled, reference(q, k, v, cu, scale=0.05)) < HW_TOL


def test_non_default_scale(stack):
    """The model's scale is honoured; upstream 0.22.1rc1 uses head_size ** -0.5 instead."""
    import torch

    scale = 0.05
    q, k, v = moonvit_qkv(sum(IMAGES), seed=1)
    cu = cu_tensor(IMAGES)
    ref = reference(q, k, v, cu, scale=scale)
    with torch.inference_mode():
        out = vllm_layers(stack, 1, scale=scale)[0].forward_oot(q, k, v, cu_seqlens=cu)
        expected = upstream_layers(stack, 1, scale=scale)[0].forward_oot(q, k, v, cu_seqlens=cu)
    assert max_err(out, ref) < TOL
    if stack.ignores_scale:
        assert max_err(expected, ref) > 0.5      # the upstream bug, reproduced
    else:
        assert max_err(expected, ref) < TOL


@pytest.mark.parametrize("head_dim", [64, 80, 128])
def test_head_dims_and_3d_inputs(stack, head_dim):
    import torch

    heads, tokens = 4, sum(IMAGES)
    gen = torch.Generator().manual_seed(head_dim)
    q, k, v = (torch.randn(1, tokens, heads * head_dim, generator=gen) for _ in range(3))
    cu = cu_tensor(IMAGES)
    with torch.inference_mode():
        out = vllm_layers(stack, 1, heads=heads, head_dim=head_dim)[0].forward_oot(q, k, v, cu)
        expected = upstream_layers(stack, 1, heads=heads, head_dim=head_dim)[0].forward_oot(q, k, v, cu)
    assert out.shape == expected.shape == (1, tokens, heads * head_dim)
    assert torch.equal(out, expected)
    ref = reference(q.view(1, tokens, heads, head_dim), k.view(1, tokens, heads, head_dim),
                    v.view(1, tokens, heads, head_dim), cu).reshape(out.shape)
    assert max_err(out, ref) < TOL


def test_bfloat16_keeps_dtype(stack):
    import torch

    q, k, v = (x.to(torch.bfloat16) for x in moonvit_qkv(sum(IMAGES), seed=2))
    cu = cu_tensor(IMAGES)
    with torch.inference_mode():
        out = vllm_layers(stack, 1)[0].forward_oot(q, k, v, cu)
    assert out.dtype == torch.bfloat16
    assert max_err(out, reference(q, k, v, cu)) < 2e-2


def test_gqa_kv_heads_match_the_tensors(stack):
    """Upstream repeats K/V to num_heads but passes num_key_value_heads=num_kv_heads: the
    documented op takes K/V of (T, num_key_value_heads, D), and the emulation rejects that
    call. The family passes the head count of the K/V it hands over."""
    import torch
    from npu_shim.testing import record_npu_calls

    heads, kv_heads, head_dim = 8, 2, 64
    tokens = sum(IMAGES)
    gen = torch.Generator().manual_seed(3)
    q = torch.randn(1, tokens, heads, head_dim, generator=gen)
    k, v = (torch.randn(1, tokens, kv_heads, head_dim, generator=gen) for _ in range(2))
    cu = cu_tensor(IMAGES)
    with torch.inference_mode(), record_npu_calls() as calls:
        out = vllm_layers(stack, 1, heads=heads, head_dim=head_dim, kv_heads=kv_heads)[0] \
            .forward_oot(q, k, v, cu)
    assert calls[0].kwargs["num_key_value_heads"] == calls[0].kwargs["key"].shape[1] == heads
    assert max_err(out, reference(q, k, v, cu)) < TOL
    upstream = upstream_layers(stack, 1, heads=heads, head_dim=head_dim, kv_heads=kv_heads)[0]
    with pytest.raises(ValueError, match="TND key/value must be"):
        upstream.forward_oot(q, k, v, cu)


def test_no_cu_seqlens_uniform_lengths_no_copy(stack):
    """Models passing cu_seqlens=None (Hunyuan-OCR): equal lengths built on the host, as
    upstream does; with q/k/v on the device nothing is read back."""
    import torch
    from npu_shim.testing import count_host_syncs

    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(3, 7, 4, 64, generator=gen) for _ in range(3))
    layer = vllm_layers(stack, 1, heads=4, head_dim=64)[0]
    with torch.inference_mode(), count_host_syncs(device_tensors=[q, k, v]) as syncs:
        out = layer.forward_oot(q, k, v, None)
    assert syncs.count == 0, syncs.summary()
    assert max_err(out, reference(q, k, v, [0, 7, 14, 21])) < TOL


# ------------------------------------------------ the towers' own length inputs


@pytest.fixture
def no_pinned_memory(monkeypatch):
    """vLLM 0.26's ``async_tensor_h2d`` pins host memory when its platform says it can; this
    machine has no accelerator to pin for (pinning raises), so the copy stays unpinned."""
    import vllm.utils.torch_utils as torch_utils

    if hasattr(torch_utils, "PIN_MEMORY"):
        monkeypatch.setattr(torch_utils, "PIN_MEMORY", False)


def vllm_lengths(layer, lengths):
    """What vLLM's towers hand the layers: host ``sequence_lengths`` from
    ``MMEncoderAttention.maybe_compute_seq_lens`` (None where the class no longer has
    one) and the device ``cu_seqlens`` from ``maybe_recompute_cu_seqlens``."""
    import numpy as np
    import torch
    from npu_shim.testing import dense_segments
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    cu_np = np.array(dense_segments(lengths), dtype=np.int32)
    device = torch.device("cpu")
    seq = MMEncoderAttention.maybe_compute_seq_lens(layer.attn_backend, cu_np, device)
    cu = MMEncoderAttention.maybe_recompute_cu_seqlens(layer.attn_backend, cu_np,
                                                       layer.num_heads * layer.head_size, 1, device)
    return cu, seq


def vllms_copy_is_kept():
    """Whether ``vllm.mm_encoder_host_lengths`` keeps the host array behind the
    ``cu_seqlens`` that ``maybe_recompute_cu_seqlens`` returns (then the layers read
    nothing back; tests/lanes/test_mm_encoder_host_lengths.py)."""
    import npu_shim

    return next(r for r in npu_shim.status() if r["name"] == "vllm.mm_encoder_host_lengths")["state"] == "applied"


def test_qwen3_vl_with_vllms_sequence_lengths(stack, no_pinned_memory):
    import torch
    from npu_shim.testing import count_host_syncs

    patched = vllm_layers(stack, LAYERS, heads=4, head_dim=64)
    upstream = upstream_layers(stack, LAYERS, heads=4, head_dim=64)
    cu, seq = vllm_lengths(patched[0], IMAGES)
    assert (seq is not None) == stack.ignores_scale   # 0.22.1rc1 has maybe_compute_seq_lens
    if seq is not None:
        assert seq.device.type == "cpu" and seq.tolist() == list(IMAGES)
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(1, sum(IMAGES), 4, 64, generator=gen) for _ in range(3))
    with torch.inference_mode():
        with count_host_syncs(device_tensors=[cu]) as ours:
            outs = tower(patched, q, k, v, cu, sequence_lengths=seq)
        with count_host_syncs(device_tensors=[cu]) as theirs:
            expected = tower(upstream, q, k, v, cu, sequence_lengths=seq)
    # 0.22.1rc1: host lengths from vLLM, no copy either way; 0.23+: upstream ignores them.
    assert theirs.count == (0 if seq is not None else LAYERS), theirs.summary()
    assert ours.count == (0 if seq is not None or vllms_copy_is_kept() else 1), ours.summary()
    ref = reference(q, k, v, cu)
    assert all(torch.equal(o, e) for o, e in zip(outs, expected))
    assert max_err(outs[-1], ref) < TOL


def test_qwen25_vl_full_and_window_layers_at_most_two_copies(stack, no_pinned_memory):
    """Qwen2.5-VL: 32 blocks, full attention in 7/15/23/31 (cu_seqlens), windowed elsewhere
    (cu_window_seqlens): two tensors, at most two copies per forward."""
    import torch
    from npu_shim.testing import count_host_syncs

    full_blocks = {7, 15, 23, 31}
    layers = vllm_layers(stack, 32, heads=4, head_dim=80, prefix="visual.blocks.%d.attn.attn")
    full, window = (64, 36), (16, 16, 16, 16, 9, 9, 9, 9)
    cu_full, seq_full = vllm_lengths(layers[0], full)
    cu_window, seq_window = vllm_lengths(layers[0], window)
    gen = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(1, 100, 4, 80, generator=gen) for _ in range(3))
    outs = {}
    with torch.inference_mode(), count_host_syncs(device_tensors=[cu_full, cu_window]) as syncs:
        for i, layer in enumerate(layers):
            cu, seq = (cu_full, seq_full) if i in full_blocks else (cu_window, seq_window)
            outs[i] = layer.forward_oot(q, k, v, cu_seqlens=cu, sequence_lengths=seq)
    assert syncs.count == (0 if seq_full is not None or vllms_copy_is_kept() else 2), syncs.summary()
    assert max_err(outs[31], reference(q, k, v, cu_full)) < TOL
    assert max_err(outs[30], reference(q, k, v, cu_window)) < TOL


# ----------------------------------------------------- per-forward host lengths


def test_second_forward_with_new_lengths(stack):
    import torch
    from npu_shim.testing import count_host_syncs

    layers = vllm_layers(stack, 4, heads=4, head_dim=64)
    for lengths in (IMAGES, (10, 30, 20, 20)):
        cu = cu_tensor(lengths)
        gen = torch.Generator().manual_seed(len(lengths))
        q, k, v = (torch.randn(1, sum(lengths), 4, 64, generator=gen) for _ in range(3))
        with torch.inference_mode(), count_host_syncs(device_tensors=[cu]) as syncs:
            outs = tower(layers, q, k, v, cu)
        assert syncs.count == 1, syncs.summary()
        assert max(max_err(o, reference(q, k, v, cu)) for o in outs) < TOL


def test_cu_seqlens_buffer_rewritten_in_place_between_forwards(stack):
    """Under inference mode tensors have no version counter: a buffer vLLM reuses and rewrites
    in place must still be read again by the next forward."""
    import torch

    layers = vllm_layers(stack, 4, heads=4, head_dim=64)
    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(1, 80, 4, 64, generator=gen) for _ in range(3))
    with torch.inference_mode():
        buffer = cu_tensor(IMAGES)
        first = tower(layers, q, k, v, buffer)
        buffer.copy_(cu_tensor((60, 4, 16)))
        second = tower(layers, q, k, v, buffer)
    assert max(max_err(o, reference(q, k, v, cu_tensor(IMAGES))) for o in first) < TOL
    assert max(max_err(o, reference(q, k, v, cu_tensor((60, 4, 16)))) for o in second) < TOL


def test_two_towers_alternating(stack):
    import torch
    from npu_shim.testing import count_host_syncs

    a = vllm_layers(stack, 3, heads=4, head_dim=64, prefix="visual.blocks.%d.attn")
    b = vllm_layers(stack, 3, heads=4, head_dim=64, prefix="visual.blocks.%d.attn")  # same prefixes
    cu_a, cu_b = cu_tensor(IMAGES), cu_tensor((20, 60))
    gen = torch.Generator().manual_seed(8)
    q, k, v = (torch.randn(1, 80, 4, 64, generator=gen) for _ in range(3))
    outs = []
    with torch.inference_mode(), count_host_syncs(device_tensors=[cu_a, cu_b]) as syncs:
        for _ in range(2):
            for layer_a, layer_b in zip(a, b):
                outs.append((layer_a.forward_oot(q, k, v, cu_a), layer_b.forward_oot(q, k, v, cu_b)))
    assert syncs.count == 4, syncs.summary()   # one per tower per forward
    ref_a, ref_b = reference(q, k, v, cu_a), reference(q, k, v, cu_b)
    assert max(max(max_err(out_a, ref_a), max_err(out_b, ref_b)) for out_a, out_b in outs) < TOL


def test_layer_made_with_new(stack):
    """As vllm-ascend's own unit tests make layers: ``__new__`` plus the attributes."""
    import torch

    layer = stack.patched.__new__(stack.patched)
    torch.nn.Module.__init__(layer)
    layer.num_heads, layer.num_kv_heads, layer.head_size, layer.scale = 4, 4, 72, 0.1
    q, k, v = moonvit_qkv(sum(IMAGES), heads=4, seed=9)
    cu = cu_tensor(IMAGES)
    with torch.inference_mode():
        out = layer.forward_oot(q, k, v, cu)
    assert max_err(out, reference(q, k, v, cu, scale=0.1)) < TOL


# ----------------------------------------------------------------- graph path


def test_capture_hands_the_call_to_upstream_untouched(stack, monkeypatch):
    """While vllm-ascend's encoder ACL-graph capture is active, upstream's forward_oot runs
    (its _forward_capture_fia records the graph ops, which the emulation does not have)."""
    import torch
    from npu_shim.engine import counters
    from vllm_ascend.worker.encoder_acl_graph import set_encoder_forward_context

    seen = []

    def capture_fia(self, query, key, value, **kwargs):
        seen.append((query.shape, kwargs))
        return "upstream capture result"

    monkeypatch.setattr(stack.patched, "_forward_capture_fia", capture_fia)
    layer = vllm_layers(stack, 1, heads=4, head_dim=64)[0]
    q, k, v = (torch.zeros(1, 8, 4, 64) for _ in range(3))
    before = dict(counters.snapshot()[PATCH_NAME])
    with set_encoder_forward_context(2048, True):
        result = layer.forward_oot(q, k, v, cu_seqlens=cu_tensor((8,)))
    after = counters.snapshot()[PATCH_NAME]
    assert result == "upstream capture result"
    assert seen and seen[0][0] == (8, 4, 64) and seen[0][1]["cu_seqlens"].tolist() == [0, 8]
    assert after["upstream_calls"] == before["upstream_calls"] + 1
    assert after["calls"] == before["calls"]
    with torch.inference_mode():    # capture over: the shim's eager path again
        layer.forward_oot(q, k, v, cu_seqlens=cu_tensor((8,)))
    assert counters.snapshot()[PATCH_NAME]["calls"] == after["calls"] + 1


def test_selftest_runs_this_family(stack):
    from npu_shim.selftest import run_one

    result = run_one(PATCH_NAME, device="cpu")
    assert result["ok"], result["verdict"]
    assert (result["host_syncs"], result["expected_host_syncs"]) == (1, 1)
    assert "family %s" % stack.family in result["detail"]
    assert "npu_fused_infer_attention_score" in result["detail"]


# ------------------------------------------------------ disabled, uninstall


SUBPROCESS_BODY = r'''
import json, torch, npu_shim
from npu_shim import emulation
emulation.install()
from npu_shim.emulation.dtypes import float32_not_on_hardware
_float32 = float32_not_on_hardware(); _float32.__enter__()   # this module's float32 math checks (float32_math)
module = import_target_without_ops_init()
row = next(r for r in npu_shim.status() if r["name"] == "vllm.mm_encoder_attn")
cls = module.AscendMMEncoderAttention
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    layer = cls(num_heads=4, head_size=72, scale=0.05)
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 18, 4, 72, generator=gen) for _ in range(3))
with torch.inference_mode():
    out = layer.forward_oot(q, k, v, torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32))
torch.save(out, OUT)
print(json.dumps({"state": row["state"], "forward_file": cls.forward_oot.__code__.co_filename,
                  "module_file": module.__file__}))
'''


@pytest.mark.claimed(PATCH_NAME, implemented_in=FUSED_INFER, per_family=True)   # fresh interpreters: one lane per family
def test_disabled_is_exactly_upstream(stack, run_python, make_env, tmp_path):
    import json

    import torch

    out = tmp_path / "out.pt"
    code = "\n".join(["import os", "OUT = %r" % str(out),
                      textwrap.dedent(inspect.getsource(import_target_without_ops_init)),
                      SUBPROCESS_BODY])
    proc = run_python(code, env=make_env(VLLM_PLUGINS="", NPU_SHIM_DISABLE=PATCH_NAME), timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["state"] == "disabled", result
    assert result["forward_file"] == result["module_file"]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 18, 4, 72, generator=gen) for _ in range(3))
    with torch.inference_mode():
        expected = upstream_layers(stack, 1, heads=4, head_dim=72, scale=0.05)[0].forward_oot(
            q, k, v, torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32))
    assert torch.equal(torch.load(out), expected)


def test_uninstall_restores_and_install_reapplies(stack):
    import npu_shim

    original = vars(stack.patched)["forward_oot"].__wrapped_upstream__
    npu_shim.uninstall()
    try:
        assert vars(stack.patched)["forward_oot"] is original
        assert vars(stack.patched)["forward_oot"].__code__.co_filename == stack.module.__file__
    finally:
        npu_shim.install()
    row = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)
    assert row["state"] == "applied" and row["family"] == stack.family
    assert vars(stack.patched)["forward_oot"] is not original


# ------------------------------- NPU_SHIM_MM_ENCODER_FUSION_ATTENTION (vllm-ascend #13699)

FUSION_SWITCH = "NPU_SHIM_MM_ENCODER_FUSION_ATTENTION"
# The keyword arguments of family 0.18.0's call (v018.attend), and of the FIA call it replaces.
FUSION_CALL = {"query", "key", "value", "actual_seq_qlen", "actual_seq_kvlen", "head_num", "scale", "input_layout"}


def op_spies(monkeypatch, torch_npu):
    """Count the calls of the fused-infer and fusion ops of ``torch_npu`` (keyword arguments kept)."""
    calls = {"npu_fused_infer_attention_score": [], "npu_fusion_attention": []}
    for name, seen in calls.items():
        real = getattr(torch_npu, name)

        def spy(*args, _real=real, _seen=seen, **kwargs):
            _seen.append((args, kwargs))
            return _real(*args, **kwargs)

        monkeypatch.setattr(torch_npu, name, spy)
    return calls


def family_forward(stack, switch_on):
    """The installed family's ``forward_oot`` built on vllm-ascend's untouched class with the
    switch on or off (read when the family is built, as at install)."""
    from npu_shim import _config
    from npu_shim.patch import FamilyContext
    from npu_shim.patches.vllm_ascend.mm_encoder import fia
    from npu_shim.testing import claims

    family = claims.claimed_family(PATCH_NAME).load()
    previous = _config.use_settings(_config.Settings({FUSION_SWITCH: "1"} if switch_on else {}))
    try:
        context = FamilyContext(PATCH_NAME, module=family.__name__)
        context.found = family.check(stack.upstream, context)      # as the engine hands build
        return fia.build_forward(stack.upstream, family.host_lengths, context)["forward_oot"]
    finally:
        _config.use_settings(previous)


def test_fusion_switch_is_off_by_default_and_status_shows_it(stack, monkeypatch):
    import npu_shim
    from npu_shim import _config

    assert _config.Settings({}).mm_encoder_fusion_attention is False
    assert _config.Settings({FUSION_SWITCH: "1"}).mm_encoder_fusion_attention is True
    row = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)
    assert row["switches"] == {"NPU_SHIM_MM_ENCODER_TND": False, FUSION_SWITCH: False}, row["switches"]
    # the installed layer (switch off) makes upstream's FIA call
    calls = op_spies(monkeypatch, stack.module.torch_npu)
    q, k, v = moonvit_qkv(sum(IMAGES))
    layers = vllm_layers(stack, 3)
    tower(layers, q, k, v, cu_tensor(IMAGES))
    assert (len(calls["npu_fused_infer_attention_score"]), len(calls["npu_fusion_attention"])) == (3, 0)


def test_fusion_switch_makes_the_018_call_not_fia(stack, monkeypatch):
    """Switch on: not one FIA call; every layer makes family 0.18.0's npu_fusion_attention call
    (TND, one list of cumulative 0-d host tensors for queries and keys, the model's scale), one
    device->host read per forward, output within tolerance of the float64 reference and of the
    FIA path's output."""
    import torch

    from npu_shim.testing import count_host_syncs

    scale = 0.07
    q, k, v = moonvit_qkv(sum(IMAGES), seed=3)
    cu = cu_tensor(IMAGES)
    layers = upstream_layers(stack, 3, scale=scale)
    fia_forward, fusion_forward = family_forward(stack, False), family_forward(stack, True)
    calls = op_spies(monkeypatch, stack.upstream_module.torch_npu)
    with count_host_syncs(device_tensors=[cu]) as syncs:
        outs = [fusion_forward(layer, q, k, v, cu_seqlens=cu) for layer in layers]
    assert syncs.count == 1, syncs.summary()
    assert calls["npu_fused_infer_attention_score"] == []
    assert len(calls["npu_fusion_attention"]) == len(layers)
    for args, kwargs in calls["npu_fusion_attention"]:
        assert args == () and set(kwargs) == FUSION_CALL, sorted(kwargs)
        assert kwargs["input_layout"] == "TND" and kwargs["head_num"] == HEADS and kwargs["scale"] == scale
        assert kwargs["query"].shape == (sum(IMAGES), HEADS, 128)                 # 72 padded, as upstream
        cumulative = kwargs["actual_seq_qlen"]
        assert kwargs["actual_seq_kvlen"] is cumulative
        assert all(isinstance(n, torch.Tensor) and n.dim() == 0 and n.device.type == "cpu" for n in cumulative)
        assert [int(n) for n in cumulative] == torch.tensor(IMAGES).cumsum(0).tolist()
    ref = reference(q, k, v, cu, scale=scale)
    for out in outs:
        assert out.shape == q.shape
        assert max_err(out, ref) < TOL
    fia_outs = [fia_forward(layer, q, k, v, cu_seqlens=cu) for layer in layers]
    assert len(calls["npu_fused_infer_attention_score"]) == len(layers)
    assert max_err(outs[0], fia_outs[0].double()) < TOL


def test_fusion_switch_refuses_different_query_and_key_lengths(stack):
    import torch

    from npu_shim.patches.vllm_ascend.mm_encoder import fia

    q = torch.zeros(6, 2, 64)
    with pytest.raises(ValueError, match="NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1 .* query lengths \\[2, 6\\] "
                                         "and key lengths \\[4, 12\\]"):
        fia.fusion_attention(vars(stack.upstream_module), q, q, q, [2, 6], [4, 12], 2, 0.1)


FUSION_BODY = r'''
calls = []
real = module.torch_npu.npu_fusion_attention
def spy(*a, **kw):
    calls.append(sorted(kw))
    return real(*a, **kw)
module.torch_npu.npu_fusion_attention = spy
with torch.inference_mode():
    again = layer.forward_oot(q, k, v, torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32))
print(json.dumps({"switches": row["switches"], "family": row["family"], "fusion_calls": calls,
                  "table": [l for l in __import__("npu_shim.cli", fromlist=["x"])._status_table([row]).splitlines()
                            if "vllm.mm_encoder_attn" in l]}))
'''


@pytest.mark.claimed(PATCH_NAME, implemented_in=FUSED_INFER, per_family=True)   # one lane per fused-infer family
def test_fusion_switch_in_a_fresh_interpreter(stack, run_python, make_env, tmp_path):
    """NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1 in the environment: the installed patch makes the
    0.18.0 call, status (JSON and table) shows the switch on, output near the FIA path's."""
    import json

    import torch

    out = tmp_path / "out.pt"
    code = "\n".join(["import os", "OUT = %r" % str(out),
                      textwrap.dedent(inspect.getsource(import_target_without_ops_init)),
                      SUBPROCESS_BODY, FUSION_BODY])
    proc = run_python(code, env=make_env(VLLM_PLUGINS="", **{FUSION_SWITCH: "1"}), timeout=300)
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    assert result["family"] == stack.family, result
    assert result["switches"][FUSION_SWITCH] is True, result
    assert result["fusion_calls"] == [sorted(FUSION_CALL)], result
    assert "NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1" in result["table"][0], result["table"]
    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 18, 4, 72, generator=gen) for _ in range(3))
    ref = reference(q, k, v, [0, 5, 6, 15, 18], scale=0.05)
    assert max_err(torch.load(out), ref) < TOL
