"""``vllm.mm_encoder_attn`` on vllm-ascend 0.18.0 (family v018) and 0.21.0rc1 (family v019).

Real upstream code at the pinned versions: vLLM's ``MMEncoderAttention`` and
vllm-ascend's ``AscendMMEncoderAttention``; the only stand-in is torch_npu
(npu-shim's emulation). Layers are built the way vLLM builds them: the Ascend
class is registered as the out-of-tree ``"MMEncoderAttention"`` with
``CustomOp.register_oot`` -- a named stand-in for vllm-ascend's
``register_ascend_customop``, which imports every compiled Ascend op -- and
vLLM's own ``MMEncoderAttention(...)`` constructor hands back the Ascend class.
Towers are driven as vLLM's drive them (one call per block, under
``torch.inference_mode()``): MoonViT with its packed-QKV views and a
``cu_seqlens`` built on the device; Qwen3-VL with the host ``sequence_lengths``
of vLLM's ``MMEncoderAttention.maybe_compute_seq_lens``.

``stack.upstream`` is the same upstream file executed a second time under a
module name the shim does not watch: untouched upstream code. On this CPU-only
machine ``cu_seqlens`` tensors are marked as device stand-ins for
:func:`npu_shim.testing.count_host_syncs`. Every numerical claim is checked
against ``npu_shim.testing.attention_f64``.
"""
import importlib.util
import inspect
import textwrap
import types

import pytest

import npu_shim
from npu_shim.testing.errors import Tolerance

pytestmark = [pytest.mark.claimed("vllm.mm_encoder_attn", implemented_in=("npu_shim.patches.vllm_ascend.mm_encoder.v018", "npu_shim.patches.vllm_ascend.mm_encoder.v019")),
              pytest.mark.patch("vllm.mm_encoder_attn"),
              pytest.mark.float32_math]  # the layer-level math checks: float32 vs float64 (see conftest)

PATCH_NAME = "vllm.mm_encoder_attn"
UPSTREAM_COPY = "npu_shim_tests_upstream_mm_encoder_attention_018"
OOT_NAME = "MMEncoderAttention"
LAYERS = 27                      # MoonViT (Kimi-VL) and Qwen3-VL-8B vision towers
HEADS, HEAD_DIM = 16, 72         # both towers: 1152 = 16 x 72 (padded to 128 upstream)
# max |layer - float64| (absolute; inputs N(0, 1)): float32 measured worst 9.9e-7 (vllm-0.18)
TOL = Tolerance("layer 0.18 float32 vs float64", 9e-6)
# the A2 tower's dtype: bfloat16 measured worst 7.3e-3 (vllm-0.18)
HW_TOL = Tolerance("layer 0.18 bfloat16 vs float64", 2e-2, "bfloat16")


def family_module(name):
    """The module of the family ``name`` of the patch under test (its replacements name it)."""
    from npu_shim.patches.vllm_ascend.mm_encoder_attn import PATCH

    return next(f.implementation for f in PATCH.families if f.name == name)


def expected_family():
    """The family the declaration claims for the installed release (its fences)."""
    from npu_shim.testing.claims import claimed_family

    return claimed_family(PATCH_NAME).name


@pytest.fixture(scope="module")
def stack():
    import npu_shim
    from npu_shim import emulation
    from npu_shim.testing.isolation import import_vllm_ascend_ops_module

    emulation.install()
    npu_shim.install()
    module = import_vllm_ascend_ops_module()
    row = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)
    assert row["state"] == "applied", row

    spec = importlib.util.spec_from_file_location(UPSTREAM_COPY, module.__file__)
    upstream_module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upstream_module)

    from vllm.config import DeviceConfig, VllmConfig
    from vllm.model_executor import custom_op
    from vllm.model_executor.custom_op import CustomOp
    from vllm.platforms import current_platform

    assert current_platform.device_type in ("cpu", ""), current_platform
    # Stand-in for vllm_ascend.utils.register_ascend_customop (imports every compiled op):
    # register just this class, under the name vllm-ascend registers it.
    assert OOT_NAME not in custom_op.op_registry_oot
    CustomOp.register_oot(_decorated_op_cls=module.AscendMMEncoderAttention, name=OOT_NAME)
    try:
        yield types.SimpleNamespace(
            module=module, patched=module.AscendMMEncoderAttention,
            upstream_module=upstream_module, upstream=upstream_module.AscendMMEncoderAttention,
            config=VllmConfig(device_config=DeviceConfig(device="cpu")), status=row,
            version=row["versions"]["vllm-ascend"])
    finally:
        custom_op.op_registry_oot.pop(OOT_NAME, None)


