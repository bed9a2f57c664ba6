"""Patch ``vllm.dots_ocr_host_lengths``: dots.ocr's vision tower builds ``cu_seqlens`` from the host
grid list the model hands it, and copies it, the grid and its rotary ids to the device without
blocking.

Towers, stand-ins and calls: :mod:`npu_shim.testing.census` (vLLM's own ``DotsVisionTransformer``
from a tiny config, 3 layers, called with the grid as a host list, as the model calls it; CPU with
emulated torch_npu ops and a stand-in device; two forwards). Here, for both device classes: 0
device->host reads and 0 blocking host->device copies per whole forward with the shim, upstream's
beside it (1 per layer in vllm-ascend's untouched attention, 1 for ``repeat_interleave``'s output
size, 2 blocking copies: the grid and the rotary index), output ``torch.equal`` to upstream's and
close to vLLM's TORCH_SDPA tower and a float64 copy (``npu_shim.testing.attention_f64``); the
copies carry upstream's values (the grid, ``cu_seqlens`` with the host tensor kept on it); a grid
that is not a host list goes to upstream's forward; the replacement is upstream's forward and
``rot_pos_emb`` with the family's edits, and the check refuses a tower without their anchors (the
other family's included); the disable switch brings the reads back with the same output; strict
mode raises on a tower no family's anchors fit.
"""
import pytest

from npu_shim.patch import FamilyContext, TargetMismatch

PATCH_NAME = "vllm.dots_ocr_host_lengths"
TOWER = "dots.ocr"

pytestmark = [pytest.mark.claimed(PATCH_NAME), pytest.mark.patch(PATCH_NAME, "vllm.mm_encoder_attn")]

# |tower - float64 tower| and |tower - TORCH_SDPA tower|, relative to max |float64 tower| (no
# floor); measured worst over the census towers (latest-vllm and vllm-0.30, benchmarks/results/
# census-*.json): bfloat16 1.8e-2, float16 2.3e-3
TOWER_TOL = {"bfloat16": 1e-1, "float16": 8e-3}


@pytest.fixture(scope="module")
def stack():
    from npu_shim.testing import census

    return census.setup()


def tower_class():
    from npu_shim.testing import census

    return census._MODULES[TOWER].DotsVisionTransformer


def test_status_names_the_family(stack):
    from npu_shim.testing import claims

    found = claims.status_row(PATCH_NAME)
    assert found["state"] == "applied" and [found["family"]] == found["admitted"], found
    assert found["family"] == claims.claimed_family(PATCH_NAME).name


def test_whole_tower_forward_reads_nothing_back(stack, device_class):
    from npu_shim.testing import census

    runs = census.side_by_side(stack, TOWER, device_class)
    assert len(runs) == 2
    for run in runs:
        syncs, up_syncs = run.syncs, run.up_syncs
        print("%s %s forward %d: upstream %s -> shim %s"
              % (TOWER, device_class, run.index, up_syncs.summary(), syncs.summary()))
        assert (syncs.count, syncs.h2d_count) == (0, 0), ([str(e) for e in syncs.events], syncs.h2d_events)
        # upstream: vllm-ascend's attention once per layer, the repeat_interleave output size, and
        # the blocking copies (the grid list, the rotary ids indexing the device table): nothing else
        attention = [e for e in up_syncs.events if e.location.startswith("ops/mm_encoder_attention.py:")]
        repeat = [e for e in up_syncs.events if e.kind == "shape" and "dots_ocr.py" in e.location]
        assert len(attention) == run.layers > 0 and repeat, up_syncs.summary()
        assert up_syncs.count == len(attention) + len(repeat), up_syncs.summary()
        assert up_syncs.h2d_count > 0, up_syncs.h2d_events
        census.assert_matches_references(stack, TOWER, run, TOWER_TOL)


