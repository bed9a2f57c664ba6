"""Patch ``vllm.mm_encoder_host_lengths`` (with ``vllm.mm_encoder_attn``, and
``vllm.qwen2_5_vl_host_lengths`` where Qwen2.5-VL copies ``cu_seqlens`` itself): whole
vision-tower forwards with no device->host read.

vLLM's own tower classes (Qwen2.5-VL, Qwen3-VL) from tiny random configs, their
``MMEncoderAttention`` layers handed back as vllm-ascend's class of each device
class (A2, 310P) through the out-of-tree registration, run in
``torch.inference_mode()``: two forwards with different image grids, each
with a multi-frame item. Stand-ins and why: :mod:`npu_shim.testing.towers`.
On this CPU-only machine the tower's parameters and ``pixel_values`` stand in
for device tensors (``count_host_syncs(device_modules=...)``), and placement
is followed from there: what the tower copies to ``.device`` is a device
tensor, what it builds from host data is a host tensor.

Gate, per tower x device class: 0 device->host reads per whole forward with
the shim, upstream's count (the untouched vllm-ascend class, same tower, same
weights) recorded beside it; outputs bit-identical to upstream's
(``torch.equal``: the same emulated op runs on the same data), close to vLLM's
own TORCH_SDPA tower and to a float64 copy whose attention is
``npu_shim.testing.attention_f64``.
"""

import os

import pytest

from npu_shim.testing.errors import Tolerance

pytestmark = [pytest.mark.claimed("vllm.mm_encoder_host_lengths"),
              pytest.mark.patch("vllm.mm_encoder_host_lengths", "vllm.mm_encoder_attn",
                                "vllm.qwen2_5_vl_host_lengths")]

PATCH_NAME = "vllm.mm_encoder_host_lengths"
# |tower - float64 tower| and |tower - TORCH_SDPA tower|, relative to max |float64 tower| (no
# floor); measured worst (vllm-0.18, Qwen2.5-VL and Qwen3-VL): bfloat16 1.5e-2 (vs SDPA 8.7e-3),
# float16 2.3e-3 (Qwen2.5-VL; vs SDPA 1.6e-3; Qwen3-VL 1.2e-3, 1.1e-3)
TOWER_TOL = {"bfloat16": 4e-2, "float16": 6e-3}
# one layer, bfloat16 inputs, vs float64 (absolute); the same layer measured 7.3e-3 in test_mm_encoder_018
HW_TOL = Tolerance("layer host-lengths bfloat16 vs float64", 2e-2, "bfloat16")


@pytest.fixture(scope="module")
def stack():
    from npu_shim.testing import towers

    return towers.setup()


def vllm_minor():
    from importlib.metadata import version

    return ".".join(version("vllm").split(".")[:2])


def tower_copies_itself():
    """Whether Qwen2.5-VL copies its cu_seqlens itself here (vllm.qwen2_5_vl_host_lengths applies)."""
    import npu_shim

    row = next(r for r in npu_shim.status() if r["name"] == "vllm.qwen2_5_vl_host_lengths")
    return row["state"] == "applied"


def run(tower, attention_class, x, grid):
    import torch

    from npu_shim.testing import count_host_syncs
    from npu_shim.testing.towers import registered

    with torch.inference_mode(), registered(attention_class):
        with count_host_syncs(device_tensors=[x], device_modules=[tower]) as syncs:
            out = tower(x, grid_thw=grid)
    return out, syncs


def test_status(stack):
    from npu_shim.testing import claims

    family = claims.claimed_family(PATCH_NAME)
    assert family is not None, "no family claims vLLM %s: no lane of this test should be outside them" % vllm_minor()
    row = claims.status_row(PATCH_NAME)
    assert (row["state"], row["family"]) == ("applied", family.name), row