def vllm_layer(stack, *, scale=None, heads=HEADS, head_dim=HEAD_DIM, kv_heads=None, prefix="vision_tower.encoder.blocks.0.attn"):
    """A layer built by vLLM's own MMEncoderAttention constructor (OOT dispatch)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    with set_current_vllm_config(stack.config):
        return MMEncoderAttention(num_heads=heads, head_size=head_dim, scale=scale,
                                  num_kv_heads=kv_heads, prefix=prefix)


def upstream_layer(stack, *, scale=None, heads=HEADS, head_dim=HEAD_DIM, kv_heads=None, prefix="x.attn"):
    from vllm.config import set_current_vllm_config

    with set_current_vllm_config(stack.config):
        return stack.upstream(num_heads=heads, head_size=head_dim, scale=scale,
                              num_kv_heads=kv_heads, prefix=prefix)


def tower(stack, make, depth=LAYERS, **kw):
    return [make(stack, prefix="vision_tower.encoder.blocks.%d.attn" % i, **kw) for i in range(depth)]


def moonvit_qkv(total, *, heads=HEADS, head_dim=HEAD_DIM, seed=0, dtype=None):
    """MoonViT's attention_qkvpacked: (T, 3, N, D) -> unbind -> unsqueeze(0): strided views."""
    import torch

    gen = torch.Generator().manual_seed(seed)
    xqkv = torch.randn(total, 3, heads, head_dim, generator=gen).to(dtype or torch.float32)
    xq, xk, xv = torch.unbind(xqkv, dim=-3)
    return xq.unsqueeze(0), xk.unsqueeze(0), xv.unsqueeze(0)


def moonvit_cu_seqlens(grid_hw):
    """MoonViT's encoder: lengths = h*w per image, cumsum with a leading 0, int32."""
    import torch

    grid_hw = torch.tensor(grid_hw)
    lengths = torch.cat((torch.zeros(1, dtype=grid_hw.dtype), grid_hw[:, 0] * grid_hw[:, 1]))
    return lengths.cumsum(dim=0, dtype=torch.int32)


def moonvit_forward(layers, q, k, v, cu_seqlens):
    """One tower forward as MoonViT runs it: every block's attention once, same cu_seqlens."""
    max_seqlen = (cu_seqlens[1:] - cu_seqlens[:-1]).max()   # a device tensor, no sync
    return [layer.forward_oot(q, k, v, cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)
            for layer in layers]


def reference(q, k, v, cu, scale=None):
    from npu_shim.testing import attention_f64

    t, n, d = q.shape[1], q.shape[2], q.shape[3]
    return attention_f64(q.reshape(t, n, d), k.reshape(t, k.shape[2], d),
                         v.reshape(t, v.shape[2], d), cu, scale=scale).reshape(q.shape)


def max_err(outs, ref):
    outs = outs if isinstance(outs, list) else [outs]
    return max((o.double() - ref).abs().max().item() for o in outs)


# ------------------------------------------------------------------ applying


def test_applied_with_the_family_of_this_release(stack):
    from npu_shim.engine import counters

    assert stack.status["family"] == expected_family()
    assert stack.status["reason"] == "vllm-ascend %s" % stack.version
    assert npu_shim.stats()[PATCH_NAME]["family"] == stack.status["family"]
    # Only forward_oot is replaced; __init__ is upstream's (it parses nothing here).
    assert vars(stack.patched)["__init__"].__code__.co_filename == stack.module.__file__
    ours, original = vars(stack.patched)["forward_oot"], vars(stack.upstream)["forward_oot"]
    assert family_module(stack.status["family"]) in ours.__doc__
    assert inspect.signature(ours) == inspect.signature(original)


