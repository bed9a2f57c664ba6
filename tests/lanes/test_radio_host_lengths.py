"""Patch ``vllm.radio_host_lengths``: RADIO's packed ``cu_seqlens`` keeps the host lengths it was
built from, and the attention takes them instead of reading the device tensor back.

Towers, stand-ins and calls: :mod:`npu_shim.testing.census` (vLLM's own ``RadioModel`` from a
tiny config, 3 layers, called as Nemotron Nano VL's ``extract_feature_dynamic`` calls it; CPU
with emulated torch_npu ops and a stand-in device; two forwards of 2 and 3 images). Here, for
both device classes: 0 device->host reads per whole forward with the shim, upstream's 3 beside
it (vLLM's tower code, ``towers.upstream_methods``, and vllm-ascend's untouched attention, which
reads ``cu_seqlens`` once per layer), output ``torch.equal`` to upstream's and close to vLLM's
TORCH_SDPA tower and a float64 copy (``npu_shim.testing.attention_f64``); the copy to the device
is upstream's (same op, same arguments); the host lengths kept are the copy's values, and only
host integers are kept; the family's check accepts only its own shape; the disable switch brings
the read back with the same output; strict mode raises on a shape the family does not know.
"""
import inspect
import textwrap

import pytest

from npu_shim.patch import FamilyContext

PATCH_NAME = "vllm.radio_host_lengths"
TOWER = "RADIO"
METHOD = "_inter_image_mask_metadata_from_seq_lens"

pytestmark = [pytest.mark.claimed(PATCH_NAME), pytest.mark.patch(PATCH_NAME, "vllm.mm_encoder_attn")]

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


def model_class():
    from npu_shim.testing import census

    return census._MODULES[TOWER].RadioInternVisionModel


def upstream_method():
    return vars(model_class())[METHOD].__wrapped_upstream__


def test_status_names_the_family(stack):
    from npu_shim.testing import claims

    found = row()
    assert found["state"] == "applied" and [found["family"]] == found["admitted"], found
    assert found["family"] == claims.claimed_family(PATCH_NAME).name


def test_whole_tower_forward_reads_nothing_back(stack, device_class):
    from npu_shim.testing import census

    runs = census.side_by_side(stack, TOWER, device_class)
    assert len(runs) == 2
    for run in runs:
        syncs, up_syncs = run.syncs, run.up_syncs
        print("%s vllm %s %s forward %d: upstream %s -> shim %s"
              % (TOWER, release(), device_class, run.index, up_syncs.summary(), syncs.summary()))
        assert (up_syncs.count, syncs.count) == (run.layers, 0), \
            (up_syncs.summary(), [str(e) for e in syncs.events])
        # upstream's reads are vllm-ascend's attention's (vllm_ascend/ops/mm_encoder_attention.py; how
        # it reads differs by release and device class: .to / .tolist / .cpu)
        assert all(e.location.startswith("ops/mm_encoder_attention.py:") for e in up_syncs.events), \
            [str(e) for e in up_syncs.events]
        # the one blocking copy to the device, upstream's torch.tensor(..., device=device), both sides
        assert syncs.h2d_count == up_syncs.h2d_count == 1
        census.assert_matches_references(stack, TOWER, run, TOWER_TOL)


def _device_tensors_made(stack, monkeypatch):
    """The torch.tensor(..., device=...) calls one forward makes, as (args, kwargs), and the output."""
    import torch

    from npu_shim.testing import census

    tower = census.build(stack, TOWER, stack.attention["A2"])
    grid = census.grids(0, TOWER)
    x = census.pixel_values(TOWER, tower, grid)
    made = []
    real_tensor = torch.tensor

    def spy_tensor(*args, **kwargs):
        if "device" in kwargs:
            made.append((args, kwargs))
        return real_tensor(*args, **kwargs)

    monkeypatch.setattr(torch, "tensor", spy_tensor)
    out, _ = census.call(TOWER, tower, stack.attention["A2"], x, grid)
    monkeypatch.undo()
    return tower, made, out


