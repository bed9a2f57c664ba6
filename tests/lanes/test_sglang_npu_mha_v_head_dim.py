"""Patches ``sglang.npu_mha_v_head_dim`` (builder, 0.5.16 on), ``sglang.npu_mha_v_head_dim_inline``
(``_init_pools``, 0.5.14 - 0.5.15) and ``sglang.npu_kv_cpu_copy_v_head_dim`` on the real sglang wheels.

The pool is built by the release's own builder on CPU (sglang_support/v_head_dim_case.py says what
is real), for MiMo-V2-Flash's attention geometry (K 192 / V 128; full layers 4 KV heads, SWA
layers 8) and for a standard model (K = V = 128):

* upstream (patches uninstalled): the V buffer is K-wide (192) and the first ``set_kv_buffer``
  fails, with or without ``ASCEND_USE_FIA`` (the message per release is in the report);
* patched: the V buffer is 128 wide, ``set_kv_buffer`` writes what it is given, and
  ``AscendAttnBackend.forward_extend`` (``save_kv_cache=True``: the new tokens go through
  ``set_kv_buffer``) matches the float64 causal reference over cached prefixes, in bfloat16 and
  float16, on sglang's FIA TND path (``ASCEND_USE_FIA=1``: CANN takes q/k 192 with v 128 in TND)
  and on its native-attention path (head dim > 128 without FIA);
* decode on that pool: test_sglang_npu_decode_v_head_dim.py (``sglang.npu_decode_v_head_dim``);
* ``get_cpu_copy`` / ``load_cpu_copy`` round-trip V (upstream's K-wide view takes wrong rows);
* a standard model takes upstream's builder and cpu copies, unedited (counted);
* two pools in one process (192/128 and 128/128) keep their own V width;
* below attention TP 8, the plain pool cannot hold MiMo's layer kinds: refused at construction,
  naming the way out; at TP 8 it builds.
"""
import os

import pytest

pytestmark = [pytest.mark.claimed("sglang.npu_mha_v_head_dim"),
              pytest.mark.claimed("sglang.npu_mha_v_head_dim_inline"),
              pytest.mark.claimed("sglang.npu_kv_cpu_copy_v_head_dim"),
              pytest.mark.patch("sglang.npu_mha_v_head_dim", "sglang.npu_mha_v_head_dim_inline",
                                "sglang.npu_kv_cpu_copy_v_head_dim")]

from sglang_support import v_head_dim_case as case  # noqa: E402  (tests/lanes/conftest.py)

from npu_shim.testing import cp_case  # noqa: E402

BUILDERS = ("sglang.npu_mha_v_head_dim", "sglang.npu_mha_v_head_dim_inline")
CPU_COPY = "sglang.npu_kv_cpu_copy_v_head_dim"


@pytest.fixture(scope="module")
def shim():
    return case.install_shim()


@pytest.fixture(autouse=True)
def npu_synchronize(monkeypatch):
    """get_cpu_copy/load_cpu_copy call torch.npu.synchronize(); the emulation creates no torch.npu
    (see npu_shim.emulation): a no-op stands in, as a host copy on CPU needs no stream sync."""
    import types

    import torch

    monkeypatch.setattr(torch, "npu", types.SimpleNamespace(synchronize=lambda: None), raising=False)


@pytest.fixture(params=["0", "1"], ids=["qlens-reshape-and-cache", "fia"])
def ascend_use_fia(request, monkeypatch):
    monkeypatch.setenv("ASCEND_USE_FIA", request.param)
    return request.param == "1"


def _builder_patch(shim):
    rows = {r["name"]: r for r in shim.status()}
    applied = [name for name in BUILDERS if rows[name]["state"] == "applied"]
    assert len(applied) == 1, {name: (rows[name]["state"], rows[name].get("reason")) for name in BUILDERS}
    return applied[0]


def _layer(pool, v_head_dim, q_heads=8):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(num_heads=q_heads, head_dim=pool.head_dim, scaling=pool.head_dim ** -0.5,
                          num_kv_heads=pool.head_num, layer_id=0, v_head_dim=v_head_dim)