@pytest.mark.hardware_dtypes
def test_moonvit_tower_in_bfloat16_as_on_a2(stack):
    """What the A2 tower runs: bfloat16 (the op takes no float32). One copy per forward, the
    model's scale honoured (upstream: head_size ** -0.5), within the bfloat16 tolerance of
    float64. A scale off by 1e-3 moves the output by less than bfloat16 resolves: the float32
    checks of this module are what catch that."""
    import torch
    from npu_shim.testing import count_host_syncs

    grid = [(4, 5), (1, 3), (6, 2)]
    patched = tower(stack, vllm_layer, depth=3, scale=0.05)
    upstream = tower(stack, upstream_layer, depth=3, scale=HEAD_DIM ** -0.5)
    with torch.inference_mode():
        cu = moonvit_cu_seqlens(grid)
        q, k, v = moonvit_qkv(int(cu[-1]), seed=2, dtype=torch.bfloat16)
        with count_host_syncs(device_tensors=[cu]) as ours:
            outs = moonvit_forward(patched, q, k, v, cu)
        expected = moonvit_forward(upstream, q, k, v, cu)
    assert ours.count == 1, ours.summary()
    assert all(o.dtype == torch.bfloat16 and o.shape == q.shape for o in outs)
    assert max_err(outs, reference(q, k, v, cu, scale=0.05)) < HW_TOL
    assert max_err(expected, reference(q, k, v, cu)) < HW_TOL


def test_vllm_constructor_hands_back_the_patched_ascend_class(stack):
    layer = vllm_layer(stack, scale=0.05)
    assert type(layer) is stack.patched
    assert (layer.num_heads, layer.head_size, layer.scale) == (HEADS, HEAD_DIM, 0.05)


# ------------------------------------------------------- MoonViT: copies, values


def test_moonvit_27_layers_upstream_copies_per_layer_patched_once(stack):
    import torch
    from npu_shim.engine import counters
    from npu_shim.testing import count_host_syncs

    grid = [(4, 5), (1, 3), (6, 2)]
    patched = tower(stack, vllm_layer, scale=HEAD_DIM ** -0.5)   # as MoonViT passes it
    upstream = tower(stack, upstream_layer, scale=HEAD_DIM ** -0.5)
    with torch.inference_mode():
        cu = moonvit_cu_seqlens(grid)
        q, k, v = moonvit_qkv(int(cu[-1]), seed=1)
        before = counters.snapshot().get(PATCH_NAME, counters.empty_row())["calls"]
        with count_host_syncs(device_tensors=[cu]) as up:
            expected = moonvit_forward(upstream, q, k, v, cu)
        with count_host_syncs(device_tensors=[cu]) as ours:
            outs = moonvit_forward(patched, q, k, v, cu)
    assert up.count == LAYERS, up.summary()
    assert ours.count == 1, ours.summary()
    assert counters.snapshot()[PATCH_NAME]["calls"] - before == LAYERS
    ref = reference(q, k, v, cu)
    assert max_err(outs, ref) < TOL and max_err(expected, ref) < TOL
    # Same emulated op, same layout, same (default) scale: equal to upstream bit for bit.
    assert all(torch.equal(o, e) for o, e in zip(outs, expected))
    assert outs[0].shape == (1, int(cu[-1]), HEADS, HEAD_DIM) and outs[0].is_contiguous()


def test_float16_takes_upstreams_op_of_this_release(stack):
    """float16 (what the towers run in): 0.18.0 calls npu_fusion_attention TND; 0.19.1rc1+
    DeviceOperator.npu_flash_attention -> _npu_flash_attention_unpad on A2/A3 (its float32
    branch goes to TND). Patched and upstream make the same call and agree bit for bit."""
    import torch
    from npu_shim.testing import record_npu_calls

    with torch.inference_mode():
        cu = moonvit_cu_seqlens([(3, 4), (2, 5)])
        q, k, v = (x.half() for x in moonvit_qkv(int(cu[-1]), seed=10))
        with record_npu_calls() as ours:
            out = vllm_layer(stack).forward_oot(q, k, v, cu_seqlens=cu)
        with record_npu_calls() as theirs:
            expected = upstream_layer(stack).forward_oot(q, k, v, cu_seqlens=cu)
    op = "npu_fusion_attention" if family_module(expected_family()).endswith(".v018") else "_npu_flash_attention_unpad"
    assert [c.name for c in ours] == [c.name for c in theirs] == [op]
    assert out.dtype == torch.float16
    assert torch.equal(out, expected)
    assert max_err(out, reference(q.float(), k.float(), v.float(), cu)) < 3e-3


