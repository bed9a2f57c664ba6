"""Patches ``vllm.moonvit_attn`` + ``transformers.attn_check`` on the real Kimi-VL stacks.

Lanes kimi-vl-2025 (vllm 0.10.1.1 + transformers 4.56.0) and vllm-0.13 (vllm
0.13.0 + transformers 4.57.6): vLLM's own ``MoonVitPretrainedModel`` runs here,
built from its own config class, with deterministic random weights. The only
stand-in is torch_npu (npu-shim's emulation of the documented ops). Every
numerical claim is checked against ``npu_shim.testing.attention_f64`` (float64,
from the definition of attention) — per layer on the exact q/k/v the NPU op
received, and for the whole tower against a float64 copy of the same model whose
attention is that reference.

Side by side: the same weights built with ``NPU_SHIM_MOONVIT_ATTN=sdpa`` run
upstream's own ``sdpa_attention`` (the S x S mask path); built with the default
(``auto``) they run the shim's ``ascend_fa``.

Host syncs: vLLM keeps ``grid_hw`` on the device, so on this CPU-only machine
``pixel_values``/``grid_hw`` are marked as device stand-ins for
``count_host_syncs`` and the ``cu_seqlens`` the blocks receive is marked as a
device tensor (see ``cu_seqlens_on_device`` for why).
"""
import json
import os
import sys
import textwrap

import pytest

from npu_shim.testing import moonvit as mv

pytestmark = [pytest.mark.claimed("vllm.moonvit_attn", "transformers.attn_check"),
              pytest.mark.patch("vllm.moonvit_attn", "transformers.attn_check"),
              pytest.mark.float32_math]  # float32 beside bfloat16: the math checks (see conftest)

KIMI_2_LAYERS = dict(mv.KIMI_VL, num_hidden_layers=2)
GEOMETRIES = {"tiny": mv.TINY, "kimi-vl-heads": KIMI_2_LAYERS}
# |output - float64 reference| <= TOL[dtype] * max |reference| (no floor); measured worst (kimi-vl-2025,
# vllm-0.13): one layer float32 1.5e-6, bfloat16 3.3e-3, float16 3.1e-4; whole tower float32 4.3e-6,
# bfloat16 3.4e-2, float16 4.3e-3 (upstream's SDPA tower the same within 3%)
ATTENTION_TOL = {"float32": 2e-6, "bfloat16": 8e-3, "float16": 1e-3}   # one layer, exact inputs
TOWER_TOL = {"float32": 1e-5, "bfloat16": 4e-2, "float16": 6e-3}       # whole tower (all layers in dtype)
TRANSFORMERS_REJECTS = 'Specified `attn_implementation="ascend_fa"` is not supported'



@pytest.fixture(scope="module")
def moonvit():
    import npu_shim
    from npu_shim import emulation

    emulation.install()          # the one stand-in: torch_npu -> pure-PyTorch emulation
    npu_shim.install()
    module = mv.moonvit_module()
    rows = {r["name"]: r for r in npu_shim.status()}
    for name in ("transformers.attn_check", "vllm.moonvit_attn"):
        assert rows[name]["state"] == "applied", rows[name]
    return module


def dtype_of(name):
    import torch

    return getattr(torch, name)


def f64_attention(q, k, v, q_cu_seqlens=None, k_cu_seqlens=None):
    """The float64 reference in upstream's calling convention (for the reference tower)."""
    from npu_shim.testing import attention_f64

    return attention_f64(q, k, v, q_cu_seqlens, k_cu_seqlens).reshape(q.shape[0], -1).to(q.dtype)


def reference_tower_output(moonvit, monkeypatch, geometry, pixels, grid_hw, seed=0):
    import torch

    monkeypatch.setitem(moonvit.VL_VISION_ATTENTION_FUNCTIONS, "npu_shim_test_f64", f64_attention)
    model = mv.build_tower(moonvit, geometry, dtype=torch.float64, choice="sdpa", seed=seed)
    for block in model.encoder.blocks:
        block.attn_implementation = "npu_shim_test_f64"
    return mv.forward(model, pixels.double(), grid_hw)


def bound(tol, reference):
    return tol * reference.abs().max().item()


def relative(comparison, err, reference, tol, dtype_name):
    """``err / max |reference| <= tol``, recorded (npu_shim.testing.errors)."""
    from npu_shim.testing.errors import within

    return within(comparison, err / reference.abs().max().item(), tol, dtype_name)


# --------------------------------------------------------------------------- set-up