def _write(pool, loc, seed=0, v_head_dim=None):
    """K and V of the model's widths (V: ``v_head_dim``, default the pool's) written at ``loc``."""
    import torch

    v_head_dim = v_head_dim or pool.v_head_dim
    gen = torch.Generator().manual_seed(seed)
    k = torch.randn(len(loc), pool.head_num, pool.head_dim, generator=gen).to(pool.dtype)
    v = torch.randn(len(loc), pool.head_num, v_head_dim, generator=gen).to(pool.dtype)
    pool.set_kv_buffer(_layer(pool, v_head_dim), torch.tensor(loc), k, v)
    return k, v


def _rows(buffer, pool, width, loc):
    import torch

    return buffer.reshape(-1, pool.head_num, width)[torch.tensor(loc)]


def test_applies_on_this_release(shim):
    rows = {r["name"]: r for r in shim.status()}
    assert rows[_builder_patch(shim)]["state"] == "applied"
    assert rows[CPU_COPY]["state"] == "applied", rows[CPU_COPY]


def test_upstream_gives_v_the_key_width_and_set_kv_buffer_fails(shim, ascend_use_fia):
    shim.uninstall()
    try:
        pool = case.build_pool(case.model_config(**case.MIMO), tp=8)
        assert (pool.head_dim, pool.v_head_dim) == (192, 192)
        assert pool.get_value_buffer(0).shape[-1] == 192
        with pytest.raises(ValueError) as raised:
            _write(pool, [17, 18, 19], v_head_dim=case.MIMO["v_head_dim"])
        print("upstream set_kv_buffer:", raised.value)
    finally:
        shim.install()


def test_the_pool_gets_the_models_v_head_dim(shim, ascend_use_fia):
    from npu_shim.engine import counters

    name = _builder_patch(shim)
    before = counters.snapshot().get(name, {}).get("calls", 0)
    pool = case.build_pool(case.model_config(**case.MIMO), tp=8)
    assert counters.snapshot()[name]["calls"] == before + 1
    assert (pool.head_num, pool.head_dim, pool.v_head_dim) == (1, 192, 128)
    assert pool.get_key_buffer(0).shape[-1] == 192 and pool.get_value_buffer(0).shape[-1] == 128
    assert pool.use_fia == ascend_use_fia
    loc = [17, 18, 19, 40]
    k, v = _write(pool, loc)
    assert (_rows(pool.get_key_buffer(0), pool, 192, loc) == k).all()
    assert (_rows(pool.get_value_buffer(0), pool, 128, loc) == v).all()


def test_a_standard_model_takes_upstreams_builder(shim, ascend_use_fia):
    from npu_shim.engine import counters

    name = _builder_patch(shim)
    before = dict(counters.snapshot().get(name, {}))
    pool = case.build_pool(case.model_config(**case.STANDARD), tp=1)
    after = counters.snapshot()[name]
    assert after.get("upstream_calls", 0) == before.get("upstream_calls", 0) + 1
    assert after.get("calls", 0) == before.get("calls", 0)
    shim.uninstall()
    try:
        upstream = case.build_pool(case.model_config(**case.STANDARD), tp=1)
    finally:
        shim.install()
    for built in (pool, upstream):
        assert (built.head_num, built.head_dim, built.v_head_dim) == (8, 128, 128)
    assert pool.get_value_buffer(0).shape == upstream.get_value_buffer(0).shape


