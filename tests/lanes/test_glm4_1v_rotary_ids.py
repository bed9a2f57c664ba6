"""Patch ``vllm.glm4_1v_rotary_ids`` (vLLM 0.18 - 0.21) on the real vLLM wheels: GLM-4.1V's
``rot_pos_emb`` moves its host position ids to the device non-blocking before indexing the device
cos/sin tables, the line vLLM 0.22.1 added.

The whole-tower gates (0 reads and 0 blocking copies per forward with the shim, upstream's beside
it) are ``test_glm4_1v_host_lengths.py`` and ``test_glm_ocr_host_lengths.py``; here, on vLLM's own
GLM-4.1V tower (:mod:`npu_shim.testing.towers`, its parameters standing in for device tensors):
``rot_pos_emb`` alone makes no blocking copy where upstream's makes two, returns upstream's cos and
sin bit for bit and the same ids (on the device); the ids go over with ``non_blocking=True``; a grid
not on the host gets upstream's method; the check refuses a body the replacement was not written
from; above the window the patch stays out and says why; the disable switch and strict mode in a
fresh interpreter.
"""
import json
import types

import pytest

import npu_shim
from npu_shim.patch import FamilyContext, TargetMismatch
from npu_shim.patches.vllm import glm4_1v_rotary_ids as patch
from npu_shim.testing import claims

NAME = patch.PATCH.name
TOWER = "GLM-4.1V"
GRIDS = ([[1, 8, 8], [2, 4, 12]], [[1, 4, 4], [3, 8, 4], [1, 12, 8]])

pytestmark = [pytest.mark.patch(NAME)]


@pytest.fixture(scope="module")
def stack():
    from npu_shim.testing import towers

    return towers.setup()


@pytest.fixture(scope="module")
def tower(stack):
    import torch

    from npu_shim.testing import towers

    return towers.build_tower(stack, TOWER, stack.attention["A2"], dtype=torch.bfloat16)


def row():
    return next(r for r in npu_shim.status() if r["name"] == NAME)


def tower_class(stack):
    return getattr(stack.modules[TOWER], patch.TOWER)


def patched(stack):
    return vars(tower_class(stack))[patch.METHOD]


def rotary(tower, method, grid_thw, device_grid=False):
    """``method(tower, grid_thw)`` with the tower's parameters on the device: (output, counter)."""
    import torch

    from npu_shim.testing import count_host_syncs

    with torch.inference_mode(), count_host_syncs(device_tensors=[grid_thw] if device_grid else [],
                                                  device_modules=[tower]) as syncs:
        out = method(tower, grid_thw)
    return out, syncs


@pytest.mark.claimed(NAME)
def test_applies_with_the_claimed_family(stack):
    found = row()
    assert found["state"] == "applied" and found["family"] == claims.claimed_family(NAME).name, found
    assert patched(stack).__npu_shim_patch__ == NAME


@pytest.mark.claimed(NAME, outside="above")
def test_above_the_window_upstream_moves_the_ids_itself(stack):
    """vLLM 0.22.1 on: the patch stays out, and upstream's own method copies nothing blocking."""
    import torch

    from npu_shim.testing import towers

    found = row()
    assert found["state"] == "skipped" and "above the window vLLM moves the ids" in found["reason"], found
    method = vars(tower_class(stack))[patch.METHOD]
    assert not hasattr(method, "__npu_shim_patch__")
    tower = towers.build_tower(stack, TOWER, stack.attention["A2"], dtype=torch.bfloat16)
    _, syncs = rotary(tower, method, torch.tensor(GRIDS[0]))
    assert (syncs.count, syncs.h2d_count) == (0, 0), syncs.summary()


@pytest.mark.claimed(NAME)
@pytest.mark.parametrize("grid", GRIDS, ids=str)
def test_no_blocking_copy_and_upstreams_output(stack, tower, grid):
    import torch

    grid_thw = torch.tensor(grid)
    (cos, sin, ids), syncs = rotary(tower, patched(stack), grid_thw)
    (up_cos, up_sin, up_ids), up_syncs = rotary(tower, patched(stack).__wrapped_upstream__, grid_thw)
    # upstream: the host ids index the device cos and sin tables, each index going over first
    assert (up_syncs.count, up_syncs.h2d_count) == (0, 2), up_syncs.h2d_events
    assert all(e.location.endswith(" in rot_pos_emb") for e in up_syncs.h2d_events)
    assert (syncs.count, syncs.h2d_count) == (0, 0), (syncs.summary(), syncs.h2d_events)
    assert torch.equal(cos, up_cos) and torch.equal(sin, up_sin) and torch.equal(ids, up_ids)
    assert ids.shape == (sum(t * h * w for t, h, w in grid), 2)


