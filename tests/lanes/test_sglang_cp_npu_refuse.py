"""sglang.cp_npu_refuse on the real sglang 0.5.20, 0.5.21 and 0.5.22 wheels, where the NPU prefill CP KV gather is a stub that raises.

First the finding, run on upstream (no shim): the NPU CP KV gather is a stub
that raises, and the Ascend backend's prefill CP path reaches it at the first
CP prefill (``forward_extend`` with upstream's own ``prepare_cp_forward``
metadata), while ``ServerArgs`` resolution accepts ``--enable-prefill-cp`` on
an NPU platform. Then the patch: the same ``ServerArgs`` is refused at
resolution with one message; CP off, or a non-NPU platform, still resolves;
disabled = upstream; uninstall restores; strict mode raises on a mismatch.
On 0.5.20 the gather is the same stub, but upstream's own start-up check still
refuses NPU prefill CP: the release is outside the patch's window (the reason says
why), its check would say "fixed upstream", and the refusal is upstream's.

The platform is set with sglang's own test hook ``override_platform(is_npu=...)``.
"""
import importlib
import json
import os

import pytest

from npu_shim.patch import FamilyContext

APPLIES = pytest.mark.claimed("sglang.cp_npu_refuse")       # the family's releases
# the release just below the window, which refuses by itself
BELOW = pytest.mark.claimed("sglang.cp_npu_refuse", outside="below")
pytestmark = [APPLIES, BELOW, pytest.mark.patch("sglang.cp_npu_refuse")]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
HOOK = "sglang.srt.arg_groups.parallel_hook"
BACKEND = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
STUB_MESSAGE = r"Prefill CP on (HIP/)?NPU/MUSA is deprecated"   # 0.5.20-0.5.21, 0.5.22


@pytest.fixture(scope="module")
def shim():
    import npu_shim
    from npu_shim import emulation

    emulation.install()
    npu_shim.install()
    return npu_shim


def server_args(cp, device):
    from sglang.srt.server_args import ServerArgs

    if cp:
        return ServerArgs(model_path="dummy", device=device, enable_prefill_cp=True, cp_strategy="zigzag",
                          attn_cp_size=2, tp_size=2)
    return ServerArgs(model_path="dummy", device=device)


def resolve(args, npu):
    from sglang.srt.runtime_context import override_platform

    with override_platform(is_npu=npu):
        args.resolve_once()


def test_the_npu_kv_gather_is_a_stub_that_raises(shim):
    from sglang.srt.layers.utils import cp_utils

    backend = importlib.import_module(BACKEND)
    assert backend.cp_all_gather_rerange_kv_cache is cp_utils.cp_all_gather_rerange_kv_cache
    with pytest.raises(ValueError, match=STUB_MESSAGE):
        cp_utils.cp_all_gather_rerange_kv_cache(None, 2, None, None)


def test_upstream_prefill_cp_fails_at_the_first_cp_prefill(shim, monkeypatch):
    """forward_extend on a CP-v2 batch built by upstream's prepare_cp_forward hits the stub."""
    import torch

    from npu_shim.testing import cp_case
    from sglang_support.cp_pad_worker import make_backend, make_pool
    from sglang.srt.layers.cp.base import get_cp_strategy
    from sglang.srt.layers.cp.utils import prepare_cp_forward
    from sglang.srt.runtime_context import get_context, get_parallel

    module = importlib.import_module(BACKEND)
    # The stream handed to the gather: upstream asks torch.get_device_module(), which is torch.cpu
    # with torch 2.11 here but torch.cuda with torch 2.14 (0.5.22's pin) on a machine without a
    # GPU; on Ascend it is torch.npu. The CPU stream, as with torch 2.11.
    monkeypatch.setattr(module, "get_current_device_stream_fast", torch.cpu.current_stream)
    spec = cp_case.Spec(extend_lens=(16, 24))     # no pad rows: fails for every length
    # a consistent topology for rank 0 of tp 2 = attn-cp 2 (0.5.21 validates overrides)
    topology = dict(tp_size=2, tp_rank=0, moe_tp_size=2, moe_ep_size=1, moe_dp_size=1, attn_tp_size=1,
                    attn_tp_rank=0, attn_dp_size=1, attn_dp_rank=0, attn_cp_size=2, attn_cp_rank=0)
    with get_context().override_server_args(device="cpu", enable_prefill_cp=True, cp_strategy="zigzag",
                                            attn_cp_size=2), get_parallel().override(**topology):
        os.environ["SGLANG_ENABLE_CP_V2"] = "1"
        os.environ["ASCEND_USE_FIA"] = "1"
        try:
            batch = cp_case.make_batch(spec, write_new_tokens=False)
            forward_batch = cp_case.make_forward_batch(batch, None)
            prepare_cp_forward(forward_batch)
            strategy = get_cp_strategy()
            new_k, new_v = batch.packed_new_kv()
            local = [strategy.shard_hidden_states(x.reshape(x.shape[0], -1), forward_batch)
                     for x in (batch.packed_q(), new_k, new_v)]
            pool = make_pool(spec, batch)
            backend = make_backend(module, spec, batch, pool, forward_batch, 2)
            with pytest.raises(ValueError, match=STUB_MESSAGE):
                backend.forward_extend(local[0], local[1].view(-1, spec.num_kv_heads, spec.qk_head_dim),
                                       local[2].view(-1, spec.num_kv_heads, spec.v_head_dim),
                                       cp_case.make_layer(spec), forward_batch)
        finally:
            del os.environ["SGLANG_ENABLE_CP_V2"], os.environ["ASCEND_USE_FIA"]
    assert isinstance(local[0], torch.Tensor)