def test_non_default_scale_honoured_where_upstream_ignores_it(stack):
    import torch

    with torch.inference_mode():
        cu = moonvit_cu_seqlens([(3, 4), (2, 5)])
        q, k, v = moonvit_qkv(int(cu[-1]), seed=2)
        out = vllm_layer(stack, scale=0.05).forward_oot(q, k, v, cu_seqlens=cu)
        wrong = upstream_layer(stack, scale=0.05).forward_oot(q, k, v, cu_seqlens=cu)
    asked, default = reference(q, k, v, cu, scale=0.05), reference(q, k, v, cu)
    assert max_err(out, asked) < TOL
    assert max_err(wrong, default) < TOL          # upstream: head_size ** -0.5 regardless
    assert max_err(wrong, asked) > 0.05


def test_second_forward_new_lengths_and_buffer_rewritten_in_place(stack):
    """Per-forward lengths: a new cu_seqlens is read again; so is the same inference-mode
    buffer rewritten in place between two forwards (no version counter there)."""
    import torch
    from npu_shim.testing import count_host_syncs

    layers = tower(stack, vllm_layer)
    with torch.inference_mode():
        cu = moonvit_cu_seqlens([(4, 5), (1, 3), (6, 2)])        # 20, 3, 12 -> 35 tokens
        q, k, v = moonvit_qkv(35, seed=3)
        for new in (None, moonvit_cu_seqlens([(5, 5), (2, 5)])):  # a new tensor, 25 + 10
            cu_now = cu if new is None else new
            with count_host_syncs(device_tensors=[cu_now]) as syncs:
                outs = moonvit_forward(layers, q, k, v, cu_now)
            assert syncs.count == 1, syncs.summary()
            assert max_err(outs, reference(q, k, v, cu_now)) < TOL
        assert cu.is_inference()
        cu.copy_(moonvit_cu_seqlens([(1, 1), (2, 10), (2, 7)]))   # 1 + 20 + 14, in place
        with count_host_syncs(device_tensors=[cu]) as syncs:
            outs = moonvit_forward(layers, q, k, v, cu)
    assert syncs.count == 1, syncs.summary()
    ref = reference(q, k, v, cu)
    assert max_err(outs, ref) < TOL
    assert max_err(outs, reference(q, k, v, moonvit_cu_seqlens([(4, 5), (1, 3), (6, 2)]))) > 1e-2


def test_two_towers_alternating(stack):
    import torch
    from npu_shim.testing import count_host_syncs

    tower_a = tower(stack, vllm_layer)
    tower_b = [vllm_layer(stack, prefix="video_tower.blocks.%d.attn" % i) for i in range(LAYERS)]
    with torch.inference_mode():
        cu_a = moonvit_cu_seqlens([(2, 8), (4, 4)])     # 16, 16
        cu_b = moonvit_cu_seqlens([(5, 6), (1, 2)])     # 30, 2
        qa, ka, va = moonvit_qkv(32, seed=4)
        qb, kb, vb = moonvit_qkv(32, seed=5)
        with count_host_syncs(device_tensors=[cu_a, cu_b]) as syncs:
            outs_a, outs_b = [], []
            for layer_a, layer_b in zip(tower_a, tower_b):
                outs_a.append(layer_a.forward_oot(qa, ka, va, cu_seqlens=cu_a))
                outs_b.append(layer_b.forward_oot(qb, kb, vb, cu_seqlens=cu_b))
    assert syncs.count == 2, syncs.summary()
    assert max_err(outs_a, reference(qa, ka, va, cu_a)) < TOL
    assert max_err(outs_b, reference(qb, kb, vb, cu_b)) < TOL


def test_layer_made_with_new_works_upstream_fails(stack):
    """vllm-ascend's own unit tests build layers with __new__ and set the attributes they
    need; the patched forward builds its state from them on first use."""
    import torch

    def bare(cls):
        layer = cls.__new__(cls)
        torch.nn.Module.__init__(layer)
        layer.num_heads, layer.num_kv_heads, layer.head_size = HEADS, HEADS, HEAD_DIM
        layer.scale = 0.1
        return layer

    cu = moonvit_cu_seqlens([(3, 3), (2, 2)])
    q, k, v = moonvit_qkv(13, seed=6)
    out = bare(stack.patched).forward_oot(q, k, v, cu_seqlens=cu)
    assert max_err(out, reference(q, k, v, cu, scale=0.1)) < TOL
    with pytest.raises(AttributeError, match="enable_pad|scale_value"):
        bare(stack.upstream).forward_oot(q, k, v, cu_seqlens=cu)


