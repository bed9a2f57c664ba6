"""Patches ``sglang.qwen2_5_vl_host_lengths`` and ``sglang.glm4v_host_lengths`` (0.5.11 - 0.5.23) and
``sglang.qwen3_vl_host_lengths`` (0.5.11 - 0.5.15) on the real sglang wheels (lanes from the
declarations: ``pytest.mark.claimed``; a tower is tested where its patch has a family claiming the
installed release).

The whole-tower gate (reads, blocking copies, ``torch.equal`` to upstream, float64) is
``test_sglang_towers.py``; here: the family that applies, the checks refusing a body that lacks the
anchors of the edit (in process, and in a fresh interpreter: skipped with the reason, or PatchError
in strict mode, the target importing either way), the other families refusing this release's body, the fallbacks to upstream's code
where the host has no copy (a grid on the device, lengths on the device), uninstall, the switch and
the selftests.
"""
import json
import os
import types

import pytest

import npu_shim
from npu_shim.patch import FamilyContext
from npu_shim.patches.sglang import glm4v_host_lengths as glm4v
from npu_shim.patches.sglang import qwen2_5_vl_host_lengths as qwen2_5_vl
from npu_shim.patches.sglang import qwen3_vl_host_lengths as qwen3_vl
from npu_shim.testing import claims

DECLARATIONS = {"Qwen2.5-VL": qwen2_5_vl, "GLM-4V": glm4v, "Qwen3-VL": qwen3_vl}
CLASS = {"Qwen2.5-VL": qwen2_5_vl.TOWER, "GLM-4V": glm4v.EMBEDDINGS, "Qwen3-VL": qwen3_vl.TOWER}
NAMES = tuple(d.PATCH.name for d in DECLARATIONS.values())
# the towers whose patch claims the installed release
TOWERS = tuple(name for name, d in DECLARATIONS.items() if claims.claimed_family(d.PATCH.name) is not None)

pytestmark = [pytest.mark.claimed(*NAMES), pytest.mark.patch(*NAMES)]

PLACEHOLDERS = os.path.join(os.path.dirname(os.path.dirname(__file__)), "placeholders")


@pytest.fixture(scope="module")
def modules():
    from npu_shim.testing import sglang_towers

    return sglang_towers.setup()


def _patched(modules, name):
    return vars(getattr(modules[name], CLASS[name]))["forward"]


@pytest.mark.parametrize("name", TOWERS)
def test_applies_with_the_claimed_family(modules, name):
    declaration = DECLARATIONS[name]
    row = next(r for r in npu_shim.status() if r["name"] == declaration.PATCH.name)
    family = claims.claimed_family(declaration.PATCH.name)
    assert row["state"] == "applied" and row["family"] == family.name, row
    forward = _patched(modules, name)
    assert forward.__npu_shim_patch__ == declaration.PATCH.name


def _another_forward(self, *args, **kwargs):
    return None


def _holding(module, name, forward):
    """``module`` as a namespace whose class ``CLASS[name]`` has ``forward``."""
    cls = getattr(module, CLASS[name])
    fake = types.SimpleNamespace(**{k: v for k, v in vars(module).items() if not k.startswith("__")})
    setattr(fake, CLASS[name], type(cls.__name__, (), dict(vars(cls), forward=forward)))
    return fake


@pytest.mark.parametrize("name", TOWERS)
def test_the_check_refuses_a_body_without_its_anchors(modules, name):
    from npu_shim.patch import TargetMismatch

    declaration = DECLARATIONS[name]
    module = modules[name]
    claimed = claims.claimed_family(declaration.PATCH.name)
    family = claimed.load()
    upstream = _patched(modules, name).__wrapped_upstream__
    context = FamilyContext(declaration.PATCH.name)
    family.check(_holding(module, name, upstream), context)
    with pytest.raises(TargetMismatch, match="anchor .* found 0 times"):
        family.check(_holding(module, name, _another_forward), context)
    # one family per shape: the others refuse this release's body (a development build's family
    # is chosen by structure alone)
    for other in declaration.PATCH.families:
        if other.name != claimed.name:
            with pytest.raises(TargetMismatch):
                other.load().check(_holding(module, name, upstream), context)
                pytest.fail("family %s accepts the body of %s's" % (other.name, claimed.name))


def test_qwen2_5_vl_grid_on_the_device_runs_upstreams_forward(modules):
    """No host grid, no host bounds: upstream's forward, its reads, the same output."""
    import torch

    from npu_shim.testing import count_host_syncs, sglang_towers
    from npu_shim.testing.sglang_vision import counting_as_npu

    name = "Qwen2.5-VL"
    tower = sglang_towers.build(name, torch.bfloat16)
    grid = sglang_towers.GRIDS[1]
    x = sglang_towers.pixel_values(tower, grid)
    host_out, host_syncs, _ = sglang_towers.forward(name, tower, x, grid)
    grid_thw = torch.tensor(grid, dtype=torch.long)
    before = npu_shim.stats()[qwen2_5_vl.PATCH.name]["upstream_calls"]
    with sglang_towers.npu(name), torch.inference_mode():
        with count_host_syncs(device_tensors=[x, grid_thw], device_modules=[tower], follow_placement=True) as syncs, \
                counting_as_npu(syncs):
            out = tower(x, grid_thw=grid_thw)
    assert npu_shim.stats()[qwen2_5_vl.PATCH.name]["upstream_calls"] == before + 1
    assert host_syncs.count == 0, host_syncs.summary()
    assert syncs.count > 0, "a device grid is read back by upstream's forward"
    assert torch.equal(out, host_out)