def test_both_patches_applied_on_the_pinned_stack(moonvit, lane_pins):
    import npu_shim

    rows = {r["name"]: r for r in npu_shim.status()}
    assert rows["vllm.moonvit_attn"]["versions"] == lane_pins("vllm")
    assert rows["transformers.attn_check"]["versions"] == lane_pins("transformers", "vllm")
    assert moonvit.VL_VISION_ATTENTION_FUNCTIONS["ascend_fa"].__module__ == "npu_shim.patches.vllm.moonvit_attn"
    for method in ("__init__", "attention_qkvpacked"):
        wrapper = moonvit.MoonVitEncoderLayer.__dict__[method]
        assert wrapper.__code__.co_filename.endswith(os.path.join("patches", "vllm", "moonvit_attn.py"))
        assert wrapper.__wrapped__.__code__.co_filename == moonvit.__file__
    assert {"sdpa", "flash_attention_2"} <= set(moonvit.VL_VISION_ATTENTION_FUNCTIONS)


# --------------------------------------------------------------------------- (1) the config route


def test_ascend_fa_config_constructs_with_the_shim(moonvit):
    model = mv.build_tower(moonvit, mv.TINY, attn_implementation="ascend_fa")
    assert model.config._attn_implementation == "ascend_fa"
    assert [b.attn_implementation for b in model.encoder.blocks] == ["ascend_fa"] * 2
    assert all(b.npu_shim_attention.num_heads == 4 and b.npu_shim_attention.head_dim == 16
               for b in model.encoder.blocks)


SUBPROCESS_BUILD = textwrap.dedent("""
    import json, sys, traceback
    import npu_shim
    from npu_shim.testing import moonvit as mv
    module = mv.moonvit_module()
    rows = {r["name"]: r["state"] for r in npu_shim.status()}
    try:
        model = mv.build_tower(module, mv.TINY, attn_implementation="ascend_fa")
        outcome = {"built": [b.attn_implementation for b in model.encoder.blocks]}
    except ValueError as exc:
        frame = traceback.extract_tb(exc.__traceback__)[-1]
        outcome = {"error": str(exc), "raised_in": frame.filename}
    print(json.dumps({"states": rows, **outcome}))
""")


@pytest.mark.parametrize("switch", [{"NPU_SHIM": "0"}, {"NPU_SHIM_DISABLE": "vllm.moonvit_attn"}])
def test_ascend_fa_config_is_rejected_by_transformers_without_the_patch(run_python, make_env, switch):
    """Proves the patch is needed: upstream transformers rejects the name; and with only
    the moonvit patch off, transformers.attn_check declines too (nothing would dispatch it)."""
    env = make_env(NPU_SHIM_EMULATE="1", VLLM_PLUGINS="", **switch)
    result = json.loads(run_python(SUBPROCESS_BUILD, env=env, timeout=300).stdout.strip().splitlines()[-1])
    assert "built" not in result, result
    assert TRANSFORMERS_REJECTS in result["error"]
    assert result["raised_in"].endswith(os.path.join("transformers", "modeling_utils.py"))
    assert result["states"]["vllm.moonvit_attn"] == "disabled"
    expected = "disabled" if switch.get("NPU_SHIM") == "0" else "applied"
    assert result["states"]["transformers.attn_check"] == expected


# --------------------------------------------------------------------------- (2) numerics