@pytest.mark.parametrize("name", ["Qwen2.5-VL", "Qwen3-VL"])
def test_whole_tower_forward_reads_nothing_back(stack, name, device_class):
    import torch

    from npu_shim.testing import towers

    patched = towers.build_tower(stack, name, stack.attention[device_class])
    upstream = towers.build_tower(stack, name, stack.upstream[device_class])
    sdpa = towers.build_tower(stack, name, None)
    for forward in range(2):
        grid = towers.grids(forward)
        x = towers.pixel_values(patched, grid, seed=forward)
        out, syncs = run(patched, stack.attention[device_class], x, grid)
        up, up_syncs = run(upstream, stack.upstream[device_class], x, grid)
        sd, _ = run(sdpa, None, x, grid)
        print("%s %s forward %d: upstream %s -> shim %s" % (name, device_class, forward,
                                                           up_syncs.summary(), syncs.summary()))
        # vLLM's Qwen2.5-VL tower in float16 (310P) calls cast_overflow_tensors once per forward;
        # where that checks for inf/nan first it reads two bools back (upstream and shim alike):
        # reads the host-lengths patches do not cover, and no attention's.
        overflow = overflow_check_reads() if name == "Qwen2.5-VL" and out.dtype == torch.float16 else 0
        assert overflow_reads(syncs) == overflow_reads(up_syncs) == overflow, syncs.summary()
        assert syncs.count == overflow, [str(e) for e in syncs.events]
        if name == "Qwen2.5-VL" and tower_copies_itself():
            assert up_syncs.count >= 2, up_syncs.summary()   # upstream reads both tensors back
        assert syncs.h2d_count == up_syncs.h2d_count
        assert torch.equal(out, up)
        ref = towers.reference_forward(stack, name, x, grid)
        towers.assert_near_references("tower " + name, out, ref, sd, TOWER_TOL)


def overflow_check_reads():
    """The reads the installed vLLM's ``cast_overflow_tensors`` (as Qwen2.5-VL's module holds it)
    makes on a float16 device tensor: 2 where it checks ``isinf().any()`` / ``isnan().any()``
    before clamping, 0 where it clamps unconditionally (vLLM 0.28.0)."""
    import torch
    from vllm.model_executor.models import qwen2_5_vl

    from npu_shim.testing import count_host_syncs

    t = torch.zeros(4, 8, dtype=torch.float16)
    with count_host_syncs(device_tensors=[t]) as syncs:
        qwen2_5_vl.cast_overflow_tensors(t)
    return syncs.count


def overflow_reads(syncs):
    return sum("cast_overflow_tensors" in str(e) for e in syncs.events)


def test_a_reused_cu_seqlens_tensor_is_read_again(stack):
    """The record is taken once: a tensor reused for a second forward (a graph buffer
    refilled in place) is read from the device, never answered from the old record."""
    import numpy as np
    import torch
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    from npu_shim.testing import count_host_syncs
    from npu_shim.testing.towers import build_tower
    from npu_shim.testing.towers import registered as towers_registered

    tower = build_tower(stack, "Qwen3-VL", stack.attention["A2"])
    layer = tower.blocks[0].attn.attn
    cu = MMEncoderAttention.maybe_recompute_cu_seqlens(tower.attn_backend, np.array([0, 4, 10], np.int32),
                                                       160, 1, torch.device("cpu"))
    q = torch.randn(1, 10, 2, 80, dtype=torch.bfloat16)     # the A2 tower's dtype
    with torch.inference_mode(), towers_registered(stack.attention["A2"]), \
            count_host_syncs(device_tensors=[cu, q]) as syncs:
        first = layer(q, q, q, cu_seqlens=cu)
        cu.copy_(torch.tensor([0, 6, 10], dtype=cu.dtype))       # refilled in place
        second = layer(q, q, q, cu_seqlens=cu)
    assert syncs.count == 1, syncs.summary()
    from npu_shim.testing import attention_f64

    for out, bounds in ((first, [0, 4, 10]), (second, [0, 6, 10])):
        ref = attention_f64(q[0], q[0], q[0], bounds, scale=layer.scale)
        assert (out.reshape(ref.shape).double() - ref).abs().max().item() < HW_TOL


@pytest.mark.claimed(PATCH_NAME, per_family=True)
def test_disable_switch(stack):
    from npu_shim.testing import towers

    assert towers.state_with_disabled(PATCH_NAME) == "disabled"


def tower_calls_of_maybe_recompute(module_file):
    """A profiler that counts the calls of ``maybe_recompute_cu_seqlens`` made from the tower's own
    module (``module_file``): what vLLM's tower code does, read without the shim's counters."""
    import sys

    seen = []

    def profile(frame, event, arg):
        if event == "call" and frame.f_code.co_name == "maybe_recompute_cu_seqlens" \
                and frame.f_back is not None and frame.f_back.f_code.co_filename == module_file:
            seen.append(frame.f_back.f_code.co_name)

    return seen, profile


