"""Patch ``sglang.npu_mrope_positions`` (0.5.11 - 0.5.22) on the real sglang wheels: ``MRotaryEmbedding.forward_npu``
sends 2-D (multimodal) positions to upstream's ``forward_native`` and keeps upstream's ``npu_mrope`` call for 1-D
positions, as sglang 0.5.23 does.

In process, on sglang's own layer built as Qwen2-VL builds it (``get_rope`` with ``mrope_section``, NPU answered,
torch_npu emulated; :mod:`npu_shim.testing.sglang_mrope`), its ``forward_npu`` called on the layer (the model's
forward reaching it through sglang's dispatch is the engine test's: tests/lanes/test_engine_sglang_vl.py):

* 2-D positions (a prompt with a 2 x 3 image): query and key equal the float64 M-RoPE of the definition
  (:func:`npu_shim.testing.reference.mrope_f64`), with no ``npu_mrope`` call;
* 1-D positions: exactly one ``npu_mrope`` call, upstream's arguments (``mrope_section [0, 0, 0]``), and the
  float64 ordinary RoPE;
* upstream's method (the shim's slot emptied): the emulated op refuses 2-D positions with
  ``mrope_section [0, 0, 0]`` (on the hardware: silently wrong rotary, sglang PRs #38499, #36959);
* on the newest lane (0.5.23, upstream's guard): the patch is out, and the family's check refuses the guarded method.
"""
import re
import types

import pytest

import npu_shim
from npu_shim.patch import FamilyContext, TargetMismatch
from npu_shim.patches.sglang import npu_mrope_positions as patch
from npu_shim.testing import claims

NAME = patch.PATCH.name
REFUSAL = "npu_mrope: mrope_section [0, 0, 0] must have one entry per positions row (3)"
TOLERANCE = 1e-5   # float32 against float64


@pytest.fixture(scope="module")
def rotary():
    import importlib

    from npu_shim import emulation
    from npu_shim.testing import sglang_mrope

    emulation.install()
    npu_shim.install()
    module = importlib.import_module(patch.TARGET)
    with sglang_mrope.npu_rotary() as make:
        yield module, make


def _error(out, x, positions):
    from npu_shim.testing import sglang_mrope
    from npu_shim.testing.reference import mrope_f64

    expected = mrope_f64(positions, x, sglang_mrope.HEAD, sglang_mrope.ROTARY_DIM, sglang_mrope.BASE,
                         sglang_mrope.SECTION)
    return float((out.double() - expected).abs().max())


def _forward(module, rope, positions, query, key, method=None):
    from npu_shim.testing import record_npu_calls

    method = method or vars(module.MRotaryEmbedding)[patch.METHOD]
    with record_npu_calls() as calls:
        q_out, k_out = method(rope, positions, query, key)
    return q_out, k_out, [c for c in calls if c.name == patch.OP]


@pytest.mark.claimed(NAME)
def test_multimodal_positions_match_the_reference_and_text_keeps_npu_mrope(rotary):
    import torch

    from npu_shim.testing import sglang_mrope

    module, make = rotary
    row = next(r for r in npu_shim.status() if r["name"] == NAME)
    assert row["state"] == "applied" and row["family"] == claims.claimed_family(NAME).name, row
    method = vars(module.MRotaryEmbedding)[patch.METHOD]
    assert method.__npu_shim_patch__ == NAME
    rope = make(torch.float32)
    positions, query, key = sglang_mrope.case()
    assert positions.shape[0] == 3 and not torch.equal(positions[0], positions[1])   # a real image grid
    before = npu_shim.stats()[NAME]

    q_out, k_out, ops = _forward(module, rope, positions, query, key)
    assert ops == [], "2-D positions must not reach npu_mrope with mrope_section [0, 0, 0]"
    assert max(_error(q_out, query, positions), _error(k_out, key, positions)) < TOLERANCE

    text = positions[0]                       # 1-D positions: upstream's npu_mrope call, as upstream makes it
    q_out, k_out, ops = _forward(module, rope, text, query, key)
    assert len(ops) == 1 and ops[0].kwargs["mrope_section"] == [0, 0, 0], ops
    assert max(_error(q_out, query, text), _error(k_out, key, text)) < TOLERANCE
    after = npu_shim.stats()[NAME]
    assert (after["calls"] - before.get("calls", 0), after["positions_2d"] - before.get("positions_2d", 0)) == (2, 1)

    # upstream's method: the emulated op refuses the 2-D positions (the hardware returns wrong rotary instead)
    with pytest.raises(ValueError, match=re.escape(REFUSAL)):
        _forward(module, rope, positions, query, key, method=method.__wrapped_upstream__)