def test_uniform_lengths_without_cu_seqlens(stack):
    """cu_seqlens=None (Hunyuan-OCR): bsz sequences of S tokens, built on the host."""
    import torch
    from npu_shim.testing import count_host_syncs, dense_segments

    gen = torch.Generator().manual_seed(7)
    q, k, v = (torch.randn(3, 7, HEADS * HEAD_DIM, generator=gen) for _ in range(3))
    with count_host_syncs(device_tensors=[q, k, v]) as syncs:   # lengths come from shapes only
        out = vllm_layer(stack).forward_oot(q, k, v)
    assert syncs.count == 0, syncs.summary()
    expected = upstream_layer(stack).forward_oot(q, k, v)
    assert out.shape == expected.shape == (3, 7, HEADS * HEAD_DIM)
    assert torch.equal(out, expected)
    flat = lambda x: x.reshape(1, 21, HEADS, HEAD_DIM)
    ref = reference(flat(q), flat(k), flat(v), dense_segments([7, 7, 7]))
    assert max_err(out.reshape(1, 21, HEADS, HEAD_DIM), ref) < TOL


def test_gqa_repeats_kv_and_passes_the_matching_head_count(stack):
    import torch

    heads, kv_heads = 8, 2
    cu = moonvit_cu_seqlens([(3, 4), (2, 3)])
    gen = torch.Generator().manual_seed(8)
    q = torch.randn(1, 18, heads, 80, generator=gen)
    k, v = (torch.randn(1, 18, kv_heads, 80, generator=gen) for _ in range(2))
    out = vllm_layer(stack, heads=heads, head_dim=80, kv_heads=kv_heads).forward_oot(q, k, v, cu_seqlens=cu)
    from npu_shim.testing import attention_f64

    ref = attention_f64(q[0], k[0], v[0], cu).reshape(q.shape)
    assert max_err(out, ref) < TOL


# ------------------------------------------------- Qwen3-VL: host sequence_lengths


def qwen3_vl_lengths(grid_thw):
    """What vLLM's Qwen3-VL vision forward computes before its blocks (host NumPy cu_seqlens,
    MMEncoderAttention.maybe_compute_seq_lens -> the OOT class's, maybe_recompute_cu_seqlens)."""
    import numpy as np
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    grid = np.array(grid_thw, dtype=np.int32)
    cu = np.repeat(grid[:, 1] * grid[:, 2], grid[:, 0]).cumsum(axis=0, dtype=np.int32)
    cu = np.concatenate([np.zeros(1, dtype=np.int32), cu])
    backend = AttentionBackendEnum.TORCH_SDPA
    sequence_lengths = MMEncoderAttention.maybe_compute_seq_lens(backend, cu, "cpu")
    cu_seqlens = MMEncoderAttention.maybe_recompute_cu_seqlens(backend, cu, HEADS * HEAD_DIM, 1, "cpu")
    return cu_seqlens, sequence_lengths


def test_qwen3_vl_host_sequence_lengths_cost_no_copy(stack):
    """Host sequence_lengths from vLLM: no copy at all, upstream or patched, even with
    cu_seqlens on the device. (A device sequence_lengths cannot be stood in for on CPU:
    upstream tests ``.device.type`` there.)"""
    import torch
    from npu_shim.testing import count_host_syncs

    patched = tower(stack, vllm_layer)
    upstream = tower(stack, upstream_layer)
    with torch.inference_mode():
        cu, seq_lens = qwen3_vl_lengths([(1, 4, 4), (2, 2, 3)])   # 16, 6, 6
        assert isinstance(seq_lens, torch.Tensor) and seq_lens.device.type == "cpu"
        gen = torch.Generator().manual_seed(9)
        q, k, v = (torch.randn(1, 28, HEADS, HEAD_DIM, generator=gen) for _ in range(3))

        def run(layers):
            with count_host_syncs(device_tensors=[cu]) as syncs:
                outs = [layer.forward_oot(q, k, v, cu_seqlens=cu, sequence_lengths=seq_lens)
                        for layer in layers]
            return outs, syncs

        outs, ours = run(patched)
        expected, up = run(upstream)
    assert (ours.count, up.count) == (0, 0), (ours, up)
    assert max_err(outs, reference(q, k, v, cu)) < TOL
    assert all(torch.equal(o, e) for o, e in zip(outs, expected))