@pytest.mark.parametrize("geometry_name, dtype_name", [
    ("tiny", "float32"), ("tiny", "bfloat16"), ("tiny", "float16"),
    # Kimi-VL runs its tower in bfloat16; float16 matmuls on CPU are too slow to add here.
    ("kimi-vl-heads", "float32"), ("kimi-vl-heads", "bfloat16"),
])
def test_ascend_fa_matches_upstream_sdpa_and_float64(moonvit, monkeypatch, geometry_name, dtype_name):
    import torch

    from npu_shim.testing import attention_f64, record_npu_calls

    geometry = GEOMETRIES[geometry_name]
    dtype = dtype_of(dtype_name)
    heads = geometry["num_attention_heads"]
    head_dim = geometry["hidden_size"] // heads
    shim = mv.build_tower(moonvit, geometry, dtype=dtype)                  # default: auto
    upstream = mv.build_tower(moonvit, geometry, dtype=dtype, choice="sdpa")
    assert {b.attn_implementation for b in shim.encoder.blocks} == {"ascend_fa"}
    assert {b.attn_implementation for b in upstream.encoder.blocks} == {"sdpa"}
    for (name, a), (_, b) in zip(shim.state_dict().items(), upstream.state_dict().items()):
        assert torch.equal(a, b), name

    pixels, grid_hw = mv.make_inputs(dtype=dtype)
    with record_npu_calls() as calls, mv.capture_attention_outputs(shim) as returned:
        out_shim = mv.forward(shim, pixels, grid_hw)
    out_upstream = mv.forward(upstream, pixels, grid_hw)
    assert out_shim.dtype == dtype and out_shim.shape == out_upstream.shape

    # Per layer: what ascend_fa returned vs float64 attention of the q/k/v the NPU op got.
    records = mv.fusion_calls_report(calls, geometry["num_hidden_layers"], head_dim)
    for layer, ((q, k, v, ends, _, scale), got) in enumerate(zip(records, returned)):
        assert ends[-1] == pixels.shape[0] and len(ends) == len(mv.GRIDS)
        assert scale == pytest.approx(head_dim ** -0.5)
        reference = attention_f64(q, k, v, [0] + ends, scale=scale)
        err = (got.reshape(reference.shape).double() - reference).abs().max().item()
        assert relative("moonvit ascend_fa layer vs float64", err, reference, ATTENTION_TOL[dtype_name],
                        dtype_name), (layer, err)

    # Whole tower: shim vs upstream sdpa, and both vs the float64 tower.
    reference = reference_tower_output(moonvit, monkeypatch, geometry, pixels, grid_hw)
    tol = bound(TOWER_TOL[dtype_name], reference)
    err_shim = (out_shim.double() - reference).abs().max().item()
    err_upstream = (out_upstream.double() - reference).abs().max().item()
    assert relative("moonvit tower (shim) vs float64", err_shim, reference, TOWER_TOL[dtype_name],
                    dtype_name), (err_shim, tol)
    assert relative("moonvit tower (upstream sdpa) vs float64", err_upstream, reference,
                    TOWER_TOL[dtype_name], dtype_name), (err_upstream, tol)
    assert (out_shim.double() - out_upstream.double()).abs().max().item() <= tol


# --------------------------------------------------------------------------- (3) isolation


@pytest.mark.parametrize("dtype_name", ["float32", "bfloat16"])
def test_changing_image_b_leaves_image_a_bit_identical(moonvit, dtype_name):
    import torch

    dtype = dtype_of(dtype_name)
    model = mv.build_tower(moonvit, mv.TINY, dtype=dtype)
    pixels, grid_hw = mv.make_inputs(dtype=dtype)
    a, b, c = mv.image_slices(mv.GRIDS)
    first = mv.GRIDS[0][0] * mv.GRIDS[0][1]
    second = first + mv.GRIDS[1][0] * mv.GRIDS[1][1]
    changed = pixels.clone()
    changed[first:second] = torch.randn(changed[first:second].shape, generator=torch.Generator().manual_seed(7)).to(dtype)

    before = mv.forward(model, pixels, grid_hw)
    after = mv.forward(model, changed, grid_hw)
    assert torch.equal(before[a], after[a])
    assert torch.equal(before[c], after[c])
    assert not torch.equal(before[b], after[b])


def test_isolation_check_detects_cross_image_attention(moonvit):
    """Control for the test above: the same packed q/k/v attended as ONE segment (the
    seed's all-False-mask bug) does change image A when image B changes."""
    import torch

    attend = moonvit.VL_VISION_ATTENTION_FUNCTIONS["ascend_fa"]
    gen = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(30, 2, 8, generator=gen) for _ in range(3))
    per_image = torch.tensor([0, 10, 30], dtype=torch.int32)
    merged = torch.tensor([0, 30], dtype=torch.int32)
    k2, v2 = k.clone(), v.clone()
    k2[10:] += 1.0
    v2[10:] += 1.0
    assert torch.equal(attend(q, k, v, per_image, per_image)[:10], attend(q, k2, v2, per_image, per_image)[:10])
    assert not torch.equal(attend(q, k, v, merged, merged)[:10], attend(q, k2, v2, merged, merged)[:10])


# --------------------------------------------------------------------------- (4) host syncs, dispatch, memory


