"""Patch ``sglang.vision_head_pad`` on the real sglang wheels: 0.5.14 (family no-fallback, over
``sglang.vision_device_lengths``), 0.5.19 and 0.5.23 (family sdpa-fallback, over
``sglang.vision_host_lengths``; 0.5.23 with images padded to a common length too).

What runs is sglang's own ``VisionAscendAttention`` of the installed release (through whatever the
other vision patch made of its forward), torch_npu the emulation at its default CANN 8.5.0, whose FIA
refuses TND head dims other than 64/128/192 as CANN does (vllm-ascend PR #9632; FlagOS
sglang-plugin-FL for CANN 8.5). Checked:

* head dims 72 and 80: the FIA call gets q/k/v of head dim 128 and the model's scale (D ** -0.5);
  the output has head dim D and matches the float64 reference of the unpadded attention;
* the same call without the shim (upstream's forward) fails in the emulated op, as on the hardware;
* head dims 64 and 128: upstream's call and output, untouched (counted as upstream calls);
* the CANN decision: what status notes for 8.5.0 / 9.0.0 / unreadable (pad) and 8.2.RC1 (TND 192
  only: no pad, upstream's call); NPU_SHIM_SGLANG_VISION_HEAD_PAD=0 turns the patch off.

And as serving runs it: sglang's own Qwen2.5-VL tower (:mod:`npu_shim.testing.sglang_towers`) at
its real head dim, 80 (16 heads of 80 in the model; 2 of 80 here), through the tower's own forward.
Its ``VisionAttention.forward`` hands ``output_ws=None`` to every backend call outside NPU-graph
mode: each of its 4 layers' FIA call gets head dim 128, the tower's output matches the float64
tower, with the same device->host reads, where they were, as the head-64 tower's; upstream's tower
is refused by the op. An ``output_ws`` buffer passed (graph mode) is not padded, and status says so.
"""
import importlib
import json
import os

import pytest

import npu_shim
from npu_shim.patches._shared.structure import replacement_of, upstream_of
from npu_shim.patches.sglang import vision_head_pad as declaration
from npu_shim.testing import claims

NAME = declaration.PATCH.name
TARGET = declaration.TARGET
LAYERS = 2
LANES = pytest.mark.claimed(NAME, pinned={"sglang": ["0.5.14", "0.5.19", "0.5.23"]})
pytestmark = [LANES, pytest.mark.patch(NAME)]


@pytest.fixture(scope="module")
def vision():
    from npu_shim import emulation
    from npu_shim.testing import sglang_vision

    emulation.install()
    npu_shim.install()
    importlib.import_module(TARGET)
    with sglang_vision.npu_platform() as module:
        yield module


def _padded_layout(vision):
    return "valid_indices" in upstream_of(vision.VisionAscendAttention.forward).__code__.co_varnames


def _query(call):
    return call.kwargs["query"] if "query" in call.kwargs else call.args[0]


def test_applies_over_the_other_vision_patch(vision):
    row = claims.status_row(NAME)
    assert row["state"] == "applied" and row["family"] == claims.claimed_family(NAME).name, row
    forward = vision.VisionAscendAttention.__dict__["forward"]
    assert forward.__npu_shim_patch__ == NAME
    under = forward.__wrapped_upstream__
    other = getattr(under, "__npu_shim_patch__", None)
    assert other in ("sglang.vision_device_lengths", "sglang.vision_host_lengths"), other
    assert upstream_of(forward).__module__ == TARGET and not hasattr(upstream_of(forward), "__npu_shim_patch__")


def _cases():
    out = []
    for d in (72, 80):
        for lengths in ((24,), (24, 40, 8)):
            out.append(pytest.param(d, lengths, False, id="D%d-%s-packed" % (d, "x".join(map(str, lengths)))))
    out.append(pytest.param(72, (24, 40, 8), True, id="D72-24x40x8-padded"))
    return out


@pytest.mark.parametrize("d, lengths, padded", _cases())
def test_64_to_128_is_padded_with_the_models_scale_and_matches_float64(vision, d, lengths, padded):
    import torch

    from npu_shim.testing import sglang_vision

    if padded and not _padded_layout(vision):
        pytest.skip("this release has no padded-images layout (0.5.20+)")
    case = sglang_vision.make_case(lengths, padded=padded, head_dim=d, dtype=torch.bfloat16)
    before = npu_shim.stats()[NAME]
    out, syncs, calls = sglang_vision.run_layers(vision, case, LAYERS)
    after = npu_shim.stats()[NAME]
    assert after["calls"] - before["calls"] == LAYERS and after["upstream_calls"] == before["upstream_calls"]
    assert [c.name for c in calls] == ["npu_fused_infer_attention_score"] * LAYERS
    for call in calls:
        assert _query(call).shape[-1] == 128 and call.kwargs["input_layout"] == "TND"
        assert call.kwargs["scale"] == pytest.approx(d ** -0.5)
    assert out.shape == case.q.shape and out.is_contiguous()
    err = sglang_vision.error(case, out)
    assert err <= sglang_vision.TOLERANCES[torch.bfloat16], err
    note = claims.status_row(NAME)["notes"]
    assert any(n.startswith("CANN 8.5.0 (from torch_npu.npu.utils.get_cann_version('CANN'))") for n in note), note


