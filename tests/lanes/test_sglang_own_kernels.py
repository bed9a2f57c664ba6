"""The emulated launches of sglang's own Triton kernels (npu_shim/emulation/sgl_kernels.py,
``install_sglang_kernels``) against sglang's own pure-torch branches of the same callers, on the same
inputs: ``mem_cache.common.write_cache_indices`` (``write_req_to_token_pool_triton`` against its loop of
``ReqToTokenPool.write``) and ``forward_batch_info.compute_position`` (``compute_position_kernel``
against ``compute_position_torch``), each caller with its ``support_triton`` answer set both ways, on
batches of many shapes: no prefix, prefixes of 1 to 700 slots (past the kernel's 512-wide blocks),
extends of 0 to 600 tokens.

Runs on the lane that pins the oldest sglang (sglang_support/engine_lanes.py), whose ``support_triton``
is true on an NPU, so the engine launches these kernels there (tests/lanes/test_engine_sglang.py).
"""
import random

import pytest
import torch
from sglang_support import engine_lanes  # noqa: E402

pytestmark = pytest.mark.lanes(engine_lanes.OLDEST)


@pytest.fixture
def emulated(monkeypatch):
    """sglang's modules with the emulations in place of the Triton functions, put back afterwards."""
    from npu_shim.emulation import sgl_kernels

    defined = []
    for module_name, module in sgl_kernels.sglang_modules().items():
        for name in sgl_kernels.SGLANG_KERNELS[module_name]:
            if hasattr(module, name):
                monkeypatch.setattr(module, name, getattr(module, name))  # restored after the test
                defined.append((module_name, name))
    replaced = sgl_kernels.install_sglang_kernels()
    assert sorted(replaced) == sorted(m + "." + n for m, n in defined)
    # every kernel emulated is defined, once, by this release
    assert sorted(n for _, n in defined) == sorted({n for ks in sgl_kernels.SGLANG_KERNELS.values() for n in ks})
    return sgl_kernels


def _batch(rng, rows):
    bs = rng.randint(1, 6)
    pools = rng.sample(range(1, rows + 1), bs)
    pre = [rng.choice([0, rng.randint(1, 40), rng.randint(500, 700)]) for _ in range(bs)]
    ext = [rng.choice([0, 1, rng.randint(1, 130), rng.randint(513, 600)]) for _ in range(bs)]
    return pools, pre, ext


def test_write_cache_indices_the_kernel_writes_what_sglangs_loop_writes(emulated, monkeypatch):
    from sglang.srt.mem_cache import common
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    rng = random.Random(11)
    for _ in range(40):
        pools, pre, ext = _batch(rng, 8)
        seq = [p + e for p, e in zip(pre, ext)]
        prefixes = [torch.randint(0, 10 ** 6, (p,), dtype=torch.int64) for p in pre]
        out_cache_loc = torch.randint(0, 10 ** 6, (sum(ext),), dtype=torch.int64)
        tables = []
        for triton in (True, False):
            monkeypatch.setattr(common, "support_triton", lambda backend, triton=triton: triton)
            monkeypatch.setattr(common, "get_global_server_args",
                                lambda: type("Args", (), {"attention_backend": "ascend"})())
            pool = ReqToTokenPool(size=8, max_context_len=1400, device="cpu", enable_memory_saver=False)
            t = lambda values: torch.tensor(values, dtype=torch.int64)
            common.write_cache_indices(out_cache_loc, t(pools), t(pools), t(pre), t(pre), t(seq), t(seq), t(ext),
                                       t(ext), prefixes, pool)
            tables.append(pool.req_to_token.clone())
        assert torch.equal(tables[0], tables[1]), (pools, pre, ext)
        assert tables[0].any() or not sum(seq)


def test_compute_position_the_kernel_gives_what_sglangs_torch_branch_gives(emulated):
    from sglang.srt.model_executor.forward_batch_info import compute_position, compute_position_torch

    rng = random.Random(12)
    for _ in range(40):
        _, pre, ext = _batch(rng, 8)
        if not sum(ext):
            continue
        prefix_lens, seq_lens = torch.tensor(pre, dtype=torch.int32), torch.tensor(ext, dtype=torch.int32)
        got = compute_position("ascend", prefix_lens, seq_lens, sum(ext))        # support_triton: true
        want = compute_position_torch(prefix_lens, seq_lens)
        assert torch.equal(got[0], want[0]), (pre, ext)
        assert got[1].tolist() == want[1].tolist(), (pre, ext)