@pytest.mark.claimed(NAME, outside="above")
def test_above_the_window_upstream_has_the_guard(rotary):
    module, _ = rotary
    row = next(r for r in npu_shim.status() if r["name"] == NAME)
    assert row["state"] == "skipped" and "forward_npu routes 2-D" in row["reason"], row
    method = vars(module.MRotaryEmbedding)[patch.METHOD]
    assert not hasattr(method, "__npu_shim_patch__")
    with pytest.raises(TargetMismatch, match="not the unguarded 'query.shape\\[1\\] > 4096'"):
        patch.UNGUARDED.check(module, FamilyContext(NAME))


@pytest.mark.claimed(NAME)
def test_the_check_refuses_a_method_with_the_guard_or_without_the_op(rotary):
    module, _ = rotary
    upstream = vars(module.MRotaryEmbedding)[patch.METHOD].__wrapped_upstream__

    def holding(method):
        cls = type(patch.LAYER, (), {patch.METHOD: method})
        return types.SimpleNamespace(**{patch.LAYER: cls})

    context = FamilyContext(NAME)
    assert patch.LAYER + "." + patch.METHOD in patch.UNGUARDED.check(holding(upstream), context)
    for method in (_guarded, _no_guard):
        with pytest.raises(TargetMismatch, match="if tests are .*, not the unguarded"):
            patch.UNGUARDED.check(holding(method), context)
            pytest.fail(method.__name__)
    with pytest.raises(TargetMismatch, match="does not call npu_mrope"):
        patch.UNGUARDED.check(holding(_no_op), context)


def _guarded(self, positions, query, key, fused_set_kv_buffer_arg=None):   # 0.5.23's shape
    if positions.ndim == 2 or query.shape[1] > 4096:
        return self.forward_native(positions, query, key, fused_set_kv_buffer_arg)
    return query, key


def _no_guard(self, positions, query, key, fused_set_kv_buffer_arg=None):
    return query, key


def _no_op(self, positions, query, key, fused_set_kv_buffer_arg=None):
    if query.shape[1] > 4096:
        return self.forward_native(positions, query, key, fused_set_kv_buffer_arg)
    return query, key


SUBPROCESS = """
import importlib, json
import npu_shim
from npu_shim.patches.sglang import npu_mrope_positions as declaration
m = importlib.import_module(declaration.TARGET)
row = next(r for r in npu_shim.status() if r["name"] == declaration.PATCH.name)
f = vars(getattr(m, declaration.LAYER))[declaration.METHOD]
print(json.dumps([row["state"], row["reason"], hasattr(f, "__npu_shim_patch__")]))
"""


@pytest.mark.claimed(NAME, per_family=True)
def test_its_switch_leaves_upstreams_method(run_python, make_env):
    """``NPU_SHIM_SGLANG_NPU_MROPE_POSITIONS=0`` in a fresh interpreter: the patch shows as disabled, naming the
    switch, and ``forward_npu`` is upstream's; unset, it applies."""
    import json
    import os

    placeholders = os.path.join(os.path.dirname(os.path.dirname(__file__)), "placeholders")
    seen = {}
    for value in ("0", None):
        switches = {} if value is None else {"NPU_SHIM_SGLANG_NPU_MROPE_POSITIONS": value}
        proc = run_python(SUBPROCESS, env=make_env(NPU_SHIM_EMULATE="1", PYTHONPATH=placeholders, **switches),
                          timeout=600)
        seen[value] = json.loads(proc.stdout.strip().splitlines()[-1])
    assert seen["0"] == ["disabled", "NPU_SHIM_SGLANG_NPU_MROPE_POSITIONS=0", False], seen
    assert seen[None][0] == "applied" and seen[None][2] is True, seen
