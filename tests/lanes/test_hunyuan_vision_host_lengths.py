"""Patch ``vllm.hunyuan_vision_host_lengths``: HunYuan-Vision's tower splits its output by the
host ``cu_seqlens`` it built, not by a read-back of its device copy.

Towers, stand-ins and calls: :mod:`npu_shim.testing.census` (vLLM's own
``HunYuanVisionTransformer`` from a tiny random config, 3 layers; CPU with emulated torch_npu
ops and a stand-in device; two images per forward, as the tower takes images only). Here, for
both device classes: 0 device->host reads per whole tower forward with the shim, upstream's
split read beside it (vLLM's tower code, ``towers.upstream_methods``), output ``torch.equal`` to
upstream's and close to vLLM's TORCH_SDPA tower and a float64 copy
(``npu_shim.testing.attention_f64``); the copy to the device is upstream's (same op, same
arguments); a grid on the device (a device stand-in too) goes to upstream's forward; the
replacement is upstream's forward with two edits, and the family's check refuses a forward
without their anchors; the disable switch brings the read back with the same output; strict mode
raises on a forward without them.
"""
import pytest

from npu_shim.patch import FamilyContext

PATCH_NAME = "vllm.hunyuan_vision_host_lengths"
TOWER = "HunYuan-Vision"

pytestmark = [pytest.mark.claimed(PATCH_NAME), pytest.mark.patch(PATCH_NAME)]

# |tower - float64 tower| and |tower - TORCH_SDPA tower|, relative to max |float64 tower| (no
# floor); measured worst over the census towers (latest-vllm and vllm-0.30, benchmarks/results/
# census-*.json): bfloat16 1.6e-2, float16 2.0e-3
TOWER_TOL = {"bfloat16": 1e-1, "float16": 8e-3}


def release():
    from importlib.metadata import version

    return version("vllm")


@pytest.fixture(scope="module")
def stack():
    from npu_shim.testing import census

    return census.setup()


def row():
    import npu_shim

    return next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)


def tower_class():
    from npu_shim.testing import census

    return census._MODULES[TOWER].HunYuanVisionTransformer


def test_status_names_the_family(stack):
    from npu_shim.testing import claims

    found = row()
    assert found["state"] == "applied" and [found["family"]] == found["admitted"], found
    assert found["family"] == claims.claimed_family(PATCH_NAME).name


def _upstream_fails_too(stack, device_class, failure):
    """Whether vLLM's own tower with vllm-ascend's untouched class fails as the shim's did."""
    from npu_shim.testing import census, towers

    tower = census.build(stack, TOWER, stack.upstream[device_class], dtype=towers.hardware_dtype(device_class))
    grid = census.grids(0, TOWER)
    with towers.upstream_methods(census._MODULES[TOWER]):
        try:
            census.call(TOWER, tower, stack.upstream[device_class], census.pixel_values(TOWER, tower, grid), grid)
        except type(failure) as exc:
            return str(exc) == str(failure)
    return False


def test_whole_tower_forward_reads_nothing_back(stack, device_class):
    from npu_shim.testing import census

    try:
        runs = census.side_by_side(stack, TOWER, device_class)
    except RuntimeError as exc:
        # vllm-ascend 0.14's 310P class returns HunYuan's attention output in another shape:
        # not this patch's doing when upstream's own code fails the same way
        assert _upstream_fails_too(stack, device_class, exc), exc
        pytest.skip("vllm-ascend's %s attention fails on HunYuan-Vision's tower here, upstream's code "
                    "as well: %s" % (device_class, exc))
    assert len(runs) == 2
    for run in runs:
        syncs, up_syncs = run.syncs, run.up_syncs
        print("%s vllm %s %s forward %d: upstream %s -> shim %s"
              % (TOWER, release(), device_class, run.index, up_syncs.summary(), syncs.summary()))
        assert syncs.count == 0, [str(e) for e in syncs.events]
        # upstream's split read (the tower's own .tolist() of its device cu_seqlens' differences);
        # the attention's own reads where vllm-ascend's release makes them (0.14: one per layer and
        # image, which vllm.mm_encoder_attn removes)
        split = [e for e in up_syncs.events if e.kind == "tolist" and e.location.endswith(" in forward")
                 and "hunyuan_vision.py" in e.location]
        assert split, up_syncs.summary()
        assert syncs.h2d_count == up_syncs.h2d_count == 0
        census.assert_matches_references(stack, TOWER, run, TOWER_TOL)