def _forward_copies(stack, monkeypatch, tower, grid):
    """The tensors one forward moves to a device (``.to`` with a device), and the output."""
    import torch

    from npu_shim.testing import census, towers

    x = census.pixel_values(TOWER, tower, grid)
    moved = []
    real_to = torch.Tensor.to

    def spy_to(self, *args, **kwargs):
        if "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args):
            moved.append((self.clone(), kwargs.get("non_blocking", False)))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    with torch.inference_mode(), towers.registered(stack.attention["A2"]):
        out = tower(x, grid_thw=census.CENSUS[TOWER].grid_arg(grid))
    monkeypatch.undo()
    return moved, out


def test_the_copies_carry_upstreams_values_non_blocking(stack, monkeypatch):
    import torch

    from npu_shim.patches._shared import host_record
    from npu_shim.testing import census

    tower = census.build(stack, TOWER, stack.attention["A2"])
    grid = census.grids(1, TOWER)
    moved, _ = _forward_copies(stack, monkeypatch, tower, grid)
    ints = [(t, non_blocking) for t, non_blocking in moved if not t.is_floating_point()]
    frames = sum(t for t, _, _ in grid)
    lengths = [h * w for t, h, w in grid for _ in range(t)]
    cu_seqlens = torch.tensor([0] + [sum(lengths[:i + 1]) for i in range(frames)], dtype=torch.int32)
    # the rotary ids, the grid and cu_seqlens, each once and each non-blocking
    assert [t.shape for t, _ in ints] == [(sum(lengths), 2), (len(grid), 3), (frames + 1,)], [t.shape for t, _ in ints]
    assert all(non_blocking for _, non_blocking in ints)
    assert torch.equal(ints[1][0], torch.tensor(grid)) and torch.equal(ints[2][0], cu_seqlens)

    # the host tensor kept on the copy is the copy's values
    kept = []
    real_remember = host_record.remember

    def spy_remember(device_tensor, host):
        kept.append((device_tensor.clone(), host.clone()))
        return real_remember(device_tensor, host)

    monkeypatch.setattr(host_record, "remember", spy_remember)
    with torch.inference_mode():
        tower(census.pixel_values(TOWER, tower, grid), grid_thw=census.CENSUS[TOWER].grid_arg(grid))
    monkeypatch.undo()
    assert len(kept) == 1 and torch.equal(kept[0][0], kept[0][1]) and torch.equal(kept[0][1], cu_seqlens)


def test_a_grid_that_is_not_a_host_list_goes_to_upstreams_forward(stack):
    import torch

    import npu_shim
    from npu_shim.patches.vllm import dots_ocr_host_lengths as patch
    from npu_shim.testing import census, towers

    assert patch.host_list([[1, 4, 4], (2, 8, 4)])
    for not_host in ([[1, torch.tensor(4), 4]], torch.tensor([[1, 4, 4]]), [[1, 4]], [], [[True, 4, 4]]):
        assert not patch.host_list(not_host), not_host
    tower = census.build(stack, TOWER, stack.attention["A2"])
    grid = census.grids(0, TOWER)
    x = census.pixel_values(TOWER, tower, grid)
    before = npu_shim.stats()[PATCH_NAME]["upstream_calls"]
    with torch.inference_mode(), towers.registered(stack.attention["A2"]):
        from_list = tower(x, grid_thw=census.CENSUS[TOWER].grid_arg(grid))
        assert npu_shim.stats()[PATCH_NAME]["upstream_calls"] == before
        from_tensor = tower(x, grid_thw=torch.tensor(grid))             # upstream's forward takes it too
    assert npu_shim.stats()[PATCH_NAME]["upstream_calls"] == before + 1
    assert torch.equal(from_list, from_tensor)


def _another_forward(self, hidden_states, grid_thw):
    return hidden_states


def edit_diff(function, edits):
    """The lines ``edits`` add (``+``) to and remove (``-``) from ``function``'s source, stripped."""
    import difflib

    from npu_shim.patches._shared.source_edit import edited_source

    before, after = edited_source(function, ()).splitlines(), edited_source(function, edits).splitlines()
    return [line[0] + line[2:].strip() for line in difflib.ndiff(before, after) if line[:1] in "+-"]


