"""Patch ``vllm.cast_overflow_on_device``: vLLM's ``cast_overflow_tensors`` decides on the
device whether to clamp, instead of reading ``isinf().any()`` and ``isnan().any()`` back.

On the real ``vllm.model_executor.models.utils`` of each claimed release: the values are
upstream's (``torch.equal``, NaN where upstream has NaN) and the definition's (float64,
written here) for finite inputs, inputs within ``offset`` of float16's largest value,
+-inf and NaN; upstream reads 2 (1 where ``isinf`` is already true) and the replacement 0;
a non-floating tensor goes to upstream's function; a model module that imported the
function by name follows the target. Where the harness builds towers (vLLM 0.14+): vLLM's
Qwen2.5-VL tower in float16 (the dtype of 310P) makes 2 reads fewer per forward, the ones
at ``cast_overflow_tensors``, with the same output. The check accepts only the asking shape
and says "not needed" on vLLM 0.22's unconditional clamp; the disable switch and strict mode.
"""
import pytest

from npu_shim.patch import FamilyContext

PATCH_NAME = "vllm.cast_overflow_on_device"
TARGET = "vllm.model_executor.models.utils"
FUNCTION = "cast_overflow_tensors"

pytestmark = [pytest.mark.claimed(PATCH_NAME), pytest.mark.patch(PATCH_NAME)]


@pytest.fixture(autouse=True, scope="module")
def emulated():
    """torch_npu's emulation, then the shim (the patch needs torch_npu); the subprocesses below
    ask for it with NPU_SHIM_EMULATE=1."""
    import npu_shim
    from npu_shim import emulation

    emulation.install()
    npu_shim.install()


def target():
    import importlib

    return importlib.import_module(TARGET)


def definition(tensors, offset=1000):
    """float64, from the definition: clamp to +-(dtype max - offset), rounded to the dtype,
    when any value is infinite or NaN; else unchanged."""
    import torch

    values = tensors.double()
    if not torch.isfinite(values).all():
        limit = float(torch.finfo(tensors.dtype).max) - offset
        values = values.clamp(-limit, limit).to(tensors.dtype).double()
    return values


def cases():
    import torch

    gen = torch.Generator().manual_seed(7)
    finite = (torch.randn(6, 8, generator=gen) * 300).to(torch.float16)
    finite[1, 2], finite[4, 4] = 65000.0, -64990.0      # within offset of float16's largest value
    with_inf = finite.clone()
    with_inf[0, 0] = float("inf")
    with_nan = finite.clone()
    with_nan[2, 3] = float("nan")
    bf16 = with_inf.to(torch.bfloat16)
    return {"finite": finite, "inf": with_inf, "nan": with_nan, "bfloat16 inf": bf16}


def test_status_names_the_family():
    import npu_shim
    from npu_shim.testing import claims

    target()
    row = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)
    assert row["state"] == "applied" and [row["family"]] == row["admitted"], row
    assert row["family"] == claims.claimed_family(PATCH_NAME).name


@pytest.mark.parametrize("case", ["finite", "inf", "nan", "bfloat16 inf"])
def test_values_are_upstreams_and_the_definitions_without_a_read(case):
    import torch

    from npu_shim.testing import count_host_syncs

    function = getattr(target(), FUNCTION)
    upstream = function.__wrapped_upstream__
    tensors = cases()[case]
    with count_host_syncs(device_tensors=[tensors]) as up_syncs:
        expected = upstream(tensors)
    with count_host_syncs(device_tensors=[tensors]) as syncs:
        out = function(tensors)
    assert (up_syncs.count, syncs.count) == ((1 if "inf" in case else 2), 0), (up_syncs.summary(), syncs.summary())
    assert out.dtype == tensors.dtype
    torch.testing.assert_close(out, expected, rtol=0, atol=0, equal_nan=True)
    torch.testing.assert_close(out.double(), definition(tensors), rtol=0, atol=0, equal_nan=True)
    if case == "finite":
        assert torch.equal(out, tensors)                 # 65000 stays: nothing overflowed


def test_a_module_that_imported_it_by_name_follows_the_target(monkeypatch):
    import torch

    import npu_shim

    module = target()
    replacement = getattr(module, FUNCTION)
    before = dict(npu_shim.stats()[PATCH_NAME])
    assert replacement(torch.arange(4)).tolist() == [0, 1, 2, 3]          # integers: upstream's
    calls = []
    monkeypatch.setattr(module, FUNCTION, lambda tensors, offset=1000: calls.append(offset) or tensors)
    replacement(cases()["inf"], 7)
    assert calls == [7]
    after = npu_shim.stats()[PATCH_NAME]
    assert after["upstream_calls"] == before.get("upstream_calls", 0) + 1, after
    assert after.get("calls", 0) == before.get("calls", 0), after


