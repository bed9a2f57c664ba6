"""Patches ``vllm.qwen2_vl_host_lengths`` and ``vllm.qwen3_omni_vision_host_lengths``: the
``cu_seqlens`` copies Qwen2-VL's and Qwen3-Omni's vision towers make themselves keep host
lengths, so vllm-ascend's attention (with ``vllm.mm_encoder_attn``) reads nothing back.

Towers, stand-ins and calls: :mod:`npu_shim.testing.census` (vLLM's own classes from tiny
random configs, 3 layers; CPU with emulated torch_npu ops and a stand-in device). Here, for
both device classes: 0 device->host reads per whole tower forward with the shim, upstream's
count (vllm-ascend's untouched class) beside it, output ``torch.equal`` to upstream's and
close to vLLM's TORCH_SDPA tower and a float64 copy; which family applies on which release;
the disable switch brings the attention's read back with the same output; the selftests.
"""
import os

import pytest

# Each tower's tests run on every lane a family of its patch claims (pytest.mark.claimed).
pytestmark = [pytest.mark.patch("vllm.qwen2_vl_host_lengths", "vllm.qwen3_omni_vision_host_lengths",
                                "vllm.mm_encoder_host_lengths", "vllm.mm_encoder_attn")]

# |tower - float64 tower| and |tower - TORCH_SDPA tower|, relative to max |float64 tower| (no
# floor); measured worst over the census towers (latest-vllm and vllm-0.30, benchmarks/results/
# census-*.json): bfloat16 1.6e-2, float16 2.0e-3
TOWER_TOL = {"bfloat16": 1e-1, "float16": 8e-3}
PATCHES = {"Qwen2-VL": "vllm.qwen2_vl_host_lengths", "Qwen3-Omni": "vllm.qwen3_omni_vision_host_lengths"}
TOWERS = [pytest.param(name, marks=pytest.mark.claimed(patch), id=name) for name, patch in PATCHES.items()]
# Fresh interpreters, 19 s a tower: one lane per family (tests/conftest.py).
TOWERS_PER_FAMILY = [pytest.param(name, marks=pytest.mark.claimed(patch, per_family=True), id=name)
                     for name, patch in PATCHES.items()]


def release():
    from importlib.metadata import version

    return version("vllm")


@pytest.fixture(scope="module")
def stack():
    from npu_shim.testing import census

    return census.setup()


def row(name):
    import npu_shim

    return next(r for r in npu_shim.status() if r["name"] == name)


@pytest.mark.parametrize("name", TOWERS)
def test_status_names_the_family(stack, name):
    """The family whose fence claims the installed release is the one whose check accepted it."""
    found = row(PATCHES[name])
    assert found["state"] == "applied" and [found["family"]] == found["admitted"], found


@pytest.mark.parametrize("name", TOWERS)
def test_whole_tower_forward_reads_nothing_back(stack, name, device_class):
    from npu_shim.testing import census

    for run in census.side_by_side(stack, name, device_class):
        syncs, up_syncs = run.syncs, run.up_syncs
        print("%s vllm %s %s forward %d: upstream %s -> shim %s"
              % (name, release(), device_class, run.index, up_syncs.summary(), syncs.summary()))
        assert (up_syncs.count, syncs.count) == (run.layers, 0), \
            (up_syncs.summary(), [str(e) for e in syncs.events])
        assert syncs.h2d_count == up_syncs.h2d_count == 0
        census.assert_matches_references(stack, name, run, TOWER_TOL)


@pytest.mark.claimed("vllm.qwen2_vl_host_lengths")
def test_qwen2_vl_the_copy_is_upstreams_and_holds_the_host_array(stack, monkeypatch):
    """prepare_encoder_metadata's copy runs as upstream wrote it (one call of the same op,
    same arguments), and the host array kept on its result holds the device tensor's values;
    a call that skips compute_attn_mask_seqlen (max_seqlen_override) keeps nothing."""
    import torch

    from npu_shim.patches._shared import host_record as record
    from npu_shim.testing import census

    tower = census.build(stack, "Qwen2-VL", stack.attention["A2"])
    module = census._MODULES["Qwen2-VL"]
    seen = []
    if "async_tensor_h2d" in vars(module):
        real = module.async_tensor_h2d

        def spy(*args, **kwargs):
            seen.append((args[1:], kwargs))
            return real(*args, **kwargs)

        monkeypatch.setattr(module, "async_tensor_h2d", spy)
        expected = [((tower.device,), {})]
    else:
        real_to = torch.Tensor.to

        def spy(self, *args, **kwargs):
            if self.dtype == torch.int32 and self.dim() == 1:
                seen.append((args, kwargs))
            return real_to(self, *args, **kwargs)

        monkeypatch.setattr(torch.Tensor, "to", spy)
        expected = [((), {"device": tower.device, "non_blocking": True})]
    grid = census.grids(1)
    with torch.inference_mode():
        metadata = tower.prepare_encoder_metadata(grid)
        monkeypatch.undo()
        cu_seqlens = metadata["cu_seqlens"]
        kept = record.take(cu_seqlens)
        assert seen == expected, repr(seen)
        assert kept is not None and torch.equal(kept, cu_seqlens.cpu())
        assert kept.tolist() == [0] + torch.tensor([h * w for t, h, w in grid for _ in range(t)]).cumsum(0).tolist()
        assert record.take(cu_seqlens) is None                       # taken once
        other = tower.prepare_encoder_metadata(grid, max_seqlen_override=64)
        assert record.ATTR not in other["cu_seqlens"].__dict__