def test_two_pools_in_one_process_keep_their_own(shim, ascend_use_fia):
    mimo = case.build_pool(case.model_config(**case.MIMO), tp=8)
    standard = case.build_pool(case.model_config(**case.STANDARD), tp=1)
    loc = [20, 21, 22]
    k_m, v_m = _write(mimo, loc, seed=1)
    k_s, v_s = _write(standard, loc, seed=2)
    assert (mimo.v_head_dim, standard.v_head_dim) == (128, 128) and (mimo.head_dim, standard.head_dim) == (192, 128)
    assert (_rows(mimo.get_value_buffer(0), mimo, 128, loc) == v_m).all()
    assert (_rows(standard.get_value_buffer(0), standard, 128, loc) == v_s).all()
    assert (_rows(mimo.get_key_buffer(0), mimo, 192, loc) == k_m).all()
    assert mimo.get_key_buffer(0).shape[-1] == 192 and standard.get_key_buffer(0).shape[-1] == 128


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_a_pool_that_cannot_hold_the_layer_kinds_is_refused_at_construction(shim, tp):
    with pytest.raises(ValueError) as raised:
        case.build_pool(case.model_config(**case.MIMO), tp=tp)
    message = str(raised.value)
    assert "attention TP %d" % tp in message
    assert "full-attention layers %d KV heads per rank" % (4 // tp) in message
    assert "sliding-window layers %d KV heads per rank" % (8 // tp) in message
    assert "drop --disable-hybrid-swa-memory" in message and "attention TP >= 8" in message


def test_cpu_copies_round_trip_v(shim, ascend_use_fia):
    import torch

    pool = case.build_pool(case.model_config(**case.MIMO), tp=8, layers=2)
    loc = [17, 18, 19, 33]
    k, v = _write(pool, loc)
    copy = pool.get_cpu_copy(torch.tensor(loc))
    assert tuple(copy[0][0][1].shape) == (4, 1, 128)
    assert torch.equal(copy[0][0][1], v) and torch.equal(copy[0][0][0], k)
    target = [50, 51, 52, 60]
    pool.load_cpu_copy(copy, torch.tensor(target))
    assert (_rows(pool.get_value_buffer(0), pool, 128, target) == v).all()
    assert (_rows(pool.get_key_buffer(0), pool, 192, target) == k).all()
    # upstream's methods view V K-wide: a view error where the buffer does not divide into
    # K-wide rows, else other rows than those written
    upstream = type(pool).__dict__["get_cpu_copy"].__wrapped_upstream__
    try:
        wrong = upstream(pool, torch.tensor(loc))[0][0][1]
    except RuntimeError as exc:
        assert "is invalid for input of size" in str(exc)
    else:
        assert wrong.shape[-1] == 192 and not torch.equal(wrong[..., :128], v)


def test_a_standard_pool_takes_upstreams_cpu_copies(shim):
    import torch

    from npu_shim.engine import counters

    before = counters.snapshot().get(CPU_COPY, {}).get("upstream_calls", 0)
    pool = case.build_pool(case.model_config(**case.STANDARD), tp=1)
    loc = [5, 6]
    k, v = _write(pool, loc)
    copy = pool.get_cpu_copy(torch.tensor(loc))
    assert torch.equal(copy[0][0][1], v)
    assert counters.snapshot()[CPU_COPY]["upstream_calls"] == before + 1


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
def test_extend_writes_the_pool_and_matches_the_float64_reference(shim, ascend_use_fia, dtype):
    import torch

    from npu_shim.testing import record_npu_calls

    spec = cp_case.Spec(extend_lens=(5, 9), prefix_lens=(16, 3), page_size=16, num_heads=4, num_kv_heads=1,
                        qk_head_dim=192, v_head_dim=128, dtype=getattr(torch, dtype), seed=3)
    batch = cp_case.make_batch(spec, write_new_tokens=False)
    config = case.model_config(num_attention_heads=4, num_key_value_heads=1, head_dim=192, v_head_dim=128)
    slots = batch.k_cache.shape[0]
    pool = case.build_pool(config, tokens=slots - spec.page_size, page_size=spec.page_size, layers=1,
                           dtype=spec.dtype)
    assert pool.v_head_dim == 128
    case.fill_prefixes(pool, batch)
    backend, layer, forward_batch, q, k, v = case.extend_inputs(batch, pool, ascend_use_fia)
    with record_npu_calls() as calls:
        out = backend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=True)
    ops = [c.name for c in calls]
    if ascend_use_fia:
        assert "npu_fused_infer_attention_score" in ops, ops
    expected = torch.cat([r.reshape(r.shape[0], -1) for r in batch.reference()])
    assert out.shape == expected.shape == (14, 4 * 128)
    err = cp_case.max_abs_err(out, expected)
    print("extend %s use_fia=%s ops=%s max abs err %.2e" % (dtype, ascend_use_fia, sorted(set(ops)), err))
    # the new tokens' V is in the pool, at the slots the batch gave them
    new_slots = batch.new_token_slots()
    stored = pool.get_value_buffer(0).reshape(-1, 1, 128)[new_slots]
    assert torch.equal(stored, v)

