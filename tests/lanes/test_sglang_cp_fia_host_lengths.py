"""Patch ``sglang.cp_fia_host_lengths`` on the real sglang 0.5.23 wheel (lane latest-sglang).

Upstream code at the pinned version runs: ``ZigzagCPStrategy`` (bound with
sglang's ``init_cp_strategy`` for rank r of cp_size 2 through
``get_parallel().override``), ``prepare_cp_forward`` (``build_metadata`` +
``pad_logical_token_to_physical``), ``shard_hidden_states``, ``RadixAttention``,
``ForwardBatch``, ``ReqToTokenPool``, ``AscendAttnBackend.init_forward_metadata``
and ``do_cp_attn_fia`` itself (upstream's, and the shim's replacement). What
does not run as in production is listed in npu_shim/testing/cp_case.py and
cp_strategy_case.py. torch_npu is npu-shim's emulation.

Checked, both ranks in turn, for every case (uneven lengths, lengths whose
rank shares get pad rows, cached prefixes, GQA, page sizes 16 and 128 with
shuffled pages, float16):
* upstream makes 4 device->host syncs per layer (``.tolist()`` x 2 per FIA call,
  2 calls), the patched method 0;
* both make the same two ``npu_fused_infer_attention_score`` calls with equal
  arguments, and their outputs are bit-identical;
* the output matches the float64 causal reference on the logical rows, and the
  pad rows are zero.
"""
import os

import pytest

import npu_shim

pytestmark = [pytest.mark.claimed("sglang.cp_fia_host_lengths"), pytest.mark.patch("sglang.cp_fia_host_lengths")]

from sglang_support import cp_strategy_case, shim  # noqa: E402  (tests/lanes/conftest.py)

from npu_shim.testing import cp_case  # noqa: E402
from npu_shim.testing.claims import claimed_family  # noqa: E402

TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
NAME = "sglang.cp_fia_host_lengths"
CP_SIZE = 2
LAYERS = 3


def _specs():
    import torch

    Spec = cp_case.Spec
    return [
        Spec(extend_lens=(45,), page_size=16, seed=1),                              # 45 % 8 != 0: pad rows
        Spec(extend_lens=(64,), page_size=128, seed=2),                             # no padding
        Spec(extend_lens=(37, 20, 29), page_size=16, num_heads=8, num_kv_heads=2, seed=3),
        Spec(extend_lens=(26, 41, 18), prefix_lens=(16, 0, 35), page_size=16, num_heads=4,
             num_kv_heads=2, seed=4),
        Spec(extend_lens=(150, 12, 33), prefix_lens=(0, 130, 7), page_size=128, num_heads=8,
             num_kv_heads=1, seed=5),
        Spec(extend_lens=(40, 23), page_size=16, num_heads=8, num_kv_heads=2, dtype=torch.float16,
             seed=6),
    ]


SPECS = _specs()


@pytest.fixture(scope="module")
def module():
    return shim.install(TARGET)[0]


@pytest.fixture(scope="module")
def methods(module):
    """(upstream's do_cp_attn_fia, the shim's): uninstall puts upstream's back, install re-applies."""
    import npu_shim

    slot = module.AscendAttnBackend.__dict__
    patched = slot["do_cp_attn_fia"]
    assert getattr(patched, "__npu_shim_patch__", None) == NAME
    npu_shim.uninstall()
    upstream = slot["do_cp_attn_fia"]
    npu_shim.install()
    assert slot["do_cp_attn_fia"] is not upstream
    assert getattr(slot["do_cp_attn_fia"], "__npu_shim_patch__", None) == NAME
    return upstream, slot["do_cp_attn_fia"]


def test_applies_with_the_strategy_family(module):
    import npu_shim
    from npu_shim.engine import counters, guards

    row = next(r for r in npu_shim.status() if r["name"] == NAME)
    assert (row["state"], row["versions"]) == ("applied", {"sglang": guards.installed_version("sglang")}), row
    assert npu_shim.stats()[NAME]["family"] == claimed_family(NAME).name


def test_uninstall_restores_upstreams_method(module, methods):
    import npu_shim

    upstream, _ = methods
    assert not hasattr(upstream, "__npu_shim_patch__")
    assert upstream.__module__ == TARGET and upstream.__qualname__ == "AscendAttnBackend.do_cp_attn_fia"
    npu_shim.uninstall()
    try:
        assert module.AscendAttnBackend.__dict__["do_cp_attn_fia"] is upstream
    finally:
        npu_shim.install()