def _copies_in_forward(stack, monkeypatch, grid_arg=None):
    """The int32 copies to a device one forward makes, as (args, kwargs), and the output."""
    import torch

    from npu_shim.testing import census, towers

    tower = census.build(stack, TOWER, stack.attention["A2"])
    grid = census.grids(0, TOWER)
    x = census.pixel_values(TOWER, tower, grid)
    copies = []
    real_to = torch.Tensor.to

    def spy_to(self, *args, **kwargs):
        to_device = "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)
        if self.dtype == torch.int32 and self.dim() == 1 and to_device:
            copies.append((args, kwargs))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    with torch.inference_mode(), towers.registered(stack.attention["A2"]):
        out = tower(x, grid_thw=grid_arg(grid) if grid_arg else census.CENSUS[TOWER].grid_arg(grid))
    monkeypatch.undo()
    return tower, copies, out


def test_the_copy_is_upstreams(stack, monkeypatch):
    """The tower copies its int32 cu_seqlens to the device once, as upstream does."""
    from npu_shim.testing import census, towers

    tower, copies, _ = _copies_in_forward(stack, monkeypatch)
    assert copies == [((), {"device": tower.device, "non_blocking": True})], copies
    with towers.upstream_methods(census._MODULES[TOWER]):
        _, upstream_copies, _ = _copies_in_forward(stack, monkeypatch)
    assert upstream_copies == copies


def test_a_device_grid_goes_to_upstreams_forward(stack):
    import torch

    from npu_shim.patches.vllm import hunyuan_vision_host_lengths as patch

    assert patch.host_grid([[1, 8, 8], [1, 4, 12]])
    assert patch.host_grid(torch.tensor([[1, 8, 8]]))
    assert patch.host_grid([torch.tensor([1, 8, 8])])
    on_device = torch.empty(1, 3, dtype=torch.long, device="meta")
    assert not patch.host_grid(on_device)
    assert not patch.host_grid([on_device[0]])

    import npu_shim

    before = dict(npu_shim.stats().get(PATCH_NAME, {}))
    calls = []
    upstream = vars(tower_class())["forward"].__wrapped_upstream__
    with pytest.MonkeyPatch.context() as monkeypatch:
        # upstream's forward, spied on where the replacement finds it (its closure)
        replacement = vars(tower_class())["forward"]
        cell = next(c for c in replacement.__closure__ if c.cell_contents is upstream)
        monkeypatch.setattr(cell, "cell_contents", lambda *args: calls.append(args) or "upstream")
        assert replacement(None, "x", on_device) == "upstream"
        assert replacement(None, "x", [on_device[0]]) == "upstream"
    assert len(calls) == 2
    after = npu_shim.stats()[PATCH_NAME]
    assert after["upstream_calls"] == before.get("upstream_calls", 0) + 2, after


def test_a_grid_on_the_device_stand_in_goes_to_upstreams_forward(stack):
    """A grid the counter stands in for a device tensor (``.device`` is ``cpu:0``) is not host data
    (:func:`npu_shim.patches._shared.host_data.is_host`): the replacement hands it to upstream's
    forward. Before the tower patches shared one rule, this patch took any CPU device, ``cpu:0``
    too, for the host."""
    import torch

    import npu_shim
    from npu_shim.patches.vllm import hunyuan_vision_host_lengths as patch
    from npu_shim.testing import count_host_syncs

    upstream = vars(tower_class())["forward"].__wrapped_upstream__
    replacement = vars(tower_class())["forward"]
    before = npu_shim.stats()[PATCH_NAME]["upstream_calls"]
    calls = []
    stand_in = torch.tensor([[1, 8, 8], [1, 4, 12]])
    with pytest.MonkeyPatch.context() as monkeypatch:
        cell = next(c for c in replacement.__closure__ if c.cell_contents is upstream)
        monkeypatch.setattr(cell, "cell_contents", lambda *args: calls.append(args) or "upstream")
        with count_host_syncs(device_tensors=[stand_in], follow_placement=True):
            assert stand_in.device == torch.device("cpu", 0)
            rows = [stand_in[0], stand_in[1]]
            assert not patch.host_grid(stand_in) and not patch.host_grid(rows)
            assert replacement(None, "x", stand_in) == "upstream"
            assert replacement(None, "x", rows) == "upstream"
    assert len(calls) == 2
    assert npu_shim.stats()[PATCH_NAME]["upstream_calls"] == before + 2