def test_the_edits_and_the_check_refusing_a_tower_without_their_anchors(stack):
    import types

    from npu_shim.patches.vllm import dots_ocr_host_lengths as patch
    from npu_shim.testing import census, claims

    module = census._MODULES[TOWER]
    cls = tower_class()
    upstream = vars(cls)["forward"].__wrapped_upstream__
    family = claims.claimed_family(PATCH_NAME).load()
    other = patch.GRID_THW if family is patch.GRID_THW_TENSOR else patch.GRID_THW_TENSOR
    grid = family.device_grid
    assert edit_diff(vars(cls)["rot_pos_emb"], patch.IDS_NON_BLOCKING) == [
        "+pos_ids = pos_ids.to(device=rotary_pos_emb_full.device, non_blocking=True)"]
    changed = edit_diff(upstream, family.edits())
    assert [line for line in changed if line[0] == "+"] == [
        "+rotary_pos_emb = ids_non_blocking(self, grid_thw)",
        "+host_grid_thw = torch.tensor(grid_thw, dtype=torch.long)",
        "+%s = host_grid_thw.to(device=hidden_states.device, non_blocking=True)" % grid,
        "+cu_seqlens = torch.repeat_interleave(host_grid_thw[:, 1] * host_grid_thw[:, 2], host_grid_thw[:, 0])"
        ".cumsum(dim=0, dtype=%s.dtype if torch.jit.is_tracing() else torch.int32)" % grid,
        "+host_cu_seqlens = cu_seqlens",
        "+cu_seqlens = cu_seqlens.to(device=hidden_states.device, non_blocking=True)",
        "+host_record.remember(cu_seqlens, host_cu_seqlens)"], changed
    assert len([line for line in changed if line[0] == "-"]) == 3, changed

    def holding(**methods):
        fake = types.SimpleNamespace(**{k: v for k, v in vars(module).items() if not k.startswith("__")})
        setattr(fake, patch.TOWER, type(cls.__name__, (), dict(vars(cls), **dict({"forward": upstream}, **methods))))
        return fake

    context = FamilyContext(PATCH_NAME)
    family.check(holding(), context)
    for what, target, check in (("another forward", holding(forward=_another_forward), family),
                                ("another rot_pos_emb", holding(rot_pos_emb=_another_forward), family),
                                ("the other family's forward", holding(), other)):
        with pytest.raises(TargetMismatch, match="found 0 times"):
            check.check(target, context)
            pytest.fail(what)


@pytest.mark.claimed(PATCH_NAME, per_family=True)
def test_disabled_the_reads_come_back(stack, tmp_path):
    """With the patch disabled (NPU_SHIM_DISABLE) the attention reads cu_seqlens back again and
    repeat_interleave reads its output size (2 per forward), with the same output."""
    import torch

    from npu_shim.testing import switches

    runs = switches.census_tower_disabled_and_applied(TOWER, PATCH_NAME, tmp_path)
    assert (runs[True][0], runs[False][0]) == ("disabled 2", "applied 0")
    assert torch.equal(runs[True][1], runs[False][1])


STRICT_CODE = """
import json, npu_shim
from npu_shim.patches.vllm import dots_ocr_host_lengths as patch
from npu_shim.patches._shared.source_edit import InsertBefore
patch.IDS_NON_BLOCKING = (InsertBefore("rotary_pos_emb = rotary_pos_emb_full[ids].flatten(1)", "pass"),)
from npu_shim.testing import census
census.setup()
m = census._MODULES[%r]
row = next(r for r in npu_shim.status() if r["name"] == %r)
print(json.dumps([row["state"], row["reason"], hasattr(vars(m.DotsVisionTransformer)["forward"],
                                                       "__wrapped_upstream__")]))
""" % (TOWER, PATCH_NAME)


@pytest.mark.claimed(PATCH_NAME, per_family=True)
@pytest.mark.parametrize("strict", ["0", "1"])
def test_another_body_inside_the_window_skips_or_raises_in_strict_mode(stack, strict):
    from npu_shim.testing import switches

    switches.assert_skipped_or_raised(STRICT_CODE, strict, token="rotary_pos_emb_full[ids]", reason="found 0 times")