@pytest.mark.claimed("vllm.qwen3_omni_vision_host_lengths")
def test_qwen3_omni_a_device_grid_keeps_nothing(stack):
    """The host lengths come only from a host grid: a grid that is not a 2-D CPU tensor gives none."""
    import torch

    from npu_shim.patches.vllm.qwen3_omni_vision_host_lengths import families

    grid = torch.tensor([[1, 8, 8], [2, 4, 12]])
    assert families.host_lengths(grid).tolist() == [0, 64, 112, 160]
    assert families.host_lengths(grid[0]) is None
    assert families.host_lengths([[1, 8, 8]]) is None
    meta = torch.empty(2, 3, dtype=torch.long, device="meta")
    assert families.host_lengths(meta) is None


@pytest.mark.claimed("vllm.qwen3_omni_vision_host_lengths")
def test_qwen3_omni_a_device_stand_in_grid_is_not_host_data(stack):
    """The stand-in rule (``host_data.is_host``): a grid on the device, whose stand-in answers
    ``cpu:0`` (type "cpu"), gives no host lengths and is not read. The old rule
    (``device.type != "cpu"`` alone) took it for a host grid and read it (``.numpy()``)."""
    import torch

    from npu_shim.patches.vllm.qwen3_omni_vision_host_lengths import families
    from npu_shim.testing import count_host_syncs

    grid = torch.tensor([[1, 8, 8], [2, 4, 12]])
    with count_host_syncs(device_tensors=[grid], follow_placement=True) as syncs:
        assert families.host_lengths(grid) is None
    assert syncs.count == 0, [str(e) for e in syncs.events]


@pytest.mark.claimed("vllm.qwen3_omni_vision_host_lengths")
def test_qwen3_omni_a_device_grid_keeps_the_towers_reads_and_reads_cu_seqlens_once(stack, device_class):
    """The whole tower with its grid on the device: no read in the patch's code (or
    host_data's), the attention reads ``cu_seqlens`` back once per forward where upstream reads
    it in every layer, the tower's own reads of the grid are upstream's; output ``torch.equal``
    to upstream's. Under the old rule the patch read the device grid itself."""
    from npu_shim.testing import census

    for run in census.side_by_side(stack, "Qwen3-Omni", device_class, grid_on_device=True):
        syncs, up_syncs = run.syncs, run.up_syncs
        print("Qwen3-Omni vllm %s %s forward %d, device grid: upstream %s -> shim %s"
              % (release(), device_class, run.index, up_syncs.summary(), syncs.summary()))
        own = [str(e) for e in syncs.events
               if e.location.startswith(("qwen3_omni_vision_host_lengths/", "_shared/"))]
        assert own == [], own
        assert syncs.count == up_syncs.count - run.layers + 1, \
            ([str(e) for e in syncs.events], [str(e) for e in up_syncs.events])
        census.assert_matches_references(stack, "Qwen3-Omni", run, TOWER_TOL)


@pytest.mark.parametrize("name", TOWERS_PER_FAMILY)
def test_disabled_the_attention_read_comes_back(stack, name):
    """With the patch disabled (NPU_SHIM_DISABLE) the tower's cu_seqlens is read back once
    again (vllm.mm_encoder_attn's one read), with the same output: what the patch removes."""
    import subprocess
    import sys

    import torch

    code = ("import torch, npu_shim\n"
            "from npu_shim.testing import census\n"
            "s = census.setup(); a = s.attention['A2']\n"
            "t = census.build(s, %r, a)\n"
            "g = census.grids(0); x = census.pixel_values(%r, t, g)\n"
            "out, c = census.call(%r, t, a, x, g)\n"
            "print([r['state'] for r in npu_shim.status() if r['name'] == %r][0], c.count)\n"
            "torch.save(out, %r)\n")
    outputs = {}
    for disabled in (True, False):
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "npu_shim_copies_%d_%d.pt" % (os.getpid(), disabled))
        env = dict(os.environ)
        env.pop("NPU_SHIM_DISABLE", None)
        if disabled:
            env["NPU_SHIM_DISABLE"] = PATCHES[name]
        proc = subprocess.run([sys.executable, "-P", "-c", code % (name, name, name, PATCHES[name], path)],
                              env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[disabled] = (proc.stdout.strip().splitlines()[-1], path)
    try:
        assert outputs[True][0] == "disabled 1"
        assert outputs[False][0] == "applied 0"
        assert torch.equal(torch.load(outputs[True][1]), torch.load(outputs[False][1]))
    finally:
        for _, path in outputs.values():
            os.unlink(path)
