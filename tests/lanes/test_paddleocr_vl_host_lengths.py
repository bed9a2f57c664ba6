"""Patch ``vllm.paddleocr_vl_host_lengths``: PaddleOCR-VL's ``async_tensor_h2d`` copy of its host
``cu_seqlens`` keeps the host values it copied, and the attention takes them instead of reading
the device tensor back.

Towers, stand-ins and calls: :mod:`npu_shim.testing.census` (vLLM's own ``SiglipVisionModel`` of
``paddleocr_vl`` from a tiny config, 3 layers, called as the model's ``encode_image`` calls it,
once per image; CPU with emulated torch_npu ops and a stand-in device; two forwards of 2 and 3
images; the grid where the release's field config puts it). Here, for both device classes: no
attention read per whole forward with the shim, upstream's beside it, counted on upstream's own
forward (vLLM's tower code and vllm-ascend's untouched attention: one read per layer and
cu_seqlens tensor, more than none); the only reads left are the grid's,
where the field config sends it to the device (0.28.0: ``encode_image``'s ``.tolist()`` of each
image's row); output ``torch.equal`` to upstream's and close to vLLM's TORCH_SDPA tower and a
float64 copy (``npu_shim.testing.attention_f64``); the copy to the device is upstream's (same
function, same arguments, same result); the host values kept are the data copied, and only host
integer data is kept; the family's check accepts only its own shape; the disable switch brings
the reads back with the same output; strict mode raises on a shape the family does not know.
"""
import importlib.util
import sys
import textwrap

import pytest

from npu_shim.patch import FamilyContext, TargetMismatch

PATCH_NAME = "vllm.paddleocr_vl_host_lengths"
TOWER = "PaddleOCR-VL"

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


def module():
    from npu_shim.testing import census

    return census._MODULES[TOWER]


def patched_copy():
    return module().async_tensor_h2d


def upstream_copy():
    from vllm.utils import torch_utils

    return torch_utils.async_tensor_h2d


def upstream_attention_reads(run):
    """The reads of ``run``'s upstream tower (vLLM's tower code, vllm-ascend's untouched attention)
    made by vllm-ascend's attention, counted on the forward itself."""
    return sum(1 for e in run.up_syncs.events if e.location.startswith("ops/mm_encoder_attention.py:"))


def test_status_names_the_family(stack):
    from npu_shim.testing import claims

    found = row()
    assert found["state"] == "applied" and [found["family"]] == found["admitted"], found
    assert found["family"] == claims.claimed_family(PATCH_NAME).name
    assert patched_copy().__wrapped_upstream__ is upstream_copy()


def test_whole_tower_forward_reads_nothing_back(stack, device_class):
    from npu_shim.testing import census

    runs = census.side_by_side(stack, TOWER, device_class)
    assert len(runs) == 2
    for run in runs:
        syncs, up_syncs = run.syncs, run.up_syncs
        print("%s vllm %s %s forward %d: upstream %s -> shim %s"
              % (TOWER, release(), device_class, run.index, up_syncs.summary(), syncs.summary()))
        images = len(run.grid)
        # where the field config sends the grid to the device, encode_image reads each image's row
        grid_reads = images if census.device_args(TOWER, census.CENSUS[TOWER].grid_arg(run.grid)) else 0
        assert syncs.count == grid_reads, [str(e) for e in syncs.events]
        assert all("in encode_image" in str(e) for e in syncs.events), [str(e) for e in syncs.events]
        # upstream's reads, measured on its own code: vllm-ascend's attention's
        # (vllm_ascend/ops/mm_encoder_attention.py, once per layer and cu_seqlens tensor: one tensor
        # per image where encode_image runs per image, one for all where it runs once), and the grid's
        attention = upstream_attention_reads(run)
        assert attention > 0 and attention % run.layers == 0, up_syncs.summary()   # what the patch removes
        assert up_syncs.count == attention + grid_reads, up_syncs.summary()
        assert syncs.h2d_count == up_syncs.h2d_count
        census.assert_matches_references(stack, TOWER, run, TOWER_TOL)