def _run(module, method, batch, rank, layers=1, device_syncs=True):
    """One rank: (output, host-sync counter, recorded NPU calls, logical rows) over ``layers`` calls."""
    from npu_shim.testing import count_host_syncs, record_npu_calls

    with cp_strategy_case.zigzag_rank(rank, CP_SIZE) as strategy:
        backend, layer, forward_batch, local_q = cp_strategy_case.rank_inputs(module, batch, strategy)
        stand_ins = cp_strategy_case.device_stand_ins(backend, forward_batch, local_q, batch)
        with count_host_syncs(device_tensors=stand_ins) as syncs, record_npu_calls() as calls:
            for _ in range(layers):
                out = method(backend, local_q, batch.k_cache, batch.v_cache, layer, forward_batch)
        return out, syncs, calls, cp_strategy_case.logical_rows(forward_batch), forward_batch


def _same_argument(a, b):
    import torch

    if isinstance(a, torch.Tensor):
        return isinstance(b, torch.Tensor) and a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
    return type(a) is type(b) and a == b


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label() + "-" + "x".join(map(str, s.extend_lens)))
def test_zero_syncs_same_fia_calls_bit_identical_and_correct(module, methods, spec):
    import torch

    upstream, patched = methods
    batch = cp_case.make_batch(spec)
    reference = batch.reference()
    padded_somewhere = False
    for rank in range(CP_SIZE):
        up_out, up_syncs, up_calls, rows, forward_batch = _run(module, upstream, batch, rank, LAYERS)
        out, syncs, calls, _, _ = _run(module, patched, batch, rank, LAYERS)
        # 4 per layer upstream (.tolist() of cu_seqlens_q[1:] and of the KV lengths, twice)
        assert up_syncs.count == 4 * LAYERS and up_syncs.kinds() == {"tolist": 4 * LAYERS}, up_syncs.summary()
        assert syncs.count == 0, syncs.summary()
        # the same op, called the same way
        assert [c.name for c in up_calls] == [c.name for c in calls] == \
            ["npu_fused_infer_attention_score"] * (2 * LAYERS)
        for up_call, call in zip(up_calls, calls):
            assert up_call.args == () and call.args == ()
            assert sorted(up_call.kwargs) == sorted(call.kwargs)
            for key in up_call.kwargs:
                assert _same_argument(up_call.kwargs[key], call.kwargs[key]), key
            assert isinstance(call.kwargs["actual_seq_lengths"], list)
            assert all(type(n) is int for n in call.kwargs["actual_seq_lengths_kv"])
        assert torch.equal(out, up_out)   # bit-identical
        expected = cp_case.rank_expected(batch, reference, rank)
        assert cp_case.max_abs_err(out[:rows], expected) <= cp_case.tolerance(spec.dtype)
        assert out.shape[0] == forward_batch.attn_cp_metadata.per_rank_actual_token[rank]
        assert bool((out[rows:] == 0).all())
        padded_somewhere |= out.shape[0] > rows
    if spec.extend_lens in ((45,), (37, 20, 29)):
        assert padded_somewhere, "this case is meant to have pad rows"


def test_other_tensors_fall_back_to_upstreams_conversion(module, methods):
    """Metadata without the host lists: the closure converts as upstream does, and says so."""
    import torch

    from npu_shim.engine import counters

    upstream, patched = methods
    batch = cp_case.make_batch(SPECS[2])
    with cp_strategy_case.zigzag_rank(0, CP_SIZE) as strategy:
        backend, layer, forward_batch, local_q = cp_strategy_case.rank_inputs(module, batch, strategy)
        expected = upstream(backend, local_q, batch.k_cache, batch.v_cache, layer, forward_batch)
        forward_batch.attn_cp_metadata.kv_len_next_list = None
        before = counters.snapshot()[NAME]["host_copies"]
        out = patched(backend, local_q, batch.k_cache, batch.v_cache, layer, forward_batch)
    assert counters.snapshot()[NAME]["host_copies"] - before == 2   # the next half only
    assert torch.equal(out, expected)


def test_strict_raises_on_a_mismatch(run_python, make_env):
    """Fresh interpreter, strict mode: the import of the target raises when the strategy no
    longer passes the metadata's tensors. (Disabled = upstream's method: in
    test_sglang_small_page_fia.py, which checks both patches switched off in one interpreter.)"""
    placeholders = os.path.join(os.path.dirname(os.path.dirname(__file__)), "placeholders")
    strict = run_python(
        "import importlib, npu_shim\n"
        "from sglang.srt.layers.cp import zigzag\n"
        "zigzag.ZigzagCPStrategy.run_attention = lambda self, q, fb, device, fn, **kw: fn(q, None, None, 0)\n"
        "importlib.import_module(%r)\n" % TARGET,
        env=make_env(NPU_SHIM_EMULATE="1", NPU_SHIM_STRICT="1", NPU_SHIM_DISABLE="sglang.small_page_fia",
                     PYTHONPATH=placeholders), check=False, timeout=600)
    assert strict.returncode != 0
    assert "PatchError" in strict.stderr and NAME in strict.stderr
    assert "does not pass cu_seqlens_q_next_tensor" in strict.stderr
