"""Patch ``sglang.vision_device_lengths`` on the real sglang wheels of 0.5.11 - 0.5.15 (lanes from the
declaration: ``pytest.mark.claimed``).

What runs is sglang's own ``VisionAscendAttention`` of the installed release (no metadata before
0.5.16), six layers sharing one ``cu_seqlens`` as a tower forward shares it, torch_npu the emulation,
q/k/v (and, for "device" lengths, ``cu_seqlens``) counted as device tensors
(npu_shim/testing/sglang_vision.py lists the stand-ins). Checked:

* device lengths (what Qwen3-VL's tower hands over): upstream reads 1 per layer, the shim 1 per forward;
  host lengths (Qwen2.5-VL, GLM-4V): 0 reads on both sides, the call is upstream's;
* the same NPU op (0.5.11 - 0.5.13 ``_npu_flash_attention_unpad``, 0.5.14 - 0.5.15 FIA) with the same
  arguments, a bit-identical output, within the bfloat16 / float16 tolerance of the float64 reference;
* the switch, uninstall, strict mode and the selftest.
"""
import importlib
import json
import os

import pytest

import npu_shim
from npu_shim.patches._shared.structure import replacement_of, upstream_of
from npu_shim.patches.sglang import vision_device_lengths as declaration
from npu_shim.testing import claims


NAME = declaration.PATCH.name
TARGET = declaration.TARGET
LAYERS = 6

pytestmark = [pytest.mark.claimed(NAME), pytest.mark.patch(NAME)]


@pytest.fixture(scope="module")
def vision():
    from npu_shim import emulation
    from npu_shim.testing import sglang_vision

    emulation.install()
    npu_shim.install()
    importlib.import_module(TARGET)
    with sglang_vision.npu_platform() as module:
        yield module


def _upstream(vision):
    return upstream_of(vision.VisionAscendAttention.forward)


def test_applies_with_the_family_whose_fence_admits_this_release(vision):
    row = next(r for r in npu_shim.status() if r["name"] == NAME)
    family = claims.claimed_family(NAME)
    assert row["state"] == "applied" and row["family"] == family.name, row
    # sglang.vision_head_pad, where it applies, wraps this patch's forward
    assert replacement_of(vision.VisionAscendAttention.forward, NAME) is not None
    assert not hasattr(vision, declaration.METADATA)
    op = family.load().op
    assert op in _upstream(vision).__code__.co_names


@pytest.mark.parametrize("dtype_name", ["bfloat16", "float16"])
@pytest.mark.parametrize("lengths", [(64,), (64, 100, 36)], ids=["1-image", "3-images"])
@pytest.mark.parametrize("device_lengths", [False, True], ids=["host", "device"])
def test_reads_calls_and_outputs_against_upstream_and_float64(vision, lengths, device_lengths, dtype_name):
    import torch

    from npu_shim.testing import sglang_vision

    dtype = getattr(torch, dtype_name)
    case = sglang_vision.make_case(lengths, dtype=dtype)
    before = npu_shim.stats()[NAME]
    out, syncs, calls = sglang_vision.run_layers(vision, case, LAYERS, device_lengths=device_lengths)
    after = npu_shim.stats()[NAME]
    up, up_syncs, up_calls = sglang_vision.run_layers(vision, case, LAYERS, device_lengths=device_lengths,
                                                      forward=_upstream(vision))
    assert up_syncs.count == (LAYERS if device_lengths else 0), up_syncs.events
    assert syncs.count == (1 if device_lengths else 0), syncs.events
    assert all("vision_device_lengths.py" in e.location for e in syncs.events), syncs.events
    assert syncs.h2d_count == up_syncs.h2d_count == 0
    assert after["calls"] - before["calls"] == LAYERS
    assert after["upstream_calls"] - before["upstream_calls"] == (0 if device_lengths else LAYERS)
    assert torch.equal(out, up)
    assert sglang_vision.error(case, out) <= sglang_vision.TOLERANCES[dtype]
    op = claims.claimed_family(NAME).load().op
    assert [c.name for c in calls] == [c.name for c in up_calls] == [op] * LAYERS
    for mine, theirs in zip(calls, up_calls):
        assert sorted(mine.kwargs) == sorted(theirs.kwargs)
        for key, value in mine.kwargs.items():
            other = theirs.kwargs[key]
            if isinstance(value, torch.Tensor) and key != "out":
                assert torch.equal(value, other), key
            elif not isinstance(value, torch.Tensor):
                assert value == other, key