@pytest.mark.parametrize("d", [72, 80])
def test_without_the_shim_the_emulated_op_refuses_the_unpadded_call(vision, d):
    import torch

    from npu_shim.testing import sglang_vision

    case = sglang_vision.make_case((24, 40), head_dim=d, dtype=torch.bfloat16)
    upstream = upstream_of(vision.VisionAscendAttention.forward)
    with pytest.raises(ValueError, match=r"When layout is TND, queryD\(%d\), keyD\(%d\) and valueD\(%d\) "
                                         r"must be same equal 192/128/64" % (d, d, d)):
        sglang_vision.run_layers(vision, case, 1, prepare=lambda *a, **k: None, forward=upstream)


@pytest.mark.parametrize("d", [64, 128])
def test_64_and_128_take_upstreams_path_untouched(vision, d):
    import torch

    from npu_shim.testing import sglang_vision

    case = sglang_vision.make_case((24, 40), head_dim=d, dtype=torch.bfloat16)
    before = npu_shim.stats()[NAME]["upstream_calls"]
    out, _, calls = sglang_vision.run_layers(vision, case, LAYERS)
    assert npu_shim.stats()[NAME]["upstream_calls"] == before + LAYERS
    inner = vision.VisionAscendAttention.__dict__["forward"].__wrapped_upstream__
    ref, _, ref_calls = sglang_vision.run_layers(vision, case, LAYERS, forward=inner)
    assert torch.equal(out, ref)
    assert [_query(c).shape for c in calls] == [_query(c).shape for c in ref_calls] == [case.q.shape] * LAYERS
    assert [c.kwargs["scale"] for c in calls] == [c.kwargs["scale"] for c in ref_calls]


@pytest.mark.parametrize("version, pad, words", [
    ("8.5.0", True, "CANN 8.5.0 (from here): TND takes head dims 64/128/192"),
    ("9.0.0", True, "CANN 9.0.0 (from here): TND takes head dims 64/128/192"),
    ("8.3.RC1", True, "CANN 8.3.RC1"),
    ("8.2.RC1", False, "TND takes query/key head dim 192 only before 8.3"),
    ("", True, "CANN release not readable ('' from here)"),
])
def test_the_cann_decision_and_its_words(version, pad, words):
    decided, sentence = declaration.cann_decision(version, "here")
    assert decided is pad and words in sentence, sentence


def test_toolkit_info_is_read_where_torch_npu_has_no_version(tmp_path):
    import platform

    folder = tmp_path / ("%s-linux" % platform.machine())
    folder.mkdir()
    (folder / "ascend_toolkit_install.info").write_text("package_name=Ascend-cann-toolkit\nversion=8.5.0\n")
    assert declaration.toolkit_version({"ASCEND_TOOLKIT_HOME": str(tmp_path)}) == (
        "8.5.0", "$ASCEND_TOOLKIT_HOME/%s-linux/ascend_toolkit_install.info" % platform.machine())
    version, looked = declaration.toolkit_version({})
    assert version == "" and "ASCEND_TOOLKIT_HOME" in looked


def test_on_cann_8_2_the_call_stays_upstreams(vision, monkeypatch):
    """The decision is read at the first padded call of an application: reinstalled under an emulated
    CANN 8.2.RC1, the patch does not pad (TND takes 192 only there) and says so."""
    import torch

    from npu_shim.testing import sglang_vision

    monkeypatch.setenv("NPU_SHIM_EMULATE_CANN", "8.2.RC1")
    npu_shim.uninstall()
    npu_shim.install()
    try:
        case = sglang_vision.make_case((24,), head_dim=72, dtype=torch.bfloat16)
        with pytest.raises(ValueError, match=r"emulated CANN 8\.2\.RC1\): When layout is TND, queryD\(72\) "
                                             r"or keyD\(72\) must be 192"):
            sglang_vision.run_layers(vision, case, 1)
        assert any("TND takes query/key head dim 192 only before 8.3" in n
                   for n in claims.status_row(NAME)["notes"])
    finally:
        monkeypatch.delenv("NPU_SHIM_EMULATE_CANN")
        npu_shim.uninstall()
        npu_shim.install()


@pytest.mark.claimed(NAME, pinned={"sglang": ["0.5.23"]})
def test_switched_off_is_upstream(vision, run_python, make_env):
    placeholders = os.path.join(os.path.dirname(os.path.dirname(__file__)), "placeholders")
    off = run_python(
        "import json, importlib, npu_shim\n"
        "from npu_shim.patches._shared.structure import replacement_of\n"
        "m = importlib.import_module(%r)\n"
        "rows = {r['name']: [r['state'], r['reason']] for r in npu_shim.status()}\n"
        "print(json.dumps([rows[%r], replacement_of(m.VisionAscendAttention.__dict__['forward'], %r) is None]))"
        % (TARGET, NAME, NAME),
        env=make_env(NPU_SHIM_EMULATE="1", NPU_SHIM_SGLANG_VISION_HEAD_PAD="0", PYTHONPATH=placeholders),
        timeout=600)
    row, absent = json.loads(off.stdout.strip().splitlines()[-1])
    assert row == ["disabled", "NPU_SHIM_SGLANG_VISION_HEAD_PAD=0"] and absent is True


