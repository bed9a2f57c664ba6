"""Patch ``vllm.qwen2_5_vl_host_lengths``: Qwen2.5-VL's own ``cu_seqlens`` copies keep their host arrays.

Where it applies (vLLM 0.18.0-0.21.0 in the lanes): the whole-tower gate (0 reads,
``torch.equal`` to upstream, close to float64) is
tests/lanes/test_mm_encoder_host_lengths.py; here: which family applies on
which release, the copy keeps upstream's arguments and leaves nothing on the
host tensor, the disable switch brings the two reads back, and the selftest.
On 0.22.0 and later the tower copies through ``maybe_recompute_cu_seqlens``
and the patch stays out (its window ends before 0.22.0).
"""
import os

import pytest

pytestmark = [pytest.mark.claimed("vllm.qwen2_5_vl_host_lengths"),
              pytest.mark.claimed("vllm.qwen2_5_vl_host_lengths", outside=("above", "newest")),   # the patch is out there, and why,
              pytest.mark.patch("vllm.qwen2_5_vl_host_lengths", "vllm.mm_encoder_host_lengths",
                                "vllm.mm_encoder_attn")]

PATCH_NAME = "vllm.qwen2_5_vl_host_lengths"
TOL = 2e-4


def vllm_version():
    from importlib.metadata import version

    from packaging.version import Version

    return Version(version("vllm"))


def tower_copies():
    """Whether a family of the patch claims the installed vLLM (its tower copies cu_seqlens itself)."""
    from npu_shim.testing import claims

    return claims.claimed_family(PATCH_NAME) is not None


@pytest.fixture(scope="module")
def stack():
    from npu_shim.testing import towers

    return towers.setup()


def row():
    import npu_shim

    return next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)


def test_status(stack):
    found = row()
    if tower_copies():
        from npu_shim.testing import claims

        assert (found["state"], found["family"]) == ("applied", claims.claimed_family(PATCH_NAME).name), found
    else:
        assert found["state"] != "applied", found
        assert "maybe_recompute_cu_seqlens" in found["reason"], found


def test_the_copy_keeps_upstreams_arguments_and_leaves_the_host_tensor_clean(stack, monkeypatch):
    if not tower_copies():
        pytest.skip("vLLM %s copies cu_seqlens through maybe_recompute_cu_seqlens: the patch is out"
                    % vllm_version())
    import torch

    from npu_shim.patches._shared import host_record as record
    from npu_shim.patches.vllm.qwen2_5_vl_host_lengths import families
    from npu_shim.testing import count_host_syncs
    from npu_shim.testing.syncs import DEVICE

    host = torch.tensor([0, 16, 40], dtype=torch.int32)
    families.keep_at_next_copy(host)
    seen = []
    real_to = torch.Tensor.to

    def spy(self, *args, **kwargs):
        seen.append((args, kwargs))
        return real_to(self, *args, **kwargs)

    monkeypatch.setattr(torch.Tensor, "to", spy)
    copy = host.to(device=DEVICE, non_blocking=True)
    monkeypatch.undo()
    assert seen == [((), {"device": DEVICE, "non_blocking": True})], repr(seen)   # upstream's call, once
    assert "to" not in host.__dict__                       # the hook answers one copy only
    kept = record.take(copy)
    assert kept is not None and kept.tolist() == [0, 16, 40]
    # the same under the sync counter: a non-blocking copy, nothing read
    host = torch.tensor([0, 16, 40], dtype=torch.int32)
    families.keep_at_next_copy(host)
    with count_host_syncs(follow_placement=True) as syncs:
        copy = host.to(device=DEVICE, non_blocking=True)
    assert syncs.count == 0 and syncs.h2d_count == 0, syncs.summary()
    kept = record.take(copy)
    assert kept is not None and kept.tolist() == [0, 16, 40]
    assert record.take(copy) is None                       # taken once
    other = torch.zeros(2, 2, dtype=torch.int32)
    families.keep_at_next_copy(other)                      # 2-D: no hook
    assert "to" not in other.__dict__


@pytest.mark.claimed(PATCH_NAME, per_family=True)
def test_disabled_the_two_reads_come_back(stack):
    """With the patch disabled (NPU_SHIM_DISABLE) the Qwen2.5-VL tower reads its two
    cu_seqlens tensors back again, with the same output: what the patch removes."""
    import subprocess
    import sys

    if not tower_copies():
        pytest.skip("vLLM %s copies cu_seqlens through maybe_recompute_cu_seqlens: the patch is out"
                    % vllm_version())
    code = ("import torch, npu_shim\n"
            "from npu_shim.testing import towers, count_host_syncs\n"
            "s = towers.setup()\n"
            "t = towers.build_tower(s, 'Qwen2.5-VL', s.attention['A2'])\n"
            "g = towers.grids(0); x = towers.pixel_values(t, g)\n"
            "with torch.inference_mode(), towers.registered(s.attention['A2']), "
            "count_host_syncs(device_tensors=[x], device_modules=[t]) as c:\n"
            "    out = t(x, grid_thw=g)\n"
            "print([r['state'] for r in npu_shim.status() if r['name'] == %r][0], c.count)\n"
            "torch.save(out, %r)\n")
    outputs = {}
    for disabled in (True, False):
        path = os.path.join(os.environ.get("TMPDIR", "/tmp"), "npu_shim_q25_%d_%d.pt" % (os.getpid(), disabled))
        env = dict(os.environ)
        env.pop("NPU_SHIM_DISABLE", None)
        if disabled:
            env["NPU_SHIM_DISABLE"] = PATCH_NAME
        proc = subprocess.run([sys.executable, "-P", "-c", code % (PATCH_NAME, path)], env=env,
                              capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        outputs[disabled] = (proc.stdout.strip().splitlines()[-1], path)
    import torch

    assert outputs[True][0] == "disabled 2"
    assert outputs[False][0] == "applied 0"
    try:
        assert torch.equal(torch.load(outputs[True][1]), torch.load(outputs[False][1]))
    finally:
        for _, path in outputs.values():
            os.unlink(path)
