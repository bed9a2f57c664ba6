"""sglang's own vision towers, whole, on every sglang lane: Qwen2.5-VL, Qwen3-VL and GLM-4V
(:mod:`npu_shim.testing.sglang_towers`: the installed release's tower classes, tiny random configs,
the ``ascend_attn`` backend, emulated ops, CPU), upstream (the shim uninstalled) -> shim
(``sglang.vision_device_lengths`` on 0.5.11 - 0.5.15, ``sglang.vision_host_lengths`` on 0.5.16 - 0.5.23).

Counted per forward, two forwards (three images, one of them two frames except for GLM-4V; then two
images): every device->host read, where it is made, and the blocking host->device copies. The
expected counts are built from the sites that read:

* the towers' own reads, upstream: Qwen2.5-VL 3 (``torch.unique_consecutive`` of the window bounds
  it built on the device from its host grid, then ``cu_seqlens`` and ``cu_window_seqlens`` moved to
  "cpu"); GLM-4V 2 per image (its position embedding copies the host lengths to the device and
  ``.repeat(lengths[i])`` reads each back, twice); Qwen3-VL none. With the shim none
  (``sglang.qwen2_5_vl_host_lengths``: the bounds built on the host; ``sglang.glm4v_host_lengths``:
  the sizes repeated by the host lengths);
* the vision attention's: before 0.5.16, 1 per layer where the tower hands it device lengths
  (Qwen3-VL; upstream) -> 0 (``sglang.qwen3_vl_host_lengths`` hands it the host lengths the tower
  built; ``sglang.vision_device_lengths`` alone makes it 1 per forward), 0 on host lengths; from
  0.5.16, 1 per metadata object (``.item()``) + 1 per layer (upstream) -> 0 (shim);
* blocking host->device copies, upstream: Qwen2.5-VL 4 and GLM-4V 1 (the towers' own), Qwen3-VL 0,
  and Qwen2.5-VL's ``rot_pos_emb``, which indexes the device rotary table with the position ids
  it built on the host (``rotary_pos_emb_full[pos_ids]``: the index goes over first, blocking; the
  counter counts that copy since it was checked against CUDA, benchmarks/results/cuda-syncs.txt,
  "host index into a device tensor"); with the shim 0 (the tower patches copy with
  ``non_blocking=True``, ``sglang.qwen2_5_vl_rotary_ids`` the position ids too).

Outputs: ``torch.equal`` to upstream's (the same ops on the same data), and within tolerance of the
float64 tower (same weights rounded to the dtype, attention ``attention_f64``): relative error
measured worst 4.1e-2 (GLM-4V, bfloat16; its position embedding interpolates in the model dtype).
On 0.5.16 upstream hands FIA per-image lengths: with two images or more the op refuses them (their
last element is not the token count; the emulation refuses them as the real op does); the shim's
output is checked against float64 there. 310P (float16): the ops before 0.5.14 (``_npu_flash_attention_unpad``);
from 0.5.14 sglang's vision attention calls FIA, which the vendor does not document for 310P: the
emulation refuses it on both sides, as it would fail there.
"""
import pytest

HOST = "sglang.vision_host_lengths"
DEVICE = "sglang.vision_device_lengths"
QWEN2_5_VL = "sglang.qwen2_5_vl_host_lengths"
GLM4V = "sglang.glm4v_host_lengths"
QWEN3_VL = "sglang.qwen3_vl_host_lengths"        # 0.5.11 - 0.5.15
QWEN2_5_VL_ROTARY = "sglang.qwen2_5_vl_rotary_ids"
TOWER_PATCH = {"Qwen2.5-VL": QWEN2_5_VL, "GLM-4V": GLM4V, "Qwen3-VL": QWEN3_VL}

pytestmark = [pytest.mark.claimed(HOST, DEVICE, QWEN2_5_VL, GLM4V, QWEN3_VL, QWEN2_5_VL_ROTARY),
              pytest.mark.patch(HOST, DEVICE, QWEN2_5_VL, GLM4V, QWEN3_VL, QWEN2_5_VL_ROTARY)]

DEPTH = {"Qwen2.5-VL": 4, "Qwen3-VL": 3, "GLM-4V": 3}
METADATA_OBJECTS = {"Qwen2.5-VL": 2, "Qwen3-VL": 1, "GLM-4V": 1}     # window + full; one
DEVICE_LENGTHS = ("Qwen3-VL",)      # hands the attention a device copy of its host lengths
H2D_UPSTREAM = {"Qwen2.5-VL": 4, "Qwen3-VL": 0, "GLM-4V": 1}
H2D_ROTARY_INDEX = {"Qwen2.5-VL": 1}      # rot_pos_emb's host position ids into the device table
ATTENTION_FILES = ("attention/vision.py", "sglang/vision_device_lengths.py", "sglang/vision_host_lengths.py")
TOLERANCE = {"bfloat16": 6e-2, "float16": 1.5e-2}


def _release():
    from npu_shim.engine import guards

    return guards.installed_version("sglang")


def _host_family():
    """sglang.vision_host_lengths' family at the installed release (None before its window: the
    vision attention takes the tower's lengths as they are, 0.5.11 - 0.5.15)."""
    from npu_shim.testing.claims import claimed_family

    return claimed_family(HOST)


