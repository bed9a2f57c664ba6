"""Patch ``sglang.vision_host_lengths`` on the real sglang wheels (every sglang lane; lanes derived from
the declaration: the families' fences and the pin files' ``# Stands for:``).

What runs is sglang's own ``VisionAscendAttention`` and ``prepare_vision_attention_metadata`` of the
installed release, one metadata object shared by six layers as a tower forward shares it, torch_npu
the emulation, q/k/v (and, for "device" lengths, ``cu_seqlens``) counted as device tensors
(npu_shim/testing/sglang_vision.py lists the stand-ins). Checked:

* upstream reads 1 (metadata ``.item()``) + 1 per layer (``.to("cpu")``) on 0.5.16+, host lengths or
  not; the shim 0 where the tower handed the metadata a host ``cu_seqlens``, upstream's count where only
  the device has them; no blocking host->device copy either way;
* 0.5.16: three images raise upstream (per-image lengths to FIA TND) and are right with the shim;
* the same FIA call with the same arguments, and a bit-identical output, wherever upstream runs;
  the image rows within the bfloat16 (A2) / float16 tolerance of the float64 reference; 0.5.20+ also
  with images padded to a common length (pad rows never leak into the result);
* 0.5.11 - 0.5.15 (outside the window): the patch is skipped with its reason, and upstream's attention
  makes 0 reads on host lengths (what the towers hand it on NPU), 1 per layer on device lengths.
"""
import importlib
import json
import os

import pytest

import npu_shim
from npu_shim.patches._shared.structure import replacement_of, upstream_of
from npu_shim.patches.sglang import vision_host_lengths as declaration
from npu_shim.testing import claims


NAME = declaration.PATCH.name
TARGET = declaration.TARGET
LAYERS = 6

# every sglang lane: those a family claims and the others, outside
inside = pytest.mark.claimed(NAME)
outside = pytest.mark.claimed(NAME, outside="all")
pytestmark = [inside, outside, pytest.mark.patch(NAME)]


@pytest.fixture(scope="module")
def vision():
    from npu_shim import emulation
    from npu_shim.testing import sglang_vision

    emulation.install()
    npu_shim.install()
    importlib.import_module(TARGET)
    with sglang_vision.npu_platform() as module:
        yield module


def _family():
    return claims.claimed_family(NAME)


def _upstream(vision):
    """(upstream's metadata function, upstream's forward) of the installed release."""
    prepare = getattr(vision, "prepare_vision_attention_metadata", None)
    forward = vision.VisionAscendAttention.forward
    return getattr(prepare, "__wrapped_upstream__", prepare), upstream_of(forward)


def _padded_layout():
    family = _family()
    return family is not None and family.load().padded


@inside
def test_applies_with_the_family_whose_fence_admits_this_release(vision):
    row = next(r for r in npu_shim.status() if r["name"] == NAME)
    assert row["state"] == "applied", row
    assert row["family"] == _family().name
    # sglang.vision_head_pad, where it applies, wraps this patch's forward
    assert replacement_of(vision.VisionAscendAttention.forward, NAME) is not None


def _cases():
    """Images packed, and padded to a common length where the installed release serves that layout
    (0.5.20+; a single image is the same either way)."""
    from importlib.metadata import PackageNotFoundError

    try:
        layouts = (False, True) if _padded_layout() else (False,)
    except PackageNotFoundError:          # collected on a lane without sglang: deselected anyway
        layouts = (False,)
    cases = []
    for lengths in ((64,), (64, 100, 36)):
        for padded in layouts:
            for device_lengths in (False, True):
                cases.append(pytest.param(lengths, padded, device_lengths, id="%s-%s-%s" % (
                    "x".join(map(str, lengths)), "padded" if padded else "packed",
                    "device" if device_lengths else "host")))
    return cases


@inside
@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("lengths,padded,device_lengths", _cases())
def test_reads_calls_and_outputs_against_upstream_and_float64(vision, lengths, padded, device_lengths,
                                                              dtype_name):
    import torch

    from npu_shim.testing import sglang_vision

    dtype = getattr(torch, dtype_name)
    case = sglang_vision.make_case(lengths, padded=padded, dtype=dtype)
    upstream_prepare, upstream_forward = _upstream(vision)
    per_forward = 1 + LAYERS          # metadata .item() + one read back per layer

    shim_out, shim_syncs, shim_calls = sglang_vision.run_layers(vision, case, LAYERS,
                                                                device_lengths=device_lengths)
    assert shim_syncs.count == (per_forward if device_lengths else 0), shim_syncs.events
    assert shim_syncs.h2d_count == 0, shim_syncs.h2d_events
    assert [c.name for c in shim_calls] == ["npu_fused_infer_attention_score"] * LAYERS
    err = sglang_vision.error(case, shim_out)
    assert err <= sglang_vision.TOLERANCES[dtype], err

    seq_lens_family = not _family().load().metadata_max
    if seq_lens_family and len(lengths) > 1:
        # 0.5.16's own path hands FIA per-image lengths: the emulation refuses them as the op does
        with pytest.raises(ValueError, match="actual_seq_lengths"):
            sglang_vision.run_layers(vision, case, LAYERS, device_lengths=device_lengths,
                                     prepare=upstream_prepare, forward=upstream_forward)
        return
    up_out, up_syncs, up_calls = sglang_vision.run_layers(vision, case, LAYERS, device_lengths=device_lengths,
                                                          prepare=upstream_prepare, forward=upstream_forward)
    assert up_syncs.count == per_forward, up_syncs.events
    # pad rows are torch.empty_like's contents on both sides: undefined, not compared
    assert shim_out.shape == up_out.shape and torch.equal(shim_out[case.real], up_out[case.real])
    assert len(shim_calls) == len(up_calls)
    for mine, theirs in zip(shim_calls, up_calls):
        assert sorted(mine.kwargs) == sorted(theirs.kwargs)
        for key, value in mine.kwargs.items():
            other = theirs.kwargs[key]
            assert torch.equal(value, other) if isinstance(value, torch.Tensor) else value == other, key