def test_host_syncs_per_forward_27_layers(moonvit):
    """Shim: one host sync for the attention of all 27 layers. Upstream sdpa: 4 per image per layer."""
    from npu_shim.testing import count_host_syncs, record_npu_calls

    geometry = dict(mv.TINY, num_hidden_layers=27)
    counts = {}
    for choice in ("auto", "sdpa"):
        model = mv.build_tower(moonvit, geometry, choice=choice)
        pixels, grid_hw = mv.make_inputs()
        with count_host_syncs(device_tensors=[pixels, grid_hw]) as syncs, \
                mv.cu_seqlens_on_device(model, syncs), record_npu_calls() as calls:
            mv.forward(model, pixels, grid_hw)
        attention = mv.attention_syncs(syncs)
        rest = sorted(str(e) for e in syncs.events if e not in attention)
        counts[choice] = (len(attention), rest, calls)
    shim_attention, shim_rest, shim_calls = counts["auto"]
    sdpa_attention, sdpa_rest, sdpa_calls = counts["sdpa"]
    print("host syncs per 27-layer forward, 3 images: attention path shim %d, upstream sdpa %d; "
          "rest of the tower (upstream's own grid_hw reads) %d in both" % (shim_attention, sdpa_attention, len(shim_rest)))
    assert shim_attention <= 1
    assert sdpa_attention == 4 * len(mv.GRIDS) * 27
    assert shim_rest == sdpa_rest          # the shim adds nothing outside attention
    assert len(mv.fusion_calls_report(shim_calls, 27, 16)) == 27
    assert sdpa_calls == []


def test_no_sequence_by_sequence_tensor_is_created(moonvit):
    """Watch every tensor the tower's code creates: upstream sdpa makes the (1, S, S) mask,
    the shim's path nothing with two dims of length S."""
    import torch
    from torch.overrides import TorchFunctionMode
    from torch.utils._pytree import tree_flatten

    class LargestSquare(TorchFunctionMode):
        def __init__(self, tokens):
            super().__init__()
            self.tokens, self.seen = tokens, []

        def __torch_function__(self, func, types, args=(), kwargs=None):
            result = func(*args, **(kwargs or {}))
            for t in tree_flatten(result)[0]:
                if isinstance(t, torch.Tensor) and list(t.shape).count(self.tokens) >= 2:
                    self.seen.append((getattr(func, "__name__", str(func)), tuple(t.shape)))
            return result

    pixels, grid_hw = mv.make_inputs()
    tokens = pixels.shape[0]
    found = {}
    for choice in ("auto", "sdpa"):
        model = mv.build_tower(moonvit, mv.TINY, choice=choice)
        with LargestSquare(tokens) as watch:
            mv.forward(model, pixels, grid_hw)
        found[choice] = watch.seen
    assert found["auto"] == []
    assert (("zeros", (1, tokens, tokens)) in found["sdpa"])


# --------------------------------------------------------------------------- selection


def test_choice_variable_selects_per_model(moonvit):
    sdpa = mv.build_tower(moonvit, mv.TINY, choice="sdpa", attn_implementation="ascend_fa")
    assert {b.attn_implementation for b in sdpa.encoder.blocks} == {"sdpa"}
    assert all(b.npu_shim_attention is None for b in sdpa.encoder.blocks)
    forced = mv.build_tower(moonvit, mv.TINY, choice="ascend_fa", attn_implementation="sdpa")
    assert {b.attn_implementation for b in forced.encoder.blocks} == {"ascend_fa"}
    auto = mv.build_tower(moonvit, mv.TINY, choice="auto")
    assert {b.attn_implementation for b in auto.encoder.blocks} == {"ascend_fa"}
    # every layer owns its kernel object: nothing shared between layers or models
    kernels = [b.npu_shim_attention for m in (forced, auto) for b in m.encoder.blocks]
    assert len({id(k) for k in kernels}) == len(kernels)


def test_auto_keeps_an_explicit_non_sdpa_choice(moonvit):
    """auto replaces sdpa only: a layer upstream put on flash_attention_2 (flash-attn installed)
    or built for another name keeps it."""
    with mv.env_choice("auto"), mv.vllm_layer_context(moonvit):
        layer = moonvit.MoonVitEncoderLayer(4, 64, 128, attn_implementation="flash_attention_2")
        default = moonvit.MoonVitEncoderLayer(4, 64, 128)
    assert layer.attn_implementation == "flash_attention_2" and layer.npu_shim_attention is None
    assert default.attn_implementation == "ascend_fa"


def test_invalid_choice_is_a_clear_error(moonvit):
    import npu_shim

    with pytest.raises(npu_shim.ConfigError) as info:
        mv.build_tower(moonvit, mv.TINY, choice="flash")
    message = str(info.value)
    assert "NPU_SHIM_MOONVIT_ATTN" in message and "'flash'" in message
    assert all(word in message for word in ("auto", "ascend_fa", "sdpa"))


# --------------------------------------------------------------------------- (5) disabled = upstream


