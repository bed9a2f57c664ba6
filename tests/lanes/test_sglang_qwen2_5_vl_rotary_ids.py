"""Patch ``sglang.qwen2_5_vl_rotary_ids`` (0.5.11 - 0.5.23) on the real sglang wheels: Qwen2.5-VL's
``rot_pos_emb`` copies the host position ids to the device non-blocking before indexing the device
rotary table.

The whole-tower gate (reads and blocking copies of a whole forward, 0 with the shim, upstream's
beside it; outputs ``torch.equal``) is ``test_sglang_towers.py``; here, on sglang's own tower
(:mod:`npu_shim.testing.sglang_towers`, its parameters standing in for device tensors, an NPU
answered): ``rot_pos_emb`` alone makes no blocking copy where upstream's makes one, and returns
upstream's tensor bit for bit; the ids reach the device with ``non_blocking=True``; a grid not on
the host and a host that is not an NPU get upstream's method; the check refuses a body without
the anchor of the edit, and the other family refuses this release's; uninstall puts upstream's back; the disable switch and strict
mode in a fresh interpreter.
"""
import json
import os
import types

import pytest

import npu_shim
from npu_shim.patch import FamilyContext, TargetMismatch
from npu_shim.patches.sglang import qwen2_5_vl_rotary_ids as patch
from npu_shim.testing import claims

NAME = patch.PATCH.name
TOWER = "Qwen2.5-VL"

pytestmark = [pytest.mark.claimed(NAME), pytest.mark.patch(NAME)]

PLACEHOLDERS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "placeholders")
# grids with a single frame and several frames, square and not
GRIDS = ([[1, 8, 8], [2, 4, 12], [1, 12, 8]], [[1, 4, 4]], [[3, 8, 4], [1, 4, 12]])


@pytest.fixture(scope="module")
def tower():
    import torch

    from npu_shim.testing import sglang_towers

    sglang_towers.setup()
    return sglang_towers.build(TOWER, torch.bfloat16)


def module():
    from npu_shim.testing import sglang_towers

    return sglang_towers.setup()[TOWER]


def patched():
    return vars(getattr(module(), patch.TOWER))[patch.METHOD]


def upstream():
    return patched().__wrapped_upstream__


def rotary(tower, method, grid_thw, device_grid=False):
    """``method(tower, grid_thw)`` as on an NPU with the tower's parameters on the device: (output,
    counter)."""
    import torch

    from npu_shim.testing import count_host_syncs, sglang_towers
    from npu_shim.testing.sglang_vision import counting_as_npu

    device = [grid_thw] if device_grid else []
    with sglang_towers.npu(TOWER), torch.inference_mode():
        with count_host_syncs(device_tensors=device, device_modules=[tower], follow_placement=True) as syncs, \
                counting_as_npu(syncs):
            out = method(tower, grid_thw)
    return out, syncs


def test_applies_with_the_claimed_family(tower):
    row = next(r for r in npu_shim.status() if r["name"] == NAME)
    assert row["state"] == "applied" and row["family"] == claims.claimed_family(NAME).name, row
    assert patched().__npu_shim_patch__ == NAME


@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_no_blocking_copy_and_upstreams_output(tower, grid):
    import torch

    grid_thw = torch.tensor(grid, dtype=torch.long)
    out, syncs = rotary(tower, patched(), grid_thw)
    up, up_syncs = rotary(tower, upstream(), grid_thw)
    # upstream: the host ids index the device table, the index goes over first (blocking)
    assert (up_syncs.count, up_syncs.h2d_count) == (0, 1), up_syncs.h2d_events
    assert [e.location.rsplit(" in ", 1)[1] for e in up_syncs.h2d_events] == ["rot_pos_emb"]
    assert (syncs.count, syncs.h2d_count) == (0, 0), (syncs.summary(), syncs.h2d_events)
    assert torch.equal(out, up) and out.shape[0] == sum(t * h * w for t, h, w in grid)


def test_the_ids_reach_the_device_non_blocking(tower, monkeypatch):
    import torch

    moved = []
    real_to = torch.Tensor.to

    def spy_to(self, *args, **kwargs):
        if self.dtype == torch.long and self.dim() == 2 and self.shape[1] == 2:     # the (tokens, 2) ids
            moved.append(kwargs.get("non_blocking"))
        return real_to(self, *args, **kwargs)

    from npu_shim.testing import sglang_towers

    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    with sglang_towers.npu(TOWER), torch.inference_mode():        # no counter: its mode sees .to too
        patched()(tower, torch.tensor(GRIDS[0], dtype=torch.long))
    monkeypatch.undo()
    assert moved == [True]


