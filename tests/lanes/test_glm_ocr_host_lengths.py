"""Patch ``vllm.glm_ocr_host_lengths`` (with ``vllm.mm_encoder_attn``): GLM-OCR's vision tower
copies ``cu_seqlens`` itself; the host lengths of its host grid are kept on that copy, so
vllm-ascend's attention reads nothing back.

Towers, stand-ins and calls: :mod:`npu_shim.testing.census` (vLLM's own
``GlmOcrVisionTransformer`` from a tiny random config, 3 layers; CPU with emulated torch_npu
ops and a stand-in device). Here, for both device classes: 0 device->host reads per whole
tower forward with the shim, upstream's count (vllm-ascend's untouched class) beside it
(one per layer), output ``torch.equal`` to upstream's and close to vLLM's TORCH_SDPA tower
and a float64 copy (``npu_shim.testing.attention_f64``); the copy is upstream's (same op,
same arguments) and the kept host array holds its values; a grid on the device (a stand-in,
``cpu:0``) is not taken for host data; each family's check accepts only
its own release's code; the disable switch brings the attention's read back with the same
output; strict mode raises on a shape no family knows; the selftest.
"""
import pytest

from npu_shim.patch import FamilyContext

PATCH_NAME = "vllm.glm_ocr_host_lengths"
TOWER = "GLM-OCR"

pytestmark = [pytest.mark.claimed(PATCH_NAME),
              pytest.mark.patch(PATCH_NAME, "vllm.mm_encoder_attn", "vllm.glm4_1v_rotary_ids")]

# |tower - float64 tower| and |tower - TORCH_SDPA tower|, relative to max |float64 tower| (no
# floor); measured worst over the census towers (latest-vllm and vllm-0.30, benchmarks/results/
# census-*.json): bfloat16 1.6e-2, float16 2.0e-3
TOWER_TOL = {"bfloat16": 1e-1, "float16": 8e-3}


def release():
    from importlib.metadata import version

    return version("vllm")


def claimed():
    from npu_shim.testing import claims

    return claims.claimed_family(PATCH_NAME)


@pytest.fixture(scope="module")
def stack():
    from npu_shim.testing import census

    return census.setup()


def row():
    import npu_shim

    return next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)


def test_status_names_the_family(stack):
    """The family whose fence claims the installed release is the one whose check accepted it."""
    found = row()
    assert found["state"] == "applied" and [found["family"]] == found["admitted"], found
    assert found["family"] == claimed().name


def test_whole_tower_forward_reads_nothing_back(stack, device_class):
    from npu_shim.testing import census

    from npu_shim.testing import claims

    rotary_claimed = claims.claimed_family("vllm.glm4_1v_rotary_ids") is not None
    runs = census.side_by_side(stack, TOWER, device_class)
    assert len(runs) == 2
    for run in runs:
        syncs, up_syncs = run.syncs, run.up_syncs
        print("%s vllm %s %s forward %d: upstream %s -> shim %s"
              % (TOWER, release(), device_class, run.index, up_syncs.summary(), syncs.summary()))
        assert (up_syncs.count, syncs.count) == (run.layers, 0), \
            (up_syncs.summary(), [str(e) for e in syncs.events])
        # No blocking copy with the shim. Upstream's (GLM-4.1V's) rot_pos_emb indexes the device
        # cos/sin tables with position ids built on the host (2 per forward) on vLLM 0.19 - 0.21,
        # where vllm.glm4_1v_rotary_ids moves them non-blocking as 0.22.1 does.
        assert syncs.h2d_count == 0, [str(e) for e in syncs.h2d_events]
        assert up_syncs.h2d_count == sum(e.location.endswith(" in rot_pos_emb") for e in up_syncs.h2d_events)
        assert up_syncs.h2d_count == (2 if rotary_claimed else 0)
        census.assert_matches_references(stack, TOWER, run, TOWER_TOL)