@pytest.mark.parametrize("name", ["Qwen2.5-VL", "Qwen3-VL"])
def test_counters_count_through_the_tower_forward(stack, name):
    """``npu_shim.stats()`` after the tower's own forwards: ``calls`` is the number of times the
    tower copied ``cu_seqlens`` through ``maybe_recompute_cu_seqlens`` (counted by a profiler on
    the tower's module, not by the shim; Qwen2.5-VL: full and window, 2 a forward; Qwen3-VL: 1),
    the nested call vLLM's method makes through vllm-ascend's class is not a second call, and
    nothing is handed back to upstream (no FlashInfer here). Before the fix: calls=0."""
    import sys

    import npu_shim
    from npu_shim.testing import towers

    tower = towers.build_tower(stack, name, stack.attention["A2"])
    module_file = sys.modules[type(tower).__module__].__file__
    before = npu_shim.stats()[PATCH_NAME]
    seen, profile = tower_calls_of_maybe_recompute(module_file)
    for forward in range(2):
        grid = towers.grids(forward)
        x = towers.pixel_values(tower, grid, seed=forward)
        sys.setprofile(profile)
        try:
            run(tower, stack.attention["A2"], x, grid)
        finally:
            sys.setprofile(None)
    after = npu_shim.stats()[PATCH_NAME]
    per_forward = 0 if name == "Qwen2.5-VL" and tower_copies_itself() else {"Qwen2.5-VL": 2, "Qwen3-VL": 1}[name]
    assert len(seen) == 2 * per_forward, seen
    assert (after["state"], after["calls"] - before["calls"], after["upstream_calls"] - before["upstream_calls"]) \
        == ("applied", len(seen), 0), (before, after)


RECORDING_CHILD = """
import sys, time, torch
from npu_shim.testing import towers
s = towers.setup()
t = towers.build_tower(s, sys.argv[1], s.attention["A2"])
g = towers.grids(0)
x = towers.pixel_values(t, g)
with torch.inference_mode(), towers.registered(s.attention["A2"]):
    t(x, grid_thw=g)
print("forward done", flush=True)
time.sleep(300)
"""


@pytest.mark.claimed(PATCH_NAME, per_family=True)   # a worker process killed: one lane per family
def test_record_of_a_worker_killed_after_the_tower_forward(stack, tmp_path):
    """A worker process runs the tower's forward and is killed with SIGKILL (vLLM's shutdown of its
    EngineCore): its record in NPU_SHIM_STATS_DIR holds the patch's family and the calls it made."""
    import json
    import signal
    import subprocess
    import sys
    import time

    from npu_shim.testing import claims

    # where Qwen2.5-VL copies its cu_seqlens itself (vllm.qwen2_5_vl_host_lengths keeps them), this patch
    # has nothing to keep in its tower: Qwen3-VL's forward is the one it serves (one call per forward)
    tower, expected = ("Qwen3-VL", 1) if tower_copies_itself() else ("Qwen2.5-VL", 2)
    env = dict(os.environ, NPU_SHIM_STATS_DIR=str(tmp_path))
    env.pop("NPU_SHIM_DISABLE", None)
    child = subprocess.Popen([sys.executable, "-P", "-c", RECORDING_CHILD, tower], env=env, stdout=subprocess.PIPE,
                             stderr=subprocess.PIPE, text=True)
    path = tmp_path / ("npu-shim-%d.json" % child.pid)

    def calls():
        try:
            return json.loads(path.read_text())["patches"][PATCH_NAME]["calls"]
        except (OSError, ValueError, KeyError):
            return None

    try:
        for line in child.stdout:              # vLLM logs to stdout too
            if line.strip() == "forward done":
                break
        else:
            raise AssertionError(child.stderr.read()[-3000:])
        deadline = time.monotonic() + 30       # a bound: the last count is written RECORD_INTERVAL later
        while calls() != expected and time.monotonic() < deadline:
            time.sleep(0.05)
        child.send_signal(signal.SIGKILL)
        assert child.wait(timeout=60) == -signal.SIGKILL
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    row = json.loads(path.read_text())["patches"][PATCH_NAME]
    assert (row["applied"], row["family"], row["calls"], row["upstream_calls"]) \
        == (True, claims.claimed_family(PATCH_NAME).name, expected, 0), row