def test_a_device_tensor_changed_in_place_is_read_again(vision):
    """The host copy belongs to one tensor at one version: lengths changed in place are read anew."""
    import torch

    from npu_shim.testing import count_host_syncs
    from npu_shim.testing.sglang_vision import counting_as_npu, make_attention, make_case

    case = make_case((64, 100, 36), dtype=torch.bfloat16)
    attention = make_attention(vision, case)
    forward = type(attention).forward
    cu = case.cu_seqlens.clone()
    with count_host_syncs(device_tensors=[case.q, case.k, case.v, cu], follow_placement=True) as syncs, \
            counting_as_npu(syncs):
        forward(attention, q=case.q, k=case.k, v=case.v, cu_seqlens=cu, bsz=1, seq_len=case.q.shape[0])
        forward(attention, q=case.q, k=case.k, v=case.v, cu_seqlens=cu, bsz=1, seq_len=case.q.shape[0])
        cu[1:] = torch.tensor([100, 200, 200], dtype=torch.int32)
        out = forward(attention, q=case.q, k=case.k, v=case.v, cu_seqlens=cu, bsz=1, seq_len=case.q.shape[0])
    assert syncs.count == 2, syncs.events
    from npu_shim.testing.reference import attention_f64

    ref = attention_f64(case.q, case.k, case.v, [0, 100, 200, 200])
    assert (out.double() - ref).abs().max().item() <= 2e-2


def test_uninstall_restores_upstream(vision):
    patched = vision.VisionAscendAttention.__dict__["forward"]
    upstream = _upstream(vision)
    npu_shim.uninstall()
    try:
        assert vision.VisionAscendAttention.__dict__["forward"] is upstream
    finally:
        npu_shim.install()
    assert replacement_of(vision.VisionAscendAttention.__dict__["forward"], NAME) is not None
    assert patched is not vision.VisionAscendAttention.__dict__["forward"]


@pytest.mark.claimed(NAME, per_family=True)
def test_switched_off_is_upstream_and_strict_raises_on_another_shape(vision, run_python, make_env):
    placeholders = os.path.join(os.path.dirname(os.path.dirname(__file__)), "placeholders")
    off = run_python(
        "import json, importlib, npu_shim\n"
        "m = importlib.import_module(%r)\n"
        "rows = {r['name']: [r['state'], r['reason']] for r in npu_shim.status()}\n"
        "from npu_shim.patches._shared.structure import replacement_of\n"
        "f = m.VisionAscendAttention.__dict__['forward']\n"
        "print(json.dumps([rows[%r], replacement_of(f, %r) is not None]))" % (TARGET, NAME, NAME),
        env=make_env(NPU_SHIM_EMULATE="1", NPU_SHIM_DISABLE=NAME, PYTHONPATH=placeholders), timeout=600)
    row, patched = json.loads(off.stdout.strip().splitlines()[-1])
    assert row == ["disabled", "listed in NPU_SHIM_DISABLE"] and patched is False

    strict = run_python(
        "import importlib, inspect, npu_shim\n"
        "plain = inspect.signature\n"
        "def other_shape(obj, *a, **k):\n"      # a release whose forward takes other arguments
        "    sig = plain(obj, *a, **k)\n"
        "    if getattr(obj, '__qualname__', '') == 'VisionAscendAttention.forward':\n"
        "        return sig.replace(parameters=list(sig.parameters.values())[:4])\n"
        "    return sig\n"
        "inspect.signature = other_shape\n"
        "importlib.import_module(%r)\n" % TARGET,
        env=make_env(NPU_SHIM_EMULATE="1", NPU_SHIM_STRICT="1", PYTHONPATH=placeholders),
        check=False, timeout=600)
    assert strict.returncode != 0
    assert "PatchError" in strict.stderr and NAME in strict.stderr
    assert "VisionAscendAttention.forward takes ['self', 'q', 'k', 'v']" in strict.stderr