def sglang_version():
    from importlib.metadata import version

    return version("sglang")


@BELOW
def test_skipped_where_upstream_already_refuses_npu_prefill_cp(shim):
    from npu_shim.patch import NotNeeded
    from npu_shim.patches.sglang import cp_npu_refuse as patch

    row = next(r for r in shim.status() if r["name"] == patch.PATCH.name)
    hook = importlib.import_module(HOOK)
    assert row["state"] == "skipped" and row["reason"].startswith("sglang 0.5.20 is outside >=0.5.21"), row
    assert patch.ALREADY_REFUSED in row["reason"], row
    with pytest.raises(NotNeeded):        # the structure says the same, were the window wider
        patch.check(hook, FamilyContext(patch.PATCH.name))
    assert not hasattr(hook.validate_prefill_cp_platform, "__npu_shim_patch__")
    with pytest.raises(ValueError, match="Prefill CP on HIP/NPU/MUSA is deprecated"):
        resolve(server_args(cp=True, device="npu"), npu=True)       # upstream's own refusal


@APPLIES
def test_patch_applies_and_refuses_npu_prefill_cp_at_resolution(shim):
    from npu_shim.patches.sglang import cp_npu_refuse as patch

    row = next(r for r in shim.status() if r["name"] == patch.PATCH.name)
    hook = importlib.import_module(HOOK)
    assert row["state"] == "applied", row
    assert hook.validate_prefill_cp_platform.__npu_shim_patch__ == patch.PATCH.name
    assert hook.validate_prefill_cp_platform.__name__ == "validate_prefill_cp_platform"
    with pytest.raises(ValueError) as raised:
        resolve(server_args(cp=True, device="npu"), npu=True)
    message = str(raised.value)
    assert "sglang %s cannot run prefill context parallelism on Ascend NPU" % sglang_version() in message
    assert "sglang 0.5.23 (where this patch's window ends) has a working NPU CP path" in message and "--enable-prefill-cp" in message


@pytest.mark.parametrize("cp, npu", [(False, True), (True, False), (False, False)])
def test_cp_off_or_other_platforms_still_resolve(shim, cp, npu):
    resolve(server_args(cp=cp, device="npu" if npu else "cpu"), npu=npu)


UPSTREAM_CODE = """
import importlib, json, npu_shim
from npu_shim import emulation
emulation.install(); npu_shim.install()
from sglang.srt.server_args import ServerArgs
from sglang.srt.runtime_context import override_platform
hook = importlib.import_module(%r)
row = next(r for r in npu_shim.status() if r["name"] == "sglang.cp_npu_refuse")
args = ServerArgs(model_path="dummy", device="npu", enable_prefill_cp=True, cp_strategy="zigzag",
                  attn_cp_size=2, tp_size=2)
with override_platform(is_npu=True):
    args.resolve_once()
print(json.dumps([row["state"], hook.validate_prefill_cp_platform.__module__ == hook.__name__,
                  hasattr(hook.validate_prefill_cp_platform, "__npu_shim_patch__")]))
""" % HOOK


@APPLIES
def test_upstream_accepts_npu_prefill_cp_and_disabled_is_upstream(run_python, make_env):
    env = make_env(NPU_SHIM_DISABLE="sglang.cp_npu_refuse",
                   PYTHONPATH=os.path.join(REPO, "tests", "placeholders"))
    out = run_python(UPSTREAM_CODE, env=env, timeout=300).stdout.strip().splitlines()[-1]
    assert json.loads(out) == ["disabled", True, False]


@APPLIES
def test_uninstall_restores_upstream_check(run_python, make_env):
    code = UPSTREAM_CODE.replace("row = next(", "npu_shim.uninstall()\nrow = next(")
    env = make_env(PYTHONPATH=os.path.join(REPO, "tests", "placeholders"))
    out = run_python(code, env=env, timeout=300).stdout.strip().splitlines()[-1]
    assert json.loads(out)[1:] == [True, False]     # upstream's function, and it accepts again


STRICT_CODE = """
import importlib, json, npu_shim
from npu_shim import emulation
emulation.install(); npu_shim.install()
from sglang.srt.layers.utils import cp_utils
def cp_all_gather_rerange_kv_cache(input_tensor, cp_size, forward_batch, stream):
    return gather(input_tensor)          # a build of this window whose gather is no stub
cp_utils.cp_all_gather_rerange_kv_cache = cp_all_gather_rerange_kv_cache
hook = importlib.import_module(%r)
row = next(r for r in npu_shim.status() if r["name"] == "sglang.cp_npu_refuse")
print(json.dumps([row["state"], row["reason"]]))
""" % HOOK


@APPLIES
@pytest.mark.parametrize("strict", ["0", "1"])
def test_a_mismatch_inside_the_window_skips_or_raises_in_strict_mode(run_python, make_env, strict):
    env = make_env(NPU_SHIM_STRICT=strict, PYTHONPATH=os.path.join(REPO, "tests", "placeholders"))
    proc = run_python(STRICT_CODE, env=env, check=False, timeout=300)
    if strict == "1":
        assert proc.returncode != 0
        assert "PatchError" in proc.stderr and "is not the _deprecated_platform_cp stub" in proc.stderr
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        state, reason = json.loads(proc.stdout.strip().splitlines()[-1])
        assert state != "applied" and "is not the _deprecated_platform_cp stub" in reason