@pytest.mark.claimed(NAME)
def test_the_ids_reach_the_device_non_blocking(stack, tower, monkeypatch):
    import torch

    moved = []
    real_to = torch.Tensor.to

    def spy_to(self, *args, **kwargs):
        if self.dtype == torch.long and self.dim() == 2 and self.shape[1] == 2:     # the (tokens, 2) ids
            moved.append(kwargs.get("non_blocking"))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    with torch.inference_mode():                      # no counter: its mode sees .to too
        patched(stack)(tower, torch.tensor(GRIDS[0]))
    monkeypatch.undo()
    assert moved == [True]


@pytest.mark.claimed(NAME)
def test_a_device_grid_runs_upstreams_method(stack, tower):
    import torch

    grid_thw = torch.tensor(GRIDS[1])
    before = npu_shim.stats()[NAME]["upstream_calls"]
    (cos, sin, _), syncs = rotary(tower, patched(stack), grid_thw, device_grid=True)
    (up_cos, up_sin, _), _ = rotary(tower, patched(stack).__wrapped_upstream__, grid_thw, device_grid=True)
    assert npu_shim.stats()[NAME]["upstream_calls"] == before + 1
    assert syncs.count > 0, "a device grid is read back by upstream's method"
    assert torch.equal(cos, up_cos) and torch.equal(sin, up_sin)


def _another_rot_pos_emb(self, grid_thw):
    return grid_thw


@pytest.mark.claimed(NAME)
def test_the_check_refuses_a_body_it_was_not_written_from(stack):
    from npu_shim.patches._shared.structure import body_digest

    module = stack.modules[TOWER]
    upstream = patched(stack).__wrapped_upstream__
    assert body_digest(upstream) in patch.ROT_POS_EMB
    cls = tower_class(stack)

    def holding(method):
        fake = types.SimpleNamespace(**{k: v for k, v in vars(module).items() if not k.startswith("__")})
        setattr(fake, patch.TOWER, type(cls.__name__, (), dict(vars(cls), rot_pos_emb=method)))
        return fake

    context = FamilyContext(NAME)
    patch.BLOCKING_INDEX.check(holding(upstream), context)
    with pytest.raises(TargetMismatch, match="not the body"):
        patch.BLOCKING_INDEX.check(holding(_another_rot_pos_emb), context)


SUBPROCESS = """
import importlib, json, sys
import npu_shim
from npu_shim.patches.vllm import glm4_1v_rotary_ids as declaration
if sys.argv[1] == "other-body":     # as if the installed release had another body
    declaration.ROT_POS_EMB.clear()
from npu_shim.testing import towers
stack = towers.setup()
m = stack.modules["GLM-4.1V"]
row = next(r for r in npu_shim.status() if r["name"] == declaration.PATCH.name)
f = vars(getattr(m, declaration.TOWER))[declaration.METHOD]
print(json.dumps([row["state"], row["reason"], hasattr(f, "__npu_shim_patch__")]))
"""


@pytest.mark.claimed(NAME, per_family=True)
def test_switched_off_is_upstream():
    from npu_shim.testing import switches

    line = switches.last_line(switches.child(SUBPROCESS.replace("sys.argv[1]", "'plain'"), NPU_SHIM_DISABLE=NAME))
    state, reason, replaced = json.loads(line)
    assert [state, reason] == ["disabled", "listed in NPU_SHIM_DISABLE"] and replaced is False


@pytest.mark.claimed(NAME, per_family=True)
@pytest.mark.parametrize("strict", ["0", "1"])
def test_another_body_skips_or_raises_in_strict_mode(strict):
    from npu_shim.testing import switches

    switches.assert_skipped_or_raised(SUBPROCESS.replace("sys.argv[1]", "'other-body'"), strict,
                                      token="not the body", reason="not the body")