@inside
def test_a_mask_or_no_metadata_is_upstreams_call(vision):
    """Without metadata (or with an additive mask, 0.5.17+) the call is upstream's, counted as such."""
    import torch

    from npu_shim.engine import counters
    from npu_shim.testing import sglang_vision

    case = sglang_vision.make_case((64, 100, 36), dtype=torch.bfloat16)
    before = npu_shim.stats()[NAME]["upstream_calls"]
    out, syncs, calls = sglang_vision.run_layers(vision, case, 2, prepare=lambda *a, **k: None)
    assert npu_shim.stats()[NAME]["upstream_calls"] == before + 2
    assert syncs.count == 0 and len(calls) == 2
    assert sglang_vision.error(case, out) <= sglang_vision.TOLERANCES[torch.bfloat16]


@inside
def test_uninstall_restores_upstream_and_a_name_bound_before_forwards(vision):
    prepare_patched = vision.prepare_vision_attention_metadata
    forward_patched = vision.VisionAscendAttention.__dict__["forward"]
    upstream_prepare, upstream_forward = _upstream(vision)
    npu_shim.uninstall()
    try:
        assert vision.prepare_vision_attention_metadata is upstream_prepare
        assert vision.VisionAscendAttention.__dict__["forward"] is upstream_forward
        # a model module that imported the name while the shim was installed now gets upstream's
        import torch

        cu = torch.tensor([0, 4, 10], dtype=torch.int32)
        meta = prepare_patched(cu, device=torch.device("cpu"))
        assert declaration.HOST_ATTR not in vars(meta)
    finally:
        npu_shim.install()
    assert replacement_of(vision.VisionAscendAttention.__dict__["forward"], NAME) is not None
    assert forward_patched is not vision.VisionAscendAttention.__dict__["forward"]


@pytest.mark.claimed(NAME, per_family=True)
def test_switched_off_is_upstream_and_strict_raises_on_another_shape(vision, run_python, make_env):
    placeholders = os.path.join(os.path.dirname(os.path.dirname(__file__)), "placeholders")
    off = run_python(
        "import json, importlib, npu_shim\n"
        "m = importlib.import_module(%r)\n"
        "rows = {r['name']: [r['state'], r['reason']] for r in npu_shim.status()}\n"
        "from npu_shim.patches._shared.structure import replacement_of\n"
        "f = m.VisionAscendAttention.__dict__['forward']\n"
        "print(json.dumps([rows[%r], replacement_of(f, %r) is not None, "
        "hasattr(m.prepare_vision_attention_metadata, '__wrapped_upstream__')]))" % (TARGET, NAME, NAME),
        env=make_env(NPU_SHIM_EMULATE="1", NPU_SHIM_DISABLE=NAME, PYTHONPATH=placeholders), timeout=600)
    row, forward_patched, prepare_patched = json.loads(off.stdout.strip().splitlines()[-1])
    assert row == ["disabled", "listed in NPU_SHIM_DISABLE"]
    assert (forward_patched, prepare_patched) == (False, False)

    strict = run_python(
        "import dataclasses, importlib, npu_shim\n"
        "plain = dataclasses.is_dataclass\n"
        "def other_shape(obj):\n"      # a release whose metadata is no longer a dataclass
        "    return False if getattr(obj, '__name__', '') == 'VisionAttentionMetadata' else plain(obj)\n"
        "dataclasses.is_dataclass = other_shape\n"
        "importlib.import_module(%r)\n" % TARGET,
        env=make_env(NPU_SHIM_EMULATE="1", NPU_SHIM_STRICT="1", PYTHONPATH=placeholders),
        check=False, timeout=600)
    assert strict.returncode != 0
    assert "PatchError" in strict.stderr and NAME in strict.stderr
    assert "VisionAttentionMetadata is not a dataclass" in strict.stderr


@outside
def test_outside_the_window_skipped_and_host_lengths_cost_nothing_upstream(vision):
    """0.5.11 - 0.5.15: no metadata; upstream's attention reads only lengths the tower left on the
    device, once per layer (sglang.vision_device_lengths' tests: once per forward with the shim)."""
    import torch

    from npu_shim.testing import sglang_vision

    row = next(r for r in npu_shim.status() if r["name"] == NAME)
    assert row["state"] == "skipped" and "is outside" in row["reason"], row
    assert "below the window there is no vision attention metadata" in row["reason"]
    assert not hasattr(vision, "prepare_vision_attention_metadata")
    for lengths in ((64,), (64, 100, 36)):
        case = sglang_vision.make_case(lengths, dtype=torch.bfloat16)
        out, syncs, calls = sglang_vision.run_layers(vision, case, LAYERS)
        assert syncs.count == 0 and syncs.h2d_count == 0, syncs.events
        assert sglang_vision.error(case, out) <= sglang_vision.TOLERANCES[torch.bfloat16]
        forward = vision.VisionAscendAttention.forward      # sglang.vision_device_lengths' there
        _, syncs, _ = sglang_vision.run_layers(vision, case, LAYERS, device_lengths=True,
                                               forward=upstream_of(forward))
        assert syncs.count == LAYERS, syncs.events