def edit_diff(function, edits):
    """The lines ``edits`` add (``+``) to and remove (``-``) from ``function``'s source, stripped."""
    import difflib

    from npu_shim.patches._shared.source_edit import edited_source

    before, after = edited_source(function, ()).splitlines(), edited_source(function, edits).splitlines()
    return [line[0] + line[2:].strip() for line in difflib.ndiff(before, after) if line[:1] in "+-"]


def test_the_edit_and_a_forward_without_its_anchor(stack):
    import inspect
    import linecache
    import textwrap
    import types

    from npu_shim.patch import TargetMismatch
    from npu_shim.patches.vllm import hunyuan_vision_host_lengths as patch

    upstream_forward = vars(tower_class())["forward"].__wrapped_upstream__
    assert edit_diff(upstream_forward, patch.HOST_SPLIT_SIZES) == [
        "+host_cu_seqlens = cu_seqlens",
        "-split_lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()",
        "+split_lengths = (host_cu_seqlens[1:] - host_cu_seqlens[:-1]).tolist()"]
    module = types.SimpleNamespace(HunYuanVisionTransformer=type(
        "HunYuanVisionTransformer", (), {"forward": upstream_forward}))
    patch.HOST_SPLIT.check(module, FamilyContext(PATCH_NAME))

    # the same forward, its split sizes read by another expression: not the shape the edit is for
    source = textwrap.dedent(inspect.getsource(upstream_forward)).replace(
        "split_lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()",
        "split_lengths = cu_seqlens.diff().tolist()")
    assert "cu_seqlens.diff()" in source
    name = "<hunyuan_test_%d>" % id(source)
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    namespace = {}
    # compiled as a module of its own (its globals name its file), not as code swapped into upstream's
    exec(compile(source, name, "exec"), dict(upstream_forward.__globals__, __file__=name), namespace)
    module.HunYuanVisionTransformer = type("HunYuanVisionTransformer", (), {"forward": namespace["forward"]})
    with pytest.raises(TargetMismatch, match=r"anchor '\(cu_seqlens\[1:\] - cu_seqlens\[:-1\]\).tolist\(\)' "
                                             r"found 0 times"):
        patch.HOST_SPLIT.check(module, FamilyContext(PATCH_NAME))


@pytest.mark.claimed(PATCH_NAME, per_family=True)
def test_disabled_the_read_comes_back(stack, tmp_path):
    """With the patch disabled (NPU_SHIM_DISABLE) the tower reads its split sizes back again,
    with the same output: what the patch removes."""
    import torch

    from npu_shim.testing import switches

    runs = switches.census_tower_disabled_and_applied(TOWER, PATCH_NAME, tmp_path)
    assert (runs[True][0], runs[False][0]) == ("disabled 1", "applied 0")
    assert torch.equal(runs[True][1], runs[False][1])


STRICT_CODE = """
import json, npu_shim
from npu_shim.patches.vllm import hunyuan_vision_host_lengths as patch
from npu_shim.patches._shared.source_edit import ReplaceExpression
patch.HOST_SPLIT_SIZES = (ReplaceExpression("torch.diff(cu_seqlens).tolist()", "None"),)
from npu_shim.testing import census
census.setup()
m = census._MODULES[%r]
row = next(r for r in npu_shim.status() if r["name"] == %r)
print(json.dumps([row["state"], row["reason"], hasattr(vars(m.HunYuanVisionTransformer)["forward"],
                                                       "__wrapped_upstream__")]))
""" % (TOWER, PATCH_NAME)


@pytest.mark.claimed(PATCH_NAME, per_family=True)
@pytest.mark.parametrize("strict", ["0", "1"])
def test_another_body_inside_the_window_skips_or_raises_in_strict_mode(stack, strict):
    from npu_shim.testing import switches

    switches.assert_skipped_or_raised(STRICT_CODE, strict, token="torch.diff(cu_seqlens).tolist()",
                                      reason="found 0 times")