def test_the_copy_is_upstreams(stack, monkeypatch):
    """The tower copies its int32 cu_seqlens to the device once, as upstream does."""
    import torch

    from npu_shim.testing import census, towers

    tower, made, out = _device_tensors_made(stack, monkeypatch)
    sizes = census.CENSUS[TOWER].grid_arg(census.grids(0, TOWER))
    num_skip = tower.model.patch_generator.num_skip
    seq_lens = [h * w // census.RADIO_PATCH ** 2 + num_skip for h, w in sizes]
    assert len(seq_lens) == 2
    cumulative = [0, seq_lens[0], seq_lens[0] + seq_lens[1]]
    assert made == [((cumulative,), {"dtype": torch.int32, "device": made[0][1]["device"]})], made
    assert made[0][1]["device"].type == x_device(tower).type
    with towers.upstream_methods(census._MODULES[TOWER]):
        _, upstream_made, upstream_out = _device_tensors_made(stack, monkeypatch)
    assert upstream_made == made
    assert torch.equal(out, upstream_out)


def x_device(tower):
    return next(tower.parameters()).device


def test_the_host_lengths_kept_are_the_copys_values(stack):
    import torch

    from npu_shim.patches._shared import host_record
    from npu_shim.patches.vllm import radio_host_lengths as patch

    assert torch.equal(patch.host_lengths([5, 7, 2]), torch.tensor([0, 5, 12, 14], dtype=torch.int32))
    assert patch.host_lengths((4,)).dtype == torch.int32
    # a length that is not a host integer is not guessed at
    assert patch.host_lengths([5, torch.tensor(7)]) is None
    assert patch.host_lengths([True, 3]) is None
    assert patch.host_lengths(torch.tensor([5, 7])) is None

    method = vars(model_class())[METHOD]
    assert method.__wrapped_upstream__ is not method
    for seq_lens in ([20, 68], [12] * 4):
        metadata = method(None, seq_lens, device=torch.device("cpu"))
        expected = upstream_method()(None, seq_lens, device=torch.device("cpu"))
        assert torch.equal(metadata.cu_seqlens, expected.cu_seqlens)
        assert torch.equal(metadata.max_seqlen, expected.max_seqlen)
        assert host_record.ATTR not in expected.cu_seqlens.__dict__
        kept = host_record.take(metadata.cu_seqlens)
        assert kept is not None and kept.device.type == "cpu" and kept.dtype == torch.int32
        assert torch.equal(kept, metadata.cu_seqlens)
        assert host_record.take(metadata.cu_seqlens) is None             # taken once
    # 0-d tensors (not what vLLM hands over): upstream's result, nothing kept
    metadata = method(None, [torch.tensor(20), torch.tensor(68)], device=torch.device("cpu"))
    assert metadata.cu_seqlens.tolist() == [0, 20, 88]
    assert host_record.ATTR not in metadata.cu_seqlens.__dict__


def _variant(source, old, new):
    """Upstream's method with ``old`` replaced by ``new`` in its source, compiled in its module."""
    assert old in source, old
    source = source.replace(old, new)
    import linecache

    name = "<radio_test_%d>" % id(source)
    linecache.cache[name] = (len(source), None, source.splitlines(True), name)
    namespace = {}
    exec(compile(source, name, "exec"), dict(upstream_method().__globals__, __file__=name), namespace)
    return namespace[METHOD]


def test_the_check_accepts_only_its_own_shape(stack):
    from npu_shim.patch import TargetMismatch
    from npu_shim.patches.vllm import radio_host_lengths as patch

    def holding(method):
        return type("RadioInternVisionModel", (), {METHOD: method})

    context = FamilyContext(PATCH_NAME)
    patch.TENSOR_ACCUMULATE.check(holding(upstream_method()), context)

    source = textwrap.dedent(inspect.getsource(upstream_method()))
    shapes = {
        "another dtype": ("dtype=torch.int32, device=device", "dtype=torch.int64, device=device"),
        "other lengths": ("accumulate(seq_lens, initial=0)", "accumulate(seq_lens, initial=1)"),
        "another signature": ("self, seq_lens: list[int], device: torch.device",
                              "self, seq_lens: list[int], device: torch.device, extra=None"),
        "cu_seqlens rewritten": ("# Keep max_seqlen", "cu_seqlens = cu_seqlens + 0\n    # Keep max_seqlen"),
        "another order": ("assert len(seq_lens) > 0",
                          "max_seqlen = torch.tensor(max(seq_lens), dtype=torch.int32)\n"
                          "    assert len(seq_lens) > 0"),
    }
    for what, (old, new) in shapes.items():
        with pytest.raises(TargetMismatch):
            patch.TENSOR_ACCUMULATE.check(holding(_variant(source, old, new)), context)
            pytest.fail(what)

    # the same code with another accumulate in its module's globals
    import types

    method = upstream_method()
    foreign = types.FunctionType(method.__code__, dict(method.__globals__, accumulate=lambda *a, **k: iter(())),
                                 METHOD)
    with pytest.raises(TargetMismatch, match="itertools.accumulate"):
        patch.TENSOR_ACCUMULATE.check(holding(foreign), context)


@pytest.mark.claimed(PATCH_NAME, per_family=True)
def test_disabled_the_read_comes_back(stack, tmp_path):
    """With the patch disabled (NPU_SHIM_DISABLE) the attention reads cu_seqlens back once again
    (vllm.mm_encoder_attn's one read per forward), with the same output: what the patch removes."""
    import torch

    from npu_shim.testing import switches

    runs = switches.census_tower_disabled_and_applied(TOWER, PATCH_NAME, tmp_path)
    assert (runs[True][0], runs[False][0]) == ("disabled 1", "applied 0")
    assert torch.equal(runs[True][1], runs[False][1])


STRICT_CODE = """
import json, npu_shim
from npu_shim.patches.vllm import radio_host_lengths as patch
patch.TENSOR_ACCUMULATE.steps = ("cu_seqlens = torch.tensor(seq_lens, device=device)",)
from npu_shim.testing import census
census.setup()
m = census._MODULES[%r]
row = next(r for r in npu_shim.status() if r["name"] == %r)
print(json.dumps([row["state"], row["reason"], hasattr(vars(m.RadioInternVisionModel)[%r],
                                                       "__wrapped_upstream__")]))
""" % (TOWER, PATCH_NAME, METHOD)


@pytest.mark.claimed(PATCH_NAME, per_family=True)
@pytest.mark.parametrize("strict", ["0", "1"])
def test_another_shape_inside_the_window_skips_or_raises_in_strict_mode(stack, strict):
    from npu_shim.testing import switches

    switches.assert_skipped_or_raised(STRICT_CODE, strict, token="cu_seqlens = torch.tensor(seq_lens",
                                      reason="does not cu_seqlens = torch.tensor(seq_lens")