def test_a_device_grid_or_no_npu_runs_upstreams_method(tower):
    import torch

    grid_thw = torch.tensor(GRIDS[0], dtype=torch.long)
    before = npu_shim.stats()[NAME]["upstream_calls"]
    out, syncs = rotary(tower, patched(), grid_thw, device_grid=True)
    up, _ = rotary(tower, upstream(), grid_thw, device_grid=True)
    assert npu_shim.stats()[NAME]["upstream_calls"] == before + 1
    assert syncs.count > 0, "a device grid is read back by upstream's method"
    assert torch.equal(out, up)
    # no NPU answered: upstream's method
    with torch.inference_mode():
        off_npu = patched()(tower, grid_thw)
    assert npu_shim.stats()[NAME]["upstream_calls"] == before + 2
    assert torch.equal(off_npu, up)


def _another_rot_pos_emb(self, grid_thw):
    return grid_thw


def test_the_check_refuses_a_body_without_its_anchor():
    family = claims.claimed_family(NAME).load()
    other_family = patch.TABLE_BY_SIZE if family is patch.TABLE_BY_POSITIONS else patch.TABLE_BY_POSITIONS
    cls = getattr(module(), patch.TOWER)
    unpatched = type(cls.__name__, (), dict(vars(cls), rot_pos_emb=upstream()))
    other = type(cls.__name__, (), dict(vars(cls), rot_pos_emb=_another_rot_pos_emb))

    def holding(tower_class, **extra):
        fake = types.SimpleNamespace(**{k: v for k, v in vars(module()).items() if not k.startswith("__")})
        setattr(fake, patch.TOWER, tower_class)
        vars(fake).update(extra)
        return fake

    context = FamilyContext(NAME)
    family.check(holding(unpatched), context)
    for what, target, check in (("another body", holding(other), family),
                                ("the other release's body", holding(unpatched), other_family)):
        with pytest.raises(TargetMismatch, match="anchor 'rotary_pos_emb_full = .*' found 0 times"):
            check.check(target, context)
            pytest.fail(what)
    with pytest.raises(TargetMismatch, match="lacks is_npu"):
        family.check(holding(unpatched, is_npu=None), context)


def test_uninstall_restores_upstream():
    cls = getattr(module(), patch.TOWER)
    original = upstream()
    npu_shim.uninstall()
    try:
        assert vars(cls)[patch.METHOD] is original
    finally:
        npu_shim.install()
    assert vars(cls)[patch.METHOD].__npu_shim_patch__ == NAME


SUBPROCESS = """
import importlib, json, sys
import npu_shim
from npu_shim.patches.sglang import qwen2_5_vl_rotary_ids as declaration
if sys.argv[1] == "other-body":     # as if the installed release had another body: one without the anchor
    from npu_shim.patches._shared.source_edit import InsertBefore
    for family in (declaration.TABLE_BY_SIZE, declaration.TABLE_BY_POSITIONS):
        family.edits = (InsertBefore("not_in_upstream()", "pass"),) + tuple(family.edits)
m = importlib.import_module(declaration.TARGET)
row = next(r for r in npu_shim.status() if r["name"] == declaration.PATCH.name)
f = vars(getattr(m, declaration.TOWER))[declaration.METHOD]
print(json.dumps([row["state"], row["reason"], hasattr(f, "__npu_shim_patch__")]))
"""


@pytest.mark.claimed(NAME, per_family=True)
def test_switched_off_is_upstream(run_python, make_env):
    off = run_python(SUBPROCESS, args=("plain",),
                     env=make_env(NPU_SHIM_EMULATE="1", NPU_SHIM_DISABLE=NAME, PYTHONPATH=PLACEHOLDERS), timeout=600)
    state, reason, replaced = json.loads(off.stdout.strip().splitlines()[-1])
    assert [state, reason] == ["disabled", "listed in NPU_SHIM_DISABLE"] and replaced is False


@pytest.mark.claimed(NAME, per_family=True)
@pytest.mark.parametrize("strict", ["0", "1"])
def test_another_body_skips_or_raises_in_strict_mode(strict, run_python, make_env):
    proc = run_python(SUBPROCESS, args=("other-body",),
                      env=make_env(NPU_SHIM_EMULATE="1", NPU_SHIM_STRICT=strict, PYTHONPATH=PLACEHOLDERS),
                      check=False, timeout=600)
    if strict == "1":
        assert proc.returncode != 0
        assert "PatchError" in proc.stderr and NAME in proc.stderr, proc.stderr[-2000:]
        assert "'not_in_upstream()' found 0 times" in proc.stderr, proc.stderr[-2000:]
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        state, reason, replaced = json.loads(proc.stdout.strip().splitlines()[-1])
        assert state == "skipped" and "'not_in_upstream()' found 0 times" in reason and replaced is False, \
            (state, reason)