TOWER = "Qwen2.5-VL"
TOWER_HEAD_DIM = 80      # Qwen2.5-VL's vision tower: hidden size 1280 over 16 heads
TOWER_DEPTH = 4          # npu_shim.testing.sglang_towers: the tiny tower's layers


@pytest.fixture(scope="module")
def tower80():
    import torch

    from npu_shim.testing import sglang_towers

    return sglang_towers.build(TOWER, torch.bfloat16, head_dim=TOWER_HEAD_DIM)


def test_qwen2_5_vl_tower_at_head_dim_80_is_padded_through_its_own_forward(tower80):
    """The tower's own forward (VisionAttention.forward passes ``output_ws=None``): padded, exact
    against the float64 tower, no read the head-64 tower does not make; not noted as graph mode."""
    import torch

    from npu_shim.testing import sglang_towers

    grid = sglang_towers.GRIDS[0]
    x = sglang_towers.pixel_values(tower80, grid)
    before = npu_shim.stats()[NAME]
    out, syncs, calls = sglang_towers.forward(TOWER, tower80, x, grid)
    after = npu_shim.stats()[NAME]
    assert after["calls"] - before["calls"] == TOWER_DEPTH
    assert after["upstream_calls"] == before["upstream_calls"]
    fia = [c for c in calls if c.name == declaration.FIA]
    assert len(fia) == TOWER_DEPTH
    for call in fia:
        assert _query(call).shape[-1] == 128 and call.kwargs["input_layout"] == "TND"
        assert call.kwargs["scale"] == pytest.approx(TOWER_HEAD_DIM ** -0.5)
    notes = claims.status_row(NAME)["notes"]
    assert not any("NPU-graph" in n for n in notes), notes
    ref = sglang_towers.reference_forward(TOWER, x, grid, head_dim=TOWER_HEAD_DIM)
    err = sglang_towers.relative_error(out, ref)
    assert err <= sglang_towers.TOLERANCES["bfloat16"], err
    tower64 = sglang_towers.build(TOWER, torch.bfloat16)
    _, syncs64, _ = sglang_towers.forward(TOWER, tower64, sglang_towers.pixel_values(tower64, grid), grid)
    sites = sorted(e.location for e in syncs.events)
    assert sites == sorted(e.location for e in syncs64.events), (syncs.summary(), syncs64.summary())
    assert syncs.h2d_count == syncs64.h2d_count
    print("Qwen2.5-VL tower, head dim %d, bfloat16: %d FIA calls at head dim 128, relative error %.2e vs "
          "float64, %d device->host reads (head 64: %d)" % (TOWER_HEAD_DIM, len(fia), err, syncs.count,
                                                            syncs64.count))


def test_qwen2_5_vl_tower_at_head_dim_80_upstream_is_refused(tower80):
    """The same tower's forward with the shim uninstalled: FIA's TND head-dim refusal (CANN 8.5)."""
    from npu_shim.testing import sglang_towers

    grid = sglang_towers.GRIDS[0]
    x = sglang_towers.pixel_values(tower80, grid)
    with pytest.raises(ValueError, match=r"When layout is TND, queryD\(80\), keyD\(80\) and valueD\(80\) "
                                         r"must be same equal 192/128/64"):
        sglang_towers.forward(TOWER, tower80, x, grid, upstream=True)


def test_an_output_buffer_is_graph_mode_and_not_padded(vision):
    """``output_ws`` a buffer (NPU-graph mode's runner): upstream's call as is, noted; ``output_ws=None``
    (what every eager call passes): padded."""
    import torch

    from npu_shim.testing import sglang_vision

    case = sglang_vision.make_case((24,), head_dim=72, dtype=torch.bfloat16)
    attention = sglang_vision.make_attention(vision, case)
    forward = vision.VisionAscendAttention.forward
    args = dict(q=case.q, k=case.k, v=case.v, cu_seqlens=case.cu_seqlens, bsz=1, seq_len=case.q.shape[0])
    before = npu_shim.stats()[NAME]
    out = forward(attention, output_ws=None, **args)
    assert out.shape == case.q.shape
    assert sglang_vision.error(case, out) <= sglang_vision.TOLERANCES[torch.bfloat16]
    assert npu_shim.stats()[NAME]["upstream_calls"] == before["upstream_calls"]
    with pytest.raises(ValueError, match=r"queryD\(72\)"):
        forward(attention, output_ws=torch.empty_like(case.q), **args)
    assert npu_shim.stats()[NAME]["upstream_calls"] == before["upstream_calls"] + 1
    assert any(n.startswith("NPU-graph mode (an output_ws buffer): the captured call keeps head dim 72")
               for n in claims.status_row(NAME)["notes"])