def _hands_fia_per_image_lengths():
    """Upstream's metadata branch reads back the per-image ``seq_lens`` (0.5.16), which FIA (TND)
    refuses from two images on: the host-lengths family's own fact."""
    family = _host_family()
    return family is not None and family.load().reads == "seq_lens"


def _vision_attention_calls_fia():
    """sglang's vision attention module calls FIA (from 0.5.14), read from its source."""
    import inspect

    from sglang.srt.layers.attention import vision

    return "npu_fused_infer_attention_score" in inspect.getsource(vision)


def tower_reads(name, grid, upstream):
    """The tower's own reads, outside the attention (0 with the shim's tower patches)."""
    if not upstream:
        return 0
    return {"Qwen2.5-VL": 3, "Qwen3-VL": 0, "GLM-4V": 2 * len(grid)}[name]


def h2d(name, upstream):
    return H2D_UPSTREAM[name] + H2D_ROTARY_INDEX.get(name, 0) if upstream else 0


def attention_reads(name, upstream):
    if _host_family() is None:
        # Qwen3-VL: upstream hands the attention a device copy (1 read per layer); the shim's
        # tower hands it the host lengths (sglang.vision_device_lengths alone: 1 per forward)
        return DEPTH[name] if upstream and name in DEVICE_LENGTHS else 0
    return METADATA_OBJECTS[name] + DEPTH[name] if upstream else 0


@pytest.fixture(scope="module")
def stack():
    from npu_shim.testing import sglang_towers

    return sglang_towers.setup()


@pytest.mark.parametrize("name", ["Qwen2.5-VL", "Qwen3-VL", "GLM-4V"])
def test_tower_reads_and_outputs_a2(stack, name):
    import torch

    import npu_shim
    from npu_shim.testing import sglang_towers
    from npu_shim.testing.claims import claimed_family

    applied = {r["name"]: r["state"] for r in npu_shim.status()}
    assert applied[HOST if _host_family() is not None else DEVICE] == "applied", applied
    if claimed_family(TOWER_PATCH[name]) is not None:
        assert applied[TOWER_PATCH[name]] == "applied", applied
    for run in sglang_towers.side_by_side(name, torch.bfloat16):
        shim = run.syncs
        print("%s sglang %s forward %d: upstream %s -> shim %s; error %.2e; shim reads at %s"
              % (name, _release(), run.index, run.up_syncs and run.up_syncs.summary(), shim.summary(),
                 run.error, run.sites()))
        tower, attention = tower_reads(name, run.grid, upstream=False), attention_reads(name, upstream=False)
        assert shim.count == tower + attention, run.sites()
        in_attention = sum(n for site, n in run.sites().items() if site.startswith(ATTENTION_FILES))
        assert in_attention == attention, run.sites()
        assert shim.h2d_count == h2d(name, upstream=False), shim.h2d_events
        assert run.error <= TOLERANCE["bfloat16"], run.error
        if _hands_fia_per_image_lengths() and len(run.grid) > 1:
            # upstream hands FIA (TND) per-image lengths: refused, as the real op refuses them (where
            # they decrease, and where they increase but end short of the token count: the second
            # forward's two images, 16 and 96 tokens)
            assert run.up is None, "upstream's per-image lengths ran: %s" % run.up_calls
            assert "actual_seq_lengths" in run.up_failure, run.up_failure
            continue
        assert run.up is not None, run.up_failure
        assert run.up_syncs.count == (tower_reads(name, run.grid, upstream=True)
                                      + attention_reads(name, upstream=True)), run.sites(upstream=True)
        assert run.up_syncs.h2d_count == h2d(name, upstream=True)
        assert torch.equal(sglang_towers.tower_output(run.out), sglang_towers.tower_output(run.up))
        assert [c.name for c in run.calls] == [c.name for c in run.up_calls]


@pytest.mark.parametrize("name", ["Qwen2.5-VL", "Qwen3-VL", "GLM-4V"])
def test_tower_310p_float16(stack, name, monkeypatch):
    import torch

    from npu_shim.testing import sglang_towers
    from npu_shim.testing.towers import SOC_310P

    monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", SOC_310P)
    if _vision_attention_calls_fia():
        # sglang's vision attention calls FIA from 0.5.14; not documented for 310P (no dtype there)
        tower = sglang_towers.build(name, torch.float16)
        grid = sglang_towers.TOWERS[name].grids[1]
        x = sglang_towers.pixel_values(tower, grid)
        for upstream in (True, False):
            with pytest.raises(ValueError, match="not documented for .*310P"):
                sglang_towers.forward(name, tower, x, grid, upstream=upstream)
        return
    for run in sglang_towers.side_by_side(name, torch.float16):
        assert run.syncs.count == tower_reads(name, run.grid, upstream=False) + attention_reads(name, upstream=False), \
            run.sites()
        assert run.up_syncs.count == tower_reads(name, run.grid, upstream=True) + attention_reads(name, upstream=True)
        assert run.syncs.h2d_count == h2d(name, upstream=False)
        assert run.up_syncs.h2d_count == h2d(name, upstream=True)
        assert torch.equal(run.out, run.up)
        assert run.error <= TOLERANCE["float16"], run.error