def test_glm4v_lengths_on_the_device_run_upstreams_embeddings(modules):
    import torch

    from npu_shim.testing import count_host_syncs, sglang_towers

    name = "GLM-4V"
    tower = sglang_towers.build(name, torch.bfloat16)
    embeddings = tower.embeddings
    grid = [[1, 4, 4], [1, 8, 12]]
    lengths = [h * w for _, h, w in grid]
    tokens = sum(lengths)
    x = torch.randn(tokens, embeddings.embed_dim, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    shapes = torch.tensor(grid, dtype=torch.long)
    h = torch.cat([torch.arange(hh).repeat_interleave(w) for _, hh, w in grid])
    w = torch.cat([torch.arange(ww).repeat(hh) for _, hh, ww in grid])
    device_lengths = torch.tensor(lengths)
    with torch.inference_mode(), count_host_syncs(device_tensors=[device_lengths, x, h, w],
                                                  device_modules=[tower], follow_placement=True) as syncs:
        from_device = embeddings(x, device_lengths, shapes, h, w)
    assert syncs.count == 2 * len(grid), syncs.summary()        # upstream's path: two per image
    with torch.inference_mode(), count_host_syncs(device_tensors=[x, h, w], device_modules=[tower],
                                                  follow_placement=True) as syncs:
        from_host = embeddings(x, lengths, shapes, h, w)
    assert syncs.count == 0 and syncs.h2d_count == 0, syncs.summary()
    upstream = _patched(modules, name).__wrapped_upstream__
    with torch.inference_mode():
        from_upstream = upstream(embeddings, x, lengths, shapes, h, w)
    assert torch.equal(from_device, from_host) and torch.equal(from_host, from_upstream)


@pytest.mark.parametrize("name", TOWERS)
def test_uninstall_restores_upstream(modules, name):
    cls = getattr(modules[name], CLASS[name])
    upstream = vars(cls)["forward"].__wrapped_upstream__
    npu_shim.uninstall()
    try:
        assert vars(cls)["forward"] is upstream
    finally:
        npu_shim.install()
    assert vars(cls)["forward"].__npu_shim_patch__ == DECLARATIONS[name].PATCH.name


SUBPROCESS = """
import importlib, json, sys
import npu_shim
from npu_shim.patches.sglang import %(module)s as declaration
if sys.argv[1] == "other-body":     # as if the installed release had another body: one without an anchor
    from npu_shim.patches._shared.source_edit import InsertBefore
    for family in declaration.PATCH.families:
        implementation = family.load()
        implementation.edits = (InsertBefore("not_in_upstream()", "pass"),) + tuple(implementation.edits)
m = importlib.import_module(declaration.TARGET)
row = next(r for r in npu_shim.status() if r["name"] == declaration.PATCH.name)
f = vars(getattr(m, %(cls)r))["forward"]
print(json.dumps([row["state"], row["reason"], hasattr(f, "__npu_shim_patch__")]))
"""


def _subprocess_code(name):
    return SUBPROCESS % {"module": DECLARATIONS[name].__name__.rsplit(".", 1)[1], "cls": CLASS[name]}


@pytest.mark.claimed(*NAMES, per_family=True)
@pytest.mark.parametrize("name", TOWERS)
def test_switched_off_is_upstream(modules, name, run_python, make_env):
    declaration = DECLARATIONS[name]
    off = run_python(_subprocess_code(name), args=("plain",),
                     env=make_env(NPU_SHIM_EMULATE="1", NPU_SHIM_DISABLE=declaration.PATCH.name, PYTHONPATH=PLACEHOLDERS),
                     timeout=600)
    state, reason, patched = json.loads(off.stdout.strip().splitlines()[-1])
    assert [state, reason] == ["disabled", "listed in NPU_SHIM_DISABLE"] and patched is False


@pytest.mark.claimed(*NAMES, per_family=True)
@pytest.mark.parametrize("strict", ["0", "1"])
@pytest.mark.parametrize("name", TOWERS)
def test_another_body_skips_or_raises_in_strict_mode(modules, name, strict, run_python, make_env):
    proc = run_python(_subprocess_code(name), args=("other-body",),
                      env=make_env(NPU_SHIM_EMULATE="1", NPU_SHIM_STRICT=strict, PYTHONPATH=PLACEHOLDERS),
                      check=False, timeout=600)
    if strict == "1":
        assert proc.returncode != 0
        assert "PatchError" in proc.stderr and DECLARATIONS[name].PATCH.name in proc.stderr, proc.stderr[-2000:]
        assert "'not_in_upstream()' found 0 times" in proc.stderr, proc.stderr[-2000:]
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        state, reason, patched = json.loads(proc.stdout.strip().splitlines()[-1])
        assert state == "skipped" and "'not_in_upstream()' found 0 times" in reason and patched is False, \
            (state, reason)