SUBPROCESS_UPSTREAM = textwrap.dedent("""
    import json, sys, torch
    import npu_shim
    from npu_shim.testing import moonvit as mv
    from npu_shim.testing import record_npu_calls
    module = mv.moonvit_module()
    layer = module.MoonVitEncoderLayer
    saved = torch.load(sys.argv[1])
    model = mv.build_tower(module, mv.TINY)
    model.load_state_dict(saved["weights"])
    with record_npu_calls() as calls:
        out = mv.forward(model, saved["pixels"], saved["grid_hw"])
    torch.save(out, sys.argv[2])
    print(json.dumps({
        "state": next(r["state"] for r in npu_shim.status() if r["name"] == "vllm.moonvit_attn"),
        "table": sorted(module.VL_VISION_ATTENTION_FUNCTIONS),
        "upstream_methods": all(layer.__dict__[m].__code__.co_filename == module.__file__
                                for m in ("__init__", "attention_qkvpacked")),
        "blocks": [b.attn_implementation for b in model.encoder.blocks],
        "kernel_attrs": [hasattr(b, "npu_shim_attention") for b in model.encoder.blocks],
        "npu_calls": len(calls),
    }))
""")


@pytest.mark.parametrize("switch", [{"NPU_SHIM": "0"}, {"NPU_SHIM_DISABLE": "vllm.moonvit_attn"}])
def test_disabled_is_exactly_upstream(moonvit, run_python, make_env, tmp_path, switch):
    import torch

    model = mv.build_tower(moonvit, mv.TINY, choice="sdpa")
    pixels, grid_hw = mv.make_inputs()
    torch.save({"weights": model.state_dict(), "pixels": pixels, "grid_hw": grid_hw}, tmp_path / "in.pt")
    env = make_env(NPU_SHIM_EMULATE="1", VLLM_PLUGINS="", OMP_NUM_THREADS=str(torch.get_num_threads()), **switch)
    proc = run_python(SUBPROCESS_UPSTREAM, env=env, args=(str(tmp_path / "in.pt"), str(tmp_path / "out.pt")),
                      timeout=300)
    facts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert facts == {
        "state": "disabled",
        "table": ["flash_attention_2", "sdpa"],
        "upstream_methods": True,
        "blocks": ["sdpa", "sdpa"],
        "kernel_attrs": [False, False],
        "npu_calls": 0,
    }
    # Bit for bit what NPU_SHIM_MOONVIT_ATTN=sdpa gives under the shim: upstream's own path.
    assert torch.equal(torch.load(tmp_path / "out.pt"), mv.forward(model, pixels, grid_hw))


def test_without_torch_npu_both_patches_skip_and_upstream_runs(run_python, make_env):
    """No NPU (and no emulation): nothing can serve ascend_fa, so neither patch applies."""
    code = textwrap.dedent("""
        import json, importlib.util
        import npu_shim
        from npu_shim.testing import moonvit as mv
        module = mv.moonvit_module()
        model = mv.build_tower(module, mv.TINY)
        rows = {r["name"]: [r["state"], r["reason"]] for r in npu_shim.status()}
        print(json.dumps({"torch_npu": importlib.util.find_spec("torch_npu") is not None,
                          "rows": rows, "blocks": [b.attn_implementation for b in model.encoder.blocks]}))
    """)
    result = json.loads(run_python(code, env=make_env(VLLM_PLUGINS=""), timeout=300).stdout.strip().splitlines()[-1])
    assert result["torch_npu"] is False
    for name in ("transformers.attn_check", "vllm.moonvit_attn"):
        state, reason = result["rows"][name]
        assert state == "skipped" and reason.startswith("no NPU: torch_npu is not importable"), (name, reason)
    assert result["blocks"] == ["sdpa", "sdpa"]


# --------------------------------------------------------------------------- npu-shim status


def test_cli_status_shows_both_patches_applied(run_python, make_env, lane_pins):
    import subprocess

    cli = os.path.join(os.path.dirname(sys.executable), "npu-shim")
    env = make_env(NPU_SHIM_EMULATE="1", VLLM_PLUGINS="")
    proc = subprocess.run([cli, "status", "--json", "--import"], env=env, capture_output=True,
                          text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    rows = {r["name"]: r for r in json.loads(proc.stdout)}   # vLLM's import logs go to stderr
    for name in ("transformers.attn_check", "vllm.moonvit_attn"):
        assert rows[name]["state"] == "applied", rows[name]
        assert rows[name]["versions"]["vllm"] == lane_pins("vllm")["vllm"]