@pytest.mark.parametrize("data", [[0, 64, 112], (0, 7), "numpy", "tensor"])
def test_the_copy_is_upstreams(stack, data):
    """Upstream's function runs with the caller's arguments: the same tensor (values, dtype,
    device) as upstream's for every kind of host data the module hands it, and ``out=`` filled
    where the release takes it (0.30.0 on)."""
    import inspect

    import numpy
    import torch

    if data == "numpy":
        data = numpy.cumsum([0, 64, 48], dtype=numpy.int32)
    elif data == "tensor":
        data = torch.tensor([0, 64, 112], dtype=torch.int32)
    device = torch.device("cpu")
    made = patched_copy()(data, dtype=torch.int32, device=device)
    expected = upstream_copy()(data, dtype=torch.int32, device=device)
    assert torch.equal(made, expected) and made.dtype == expected.dtype == torch.int32
    if "out" in inspect.signature(upstream_copy()).parameters:
        out = torch.zeros(len(data), dtype=torch.int32)
        assert patched_copy()(data, out=out) is out and torch.equal(out, expected)


def test_the_host_values_kept_are_the_copys_values(stack):
    import numpy
    import torch

    from npu_shim.patches._shared import host_record
    from npu_shim.patches.vllm import paddleocr_vl_host_lengths as patch

    assert torch.equal(patch.host_int32([0, numpy.int64(64)]), torch.tensor([0, 64], dtype=torch.int32))
    assert patch.host_int32(numpy.array([0, 5], dtype=numpy.int64)).dtype == torch.int32
    # anything that is not host integer data is not guessed at
    assert patch.host_int32([0, torch.tensor(5)]) is None
    assert patch.host_int32([True, 3]) is None
    assert patch.host_int32([0.0, 3.0]) is None
    assert patch.host_int32(numpy.array([0.0, 3.0])) is None
    assert patch.host_int32(torch.tensor([0.0, 3.0])) is None
    assert patch.host_int32(torch.tensor([True, False])) is None
    assert patch.host_int32(torch.tensor([[0, 5]])) is None
    assert patch.host_int32(torch.empty(3, device="meta")) is None
    from npu_shim.testing import count_host_syncs

    stand_in = torch.tensor([0, 5], dtype=torch.int32)
    with count_host_syncs(device_tensors=[stand_in], follow_placement=True):
        assert patch.host_int32(stand_in) is None                    # a device tensor's device is not "cpu"

    for data in ([0, 64, 112], numpy.array([0, 12, 40], dtype=numpy.int32), torch.tensor([0, 9], dtype=torch.int32)):
        made = patched_copy()(data, dtype=torch.int32, device=torch.device("cpu"))
        kept = host_record.take(made)
        assert kept is not None and kept.device.type == "cpu" and kept.dtype == torch.int32
        assert torch.equal(kept, made)
        assert host_record.take(made) is None                         # taken once
        if isinstance(data, torch.Tensor):
            assert kept.data_ptr() != data.data_ptr()                 # its own copy
    # not int32 (the attention's lengths are int32): upstream's result, nothing kept
    made = patched_copy()([0, 64], torch.device("cpu"))
    assert made.dtype == torch.int64 and host_record.ATTR not in made.__dict__


CHECKED_MODULE = """
import torch
from vllm.utils.torch_utils import async_tensor_h2d


def encode(cu_seqlens, pixel_values):
    cu_seqlens = async_tensor_h2d(
        cu_seqlens, dtype=torch.int32, device=pixel_values.device
    )
    return cu_seqlens
"""


def _module(tmp_path, source, name):
    path = tmp_path / (name + ".py")
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, str(path))
    found = importlib.util.module_from_spec(spec)
    sys.modules[name] = found
    try:
        spec.loader.exec_module(found)
    finally:
        del sys.modules[name]
    return found