def _check_on(source):
    import linecache
    import textwrap
    import types

    from npu_shim.patches.vllm import cast_overflow_on_device as patch

    text = textwrap.dedent(source)
    name = "<cast_overflow_test_%d>" % id(text)
    linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    namespace = {}
    exec(compile(text, name, "exec"), dict(vars(target()), __file__=name), namespace)
    module = types.ModuleType("checked")
    setattr(module, FUNCTION, namespace[FUNCTION])
    patch.ASK_THEN_CLAMP.check(module, FamilyContext(PATCH_NAME))


def test_the_check_accepts_only_the_asking_shape():
    import inspect

    from npu_shim.patch import NotNeeded, TargetMismatch

    upstream = getattr(target(), FUNCTION).__wrapped_upstream__
    source = inspect.getsource(upstream)
    _check_on(source)
    unconditional = ("def cast_overflow_tensors(tensors, offset=1000):\n"
                     "    clamp_value = torch.finfo(tensors.dtype).max - offset\n"
                     "    return torch.clamp(tensors, min=-clamp_value, max=clamp_value)\n")
    with pytest.raises(NotNeeded):                        # vLLM 0.22's shape
        _check_on(unconditional)
    with pytest.raises(TargetMismatch):                   # asks only for inf
        _check_on(source.replace(" or tensors.isnan().any()", ""))


@pytest.mark.claimed(PATCH_NAME, pinned={"vllm": ">=0.14.0"})
def test_qwen2_5_vl_tower_in_float16_makes_two_reads_fewer():
    """vLLM's Qwen2.5-VL tower in float16 calls cast_overflow_tensors on its output: with the
    patch the tower reads nothing there; upstream's function (put back in the target, which the
    tower's by-name copy follows) reads twice; the outputs are equal."""
    import torch

    from npu_shim.testing import count_host_syncs, towers

    stack = towers.setup()
    module = target()
    replacement = getattr(module, FUNCTION)
    attention = stack.attention["A2"]
    tower = towers.build_tower(stack, "Qwen2.5-VL", attention, dtype=torch.float16)
    grid = towers.grids(0)
    x = towers.pixel_values(tower, grid)
    outputs, counts = {}, {}
    for side in ("shim", "upstream"):
        if side == "upstream":
            setattr(module, FUNCTION, replacement.__wrapped_upstream__)
        try:
            with torch.inference_mode(), towers.registered(attention), \
                    count_host_syncs(device_tensors=[x], device_modules=[tower]) as syncs:
                outputs[side] = tower(x, grid_thw=grid)
        finally:
            setattr(module, FUNCTION, replacement)
        counts[side] = syncs
        print("Qwen2.5-VL float16 %s: %s" % (side, syncs.summary()))
    at_clamp = [e for e in counts["upstream"].events if e.location.endswith(" in " + FUNCTION)]
    assert [e.kind for e in at_clamp] == ["bool", "bool"], counts["upstream"].summary()
    assert not [e for e in counts["shim"].events if e.location.endswith(" in " + FUNCTION)]
    assert counts["upstream"].count - counts["shim"].count == 2
    assert torch.equal(outputs["shim"], outputs["upstream"])


DISABLED_CODE = """
import torch, npu_shim
import vllm.model_executor.models.utils as utils
from npu_shim.testing import count_host_syncs
x = torch.randn(4, 8).to(torch.float16)
with count_host_syncs(device_tensors=[x]) as c:
    out = utils.cast_overflow_tensors(x)
print([r['state'] for r in npu_shim.status() if r['name'] == %r][0], c.count, torch.equal(out, x))
""" % PATCH_NAME


@pytest.mark.claimed(PATCH_NAME, per_family=True)
def test_disabled_the_reads_come_back():
    from npu_shim.testing import switches

    lines = {disabled: switches.last_line(switches.child(
        DISABLED_CODE, NPU_SHIM_EMULATE="1", **({"NPU_SHIM_DISABLE": PATCH_NAME} if disabled else {})))
        for disabled in (True, False)}
    assert lines == {True: "disabled 2 True", False: "applied 0 True"}


STRICT_CODE = """
import json, npu_shim
from npu_shim.patches.vllm import cast_overflow_on_device as patch
patch.PARAMS = ("tensors", "offset", "another")
import vllm.model_executor.models.utils as utils
row = next(r for r in npu_shim.status() if r["name"] == %r)
print(json.dumps([row["state"], row["reason"], hasattr(utils.cast_overflow_tensors, "__wrapped_upstream__")]))
""" % PATCH_NAME


@pytest.mark.claimed(PATCH_NAME, per_family=True)
@pytest.mark.parametrize("strict", ["0", "1"])
def test_another_shape_inside_the_window_skips_or_raises_in_strict_mode(strict):
    from npu_shim.testing import switches

    switches.assert_skipped_or_raised(STRICT_CODE, strict, token="another", reason="another",
                                      NPU_SHIM_EMULATE="1")