def test_the_copy_is_upstreams_and_holds_the_host_array(stack, monkeypatch):
    """The tower's copy runs as upstream wrote it (one ``.to(self.device, non_blocking=True)``
    of the int32 lengths), and the device tensor it hands to compute_attn_mask_seqlen carries
    the host lengths of the grid, equal to its own values; a device grid keeps nothing."""
    import torch

    from npu_shim.patches._shared import host_record as record
    from npu_shim.testing import census, towers

    module = census._MODULES[TOWER]
    tower = census.build(stack, TOWER, stack.attention["A2"])
    parent = module.GlmOcrVisionTransformer.__mro__[1]
    inherited = parent.compute_attn_mask_seqlen
    handed = []

    def spy_compute(self, cu_seqlens):
        kept = cu_seqlens.__dict__.get(record.ATTR)
        handed.append((cu_seqlens, None if kept is None else kept.host))
        return inherited(self, cu_seqlens)

    copies = []
    real_to = torch.Tensor.to

    def spy_to(self, *args, **kwargs):
        # copies to a device (the attention's own dtype casts of its host lengths are not copies)
        to_device = "device" in kwargs or any(isinstance(a, (torch.device, str)) for a in args)
        if self.dtype == torch.int32 and self.dim() == 1 and to_device:
            copies.append((args, kwargs))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(parent, "compute_attn_mask_seqlen", spy_compute)
    monkeypatch.setattr(torch.Tensor, "to", spy_to)
    grid = census.grids(1)
    x = census.pixel_values(TOWER, tower, grid)
    with torch.inference_mode(), towers.registered(stack.attention["A2"]):
        tower(x, grid_thw=torch.tensor(grid))
    monkeypatch.undo()
    assert copies == [((tower.device,), {"non_blocking": True})], copies
    (cu_seqlens, host), = handed
    expected = [0] + torch.tensor([h * w for t, h, w in grid for _ in range(t)]).cumsum(0).tolist()
    assert host is not None and host.dtype == torch.int32 and host.device.type == "cpu"
    assert host.tolist() == expected and torch.equal(host, cu_seqlens.cpu())


def test_host_lengths_come_only_from_a_host_grid(stack):
    import torch

    from npu_shim.patches.vllm.glm_ocr_host_lengths import families

    grid = [[1, 8, 8], [2, 4, 12]]
    assert families.host_lengths(torch.tensor(grid)).tolist() == [0, 64, 112, 160]
    assert families.host_lengths(grid).tolist() == [0, 64, 112, 160]          # upstream's list branch
    assert families.host_lengths(grid).dtype == torch.int32
    assert families.host_lengths(torch.tensor(grid)[0]) is None
    assert families.host_lengths(torch.empty(2, 3, dtype=torch.long, device="meta")) is None
    device = torch.tensor([0, 64, 112, 160], dtype=torch.int32)
    families.keep_host(device, torch.tensor([[1, 8, 8]]))          # another length: nothing kept
    families.keep_host(device.long(), torch.tensor(grid))          # another dtype: nothing kept
    from npu_shim.patches._shared import host_record as record

    assert record.take(device) is None
    families.keep_host(device, torch.tensor(grid))
    assert record.take(device).tolist() == [0, 64, 112, 160]


def test_a_device_grid_is_not_taken_for_host_data(stack):
    """The stand-in rule (``host_data.is_host``): a grid on the device, whose stand-in answers
    ``cpu:0`` (type "cpu"), is not the host's: no host lengths, no read, nothing kept. The old
    rule (``device.type != "cpu"`` alone) built lengths from it (``repeat_interleave`` with
    device repeats: a read) and kept them on ``cu_seqlens`` as if the host held them."""
    import torch

    from npu_shim.patches._shared import host_record as record
    from npu_shim.patches.vllm.glm_ocr_host_lengths import families
    from npu_shim.testing import count_host_syncs
    from npu_shim.testing.syncs import DEVICE

    grid = torch.tensor([[1, 8, 8], [2, 4, 12]])
    with count_host_syncs(device_tensors=[grid], follow_placement=True) as syncs:
        assert families.host_lengths(grid) is None
        device = torch.tensor([0, 64, 112, 160], dtype=torch.int32, device=DEVICE)
        families.keep_host(device, grid)
        assert record.take(device) is None
    assert syncs.count == 0, [str(e) for e in syncs.events]


def test_a_device_grid_keeps_the_towers_reads_and_reads_cu_seqlens_once(stack, device_class):
    """The whole tower with its grid on the device: the patch reads nothing and keeps nothing
    (no read in its code or host_data's), the tower's own reads of the grid are upstream's, and
    the attention reads ``cu_seqlens`` back once per forward (``vllm.mm_encoder_attn``) where
    upstream reads it in every layer; output ``torch.equal`` to upstream's. Under the old rule
    the patch read the device grid itself and handed the attention device lengths as host ones
    (vLLM 0.30.0: 27 reads per forward where upstream makes 26 and this makes 24). The
    attention's own counter (``npu_shim.stats``, host_copies) counts its reads of the device
    stand-in as the sync counter does (old rule, ``device.type != "cpu"``: none)."""
    from npu_shim.engine import counters
    from npu_shim.testing import census

    attention = {"A2": "vllm.mm_encoder_attn", "310P": "vllm.mm_encoder_attn_310p"}[device_class]
    before = counters.snapshot().get(attention, counters.empty_row())["host_copies"]
    runs = census.side_by_side(stack, TOWER, device_class, grid_on_device=True)
    copied = counters.snapshot()[attention]["host_copies"] - before
    assert copied == sum(e.location.startswith("mm_encoder/") for run in runs for e in run.syncs.events) == len(runs)
    for run in runs:
        syncs, up_syncs = run.syncs, run.up_syncs
        print("%s vllm %s %s forward %d, device grid: upstream %s -> shim %s"
              % (TOWER, release(), device_class, run.index, up_syncs.summary(), syncs.summary()))
        own = [str(e) for e in syncs.events if e.location.startswith(("glm_ocr_host_lengths/", "_shared/"))]
        assert own == [], own
        assert syncs.count == up_syncs.count - run.layers + 1, \
            ([str(e) for e in syncs.events], [str(e) for e in up_syncs.events])
        census.assert_matches_references(stack, TOWER, run, TOWER_TOL)