def test_the_check_accepts_only_its_own_shape(stack, tmp_path, monkeypatch):
    from npu_shim.patches.vllm import paddleocr_vl_host_lengths as patch

    context = FamilyContext(PATCH_NAME)
    with monkeypatch.context() as unpatched:
        unpatched.setattr(module(), "async_tensor_h2d", upstream_copy())
        patch.ASYNC_H2D.check(module(), context)                      # the installed release's code
    with pytest.raises(TargetMismatch, match="is not vLLM's"):
        patch.ASYNC_H2D.check(module(), context)                      # the shim's own replacement
    patch.ASYNC_H2D.check(_module(tmp_path, CHECKED_MODULE, "accepted"), context)

    shapes = {
        "another copy in the module": CHECKED_MODULE + "\n\ndef ids(x, d):\n    return async_tensor_h2d(x, device=d)\n",
        "another dtype": CHECKED_MODULE.replace("torch.int32", "torch.int64"),
        "another variable": CHECKED_MODULE.replace("cu_seqlens, dtype", "lengths, dtype"),
        "no copy": CHECKED_MODULE.replace("async_tensor_h2d(\n", "torch.as_tensor(\n"),
        "another signature": CHECKED_MODULE.replace("from vllm.utils.torch_utils import async_tensor_h2d",
                                                    "from vllm.utils.torch_utils import async_tensor_h2d as _copy\n"
                                                    "def async_tensor_h2d(data, device, dtype=None, *, pin=True):\n"
                                                    "    return _copy(data, device, dtype)\n"
                                                    "async_tensor_h2d.__module__ = _copy.__module__"),
        "another function": CHECKED_MODULE.replace("from vllm.utils.torch_utils import async_tensor_h2d",
                                                   "def async_tensor_h2d(data, device=None, dtype=None, out=None):\n"
                                                   "    return torch.as_tensor(data, dtype=dtype, device=device)"),
    }
    for index, (what, source) in enumerate(shapes.items()):
        with pytest.raises(TargetMismatch):
            patch.ASYNC_H2D.check(_module(tmp_path, source, "rejected_%d" % index), context)
            pytest.fail(what)


@pytest.mark.claimed(PATCH_NAME, per_family=True)
def test_disabled_the_reads_come_back(stack, tmp_path):
    """With the patch disabled (NPU_SHIM_DISABLE) the attention reads each cu_seqlens tensor back
    again (vllm.mm_encoder_attn's one read per tensor, where upstream's attention reads it once per
    layer: upstream's own count on the first census grid, divided by the layers), with the same
    output: what the patch removes."""
    import torch

    from npu_shim.testing import census, switches

    images = len(census.grids(0, TOWER))
    grid_reads = images if census.device_args(TOWER, census.CENSUS[TOWER].grid_arg(census.grids(0, TOWER))) else 0
    first = census.side_by_side(stack, TOWER, "A2", forwards=1)[0]
    upstream = upstream_attention_reads(first)
    assert upstream > 0 and upstream % first.layers == 0, upstream
    runs = switches.census_tower_disabled_and_applied(TOWER, PATCH_NAME, tmp_path)
    assert (runs[True][0], runs[False][0]) == ("disabled %d" % (upstream // first.layers + grid_reads),
                                               "applied %d" % grid_reads)
    assert torch.equal(runs[True][1], runs[False][1])


STRICT_CODE = """
import json, npu_shim
from npu_shim.patches.vllm import paddleocr_vl_host_lengths as patch
patch.ASYNC_H2D.statement = "cu_seqlens = async_tensor_h2d(cu_seqlens, device="
from npu_shim.testing import census
census.setup()
m = census._MODULES[%r]
row = next(r for r in npu_shim.status() if r["name"] == %r)
print(json.dumps([row["state"], row["reason"], hasattr(m.async_tensor_h2d, "__wrapped_upstream__")]))
""" % (TOWER, PATCH_NAME)


@pytest.mark.claimed(PATCH_NAME, per_family=True)
@pytest.mark.parametrize("strict", ["0", "1"])
def test_another_shape_inside_the_window_skips_or_raises_in_strict_mode(stack, strict):
    from npu_shim.testing import switches

    switches.assert_skipped_or_raised(STRICT_CODE, strict, token="cu_seqlens = async_tensor_h2d(cu_seqlens, device=",
                                      reason="does not copy cu_seqlens with")