# --------------------------------------------------- disabled / uninstall / strict

SUBPROCESS = r'''
import json, os, torch, npu_shim, wrapt
from npu_shim import emulation
from npu_shim.testing import count_host_syncs
MODE = os.environ["TEST_MODE"]
if MODE == "strict-mismatch":
    # A release whose class has another shape inside the window: drop the 0.18+ hook
    # before the shim's post-import hook looks at it (hooks run in registration order).
    def change_shape(module):
        del module.AscendMMEncoderAttention.maybe_compute_seq_lens
    wrapt.register_post_import_hook(change_shape, "vllm_ascend.ops.mm_encoder_attention")
emulation.install()
from npu_shim.emulation.dtypes import float32_not_on_hardware
_float32 = float32_not_on_hardware(); _float32.__enter__()   # this module's float32 math checks (float32_math)
npu_shim.install()
from npu_shim.testing.isolation import import_vllm_ascend_ops_module
try:
    module = import_vllm_ascend_ops_module()
except Exception as exc:
    print(json.dumps({"raised": type(exc).__name__, "message": str(exc)}))
    raise SystemExit(0)
cls = module.AscendMMEncoderAttention
row = lambda: next(r for r in npu_shim.status() if r["name"] == "vllm.mm_encoder_attn")
applied = dict(row())
forward_before = vars(cls)["forward_oot"]
if MODE == "uninstall":
    npu_shim.uninstall()
from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
    layers = [cls(num_heads=4, head_size=72, scale=0.05, prefix="b.%d.attn" % i) for i in range(3)]
gen = torch.Generator().manual_seed(0)
q, k, v = (torch.randn(1, 18, 4, 72, generator=gen) for _ in range(3))
cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
with count_host_syncs(device_tensors=[cu]) as syncs:
    outs = [layer.forward_oot(q, k, v, cu_seqlens=cu) for layer in layers]
torch.save(outs[0], os.environ["TEST_OUT"])
print(json.dumps({"state": applied["state"], "family": applied["family"], "after": row()["state"],
                  "syncs": syncs.count, "module_file": module.__file__,
                  "forward_file": vars(cls)["forward_oot"].__code__.co_filename,
                  "patched_before": forward_before.__code__.co_filename != module.__file__}))
'''


def run_mode(run_python, make_env, tmp_path, mode, **env):
    import json

    out = tmp_path / "out.pt"
    proc = run_python(SUBPROCESS, env=make_env(VLLM_PLUGINS="npu_shim", TEST_MODE=mode,
                                               TEST_OUT=str(out), **env), timeout=300)
    return json.loads(proc.stdout.strip().splitlines()[-1]), out


def upstream_output(stack):
    import torch

    gen = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 18, 4, 72, generator=gen) for _ in range(3))
    cu = torch.tensor([0, 5, 6, 15, 18], dtype=torch.int32)
    return upstream_layer(stack, heads=4, head_dim=72, scale=0.05).forward_oot(q, k, v, cu_seqlens=cu)


def test_disabled_is_exactly_upstream(stack, run_python, make_env, tmp_path):
    import torch

    result, out = run_mode(run_python, make_env, tmp_path, "plain", NPU_SHIM_DISABLE=PATCH_NAME)
    assert result["state"] == "disabled" and result["family"] is None, result
    assert result["forward_file"] == result["module_file"]
    assert result["syncs"] == 3
    assert torch.equal(torch.load(out), upstream_output(stack))


def test_applied_in_a_fresh_interpreter_and_uninstall_restores_upstream(stack, run_python, make_env, tmp_path):
    import torch

    result, out = run_mode(run_python, make_env, tmp_path, "uninstall")
    assert result["state"] == "applied" and result["patched_before"], result
    assert result["family"] == expected_family()
    assert result["after"] == "disabled"
    assert result["forward_file"] == result["module_file"]
    assert result["syncs"] == 3
    assert torch.equal(torch.load(out), upstream_output(stack))


def test_strict_mode_raises_on_a_mismatch_inside_the_window(stack, run_python, make_env, tmp_path):
    result, _ = run_mode(run_python, make_env, tmp_path, "strict-mismatch", NPU_SHIM_STRICT="1")
    assert result["raised"] == "PatchError", result
    assert "no family accepts AscendMMEncoderAttention" in result["message"]
    assert "maybe_compute_seq_lens" in result["message"]