def test_each_family_accepts_only_its_own_release(stack):
    """The family the fence admits accepts the installed class; the other family refuses it; a
    forward that builds cu_seqlens another way is refused, and one that copies through
    maybe_recompute_cu_seqlens is "not needed"."""
    import inspect

    from npu_shim.patch import NotNeeded, TargetMismatch
    from npu_shim.patches.vllm.glm_ocr_host_lengths import families
    from npu_shim.testing import census

    cls = census._MODULES[TOWER].GlmOcrVisionTransformer
    upstream_forward = vars(cls)["forward"].__wrapped_upstream__
    original = type("GlmOcrVisionTransformer", (cls.__mro__[1],), {"forward": upstream_forward})
    own = claimed().load()
    own.check(original, FamilyContext(PATCH_NAME))
    other = families.PINNED_CAT if own is families.TENSOR_TO else families.TENSOR_TO
    with pytest.raises(TargetMismatch):
        other.check(original, FamilyContext(PATCH_NAME))
    source = inspect.getsource(upstream_forward)
    rebuilt = source.replace("cu_seqlens = torch.repeat_interleave(", "cu_seqlens = torch.repeat_interleave(1 + ")
    with pytest.raises(TargetMismatch):
        own.check(type("GlmOcrVisionTransformer", (cls.__mro__[1],), {"forward": _patched(rebuilt, upstream_forward)}),
                  FamilyContext(PATCH_NAME))
    recomputed = source.replace("max_seqlen = self.compute_attn_mask_seqlen(cu_seqlens)",
                                "max_seqlen = self.compute_attn_mask_seqlen(cu_seqlens); "
                                "maybe_recompute_cu_seqlens")
    with pytest.raises(NotNeeded):
        own.check(type("GlmOcrVisionTransformer", (cls.__mro__[1],),
                       {"forward": _patched(recomputed, upstream_forward)}), FamilyContext(PATCH_NAME))


def _patched(source, like):
    """``source`` (a method's text) compiled in the globals of ``like``, with its source kept
    findable by inspect (linecache)."""
    import linecache
    import textwrap

    text = textwrap.dedent(source)
    name = "<glm_ocr_test_%d>" % id(text)
    linecache.cache[name] = (len(text), None, text.splitlines(True), name)
    namespace = {}
    exec(compile(text, name, "exec"), dict(like.__globals__, __file__=name), namespace)
    return namespace["forward"]


@pytest.mark.claimed(PATCH_NAME, per_family=True)
def test_disabled_the_attention_read_comes_back(stack, tmp_path):
    """With the patch disabled (NPU_SHIM_DISABLE) the tower's cu_seqlens is read back once
    again (vllm.mm_encoder_attn's one read), with the same output: what the patch removes."""
    import torch

    from npu_shim.testing import switches

    runs = switches.census_tower_disabled_and_applied(TOWER, PATCH_NAME, tmp_path)
    assert (runs[True][0], runs[False][0]) == ("disabled 1", "applied 0")
    assert torch.equal(runs[True][1], runs[False][1])


STRICT_CODE = """
import json, npu_shim
from npu_shim.patches.vllm.glm_ocr_host_lengths import families
families.TENSOR_TO.copy = families.PINNED_CAT.copy = ("cu_seqlens = another_copy(cu_seqlens)",)
from npu_shim.testing import census
census.setup()
m = census._MODULES[%r]
row = next(r for r in npu_shim.status() if r["name"] == %r)
print(json.dumps([row["state"], row["reason"], "compute_attn_mask_seqlen" in vars(m.GlmOcrVisionTransformer)]))
""" % (TOWER, PATCH_NAME)


@pytest.mark.claimed(PATCH_NAME, per_family=True)
@pytest.mark.parametrize("strict", ["0", "1"])
def test_a_mismatch_inside_the_window_skips_or_raises_in_strict_mode(stack, strict):
    from npu_shim.testing import switches

    switches.assert_skipped_or_raised(STRICT_CODE, strict, token="another_copy", reason="another_copy")
