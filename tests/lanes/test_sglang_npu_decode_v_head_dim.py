"""Patch ``sglang.npu_decode_v_head_dim`` on the real sglang wheels: decode of an MHA layer whose V head
dim differs from K's (K 192 / V 128, MiMo-V2-Flash's) through ``AscendAttnBackend``.

The pool is the release's own NPU MHA pool, built by its own builder with the model's V width
(``sglang.npu_mha_v_head_dim`` / ``_inline``; tests/lanes/sglang_support/v_head_dim_case.py); the
backend's ``forward_extend`` / ``forward_decode`` are the release's, on the emulated ops:

* upstream (the release's ``forward_decode``): the first decode step fails, eager with
  ``ASCEND_USE_FIA=1`` (FIA BSND over caches of different widths) and without it (ATB
  ``_npu_paged_attention``): the emulation refuses both calls, as their documentation does not
  cover V != K there (mid-request);
* patched: an extend, then two decode steps (each writing its token through ``set_kv_buffer``),
  for a full-attention layer and for a sliding-window layer with sinks, eager and graph mode,
  with and without ``ASCEND_USE_FIA``: every decode makes upstream's FIA v2 TND call, and each
  step matches the float64 reference (npu_shim.testing.attention_f64; sglang's window: a query
  at position i sees keys i - W .. i) in bfloat16 and float16;
* a layer with V == K runs upstream's ``forward_decode``: counted, and its output and op calls
  equal to the release's own function's.
"""
import importlib

import pytest

pytestmark = [pytest.mark.claimed("sglang.npu_decode_v_head_dim"),
              pytest.mark.patch("sglang.npu_decode_v_head_dim", "sglang.npu_mha_v_head_dim",
                                "sglang.npu_mha_v_head_dim_inline")]

from sglang_support import v_head_dim_case as case  # noqa: E402  (tests/lanes/conftest.py)

from npu_shim.testing import cp_case  # noqa: E402

PATCH = "sglang.npu_decode_v_head_dim"
WINDOW = 6        # sliding_window_size of the sliding layer: fewer keys than the shortest sequence
MODES = [(False, False), (False, True), (True, False), (True, True)]
MODE_IDS = ["eager", "eager-fia", "graph", "graph-fia"]


@pytest.fixture(scope="module")
def shim():
    return case.install_shim()


def _spec(dtype, v_head_dim=128, qk_head_dim=192, seed=3):
    import torch

    # sequences of 21 and 12 tokens in pages of 16: room for two more tokens in each last page
    return cp_case.Spec(extend_lens=(5, 9), prefix_lens=(16, 3), page_size=16, num_heads=4, num_kv_heads=1,
                        qk_head_dim=qk_head_dim, v_head_dim=v_head_dim, dtype=getattr(torch, dtype), seed=seed)


def _pool(batch):
    spec = batch.spec
    config = case.model_config(num_attention_heads=spec.num_heads, num_key_value_heads=spec.num_kv_heads,
                               head_dim=spec.qk_head_dim, v_head_dim=spec.v_head_dim)
    pool = case.build_pool(config, tokens=batch.k_cache.shape[0] - spec.page_size, page_size=spec.page_size,
                           layers=1, dtype=spec.dtype)
    assert (pool.head_dim, pool.v_head_dim) == (spec.qk_head_dim, spec.v_head_dim)
    case.fill_prefixes(pool, batch)
    return pool


def _layer(spec, window):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(num_heads=spec.num_heads, head_dim=spec.qk_head_dim, scaling=spec.qk_head_dim ** -0.5,
                          num_kv_heads=spec.num_kv_heads, layer_id=0, v_head_dim=spec.v_head_dim,
                          sliding_window_size=window)


def _sinks(spec):
    import torch

    # bfloat16 whatever the model dtype: FIA v2's page takes learnable_sink as bfloat16 only (sglang's
    # gpt-oss makes its sinks bfloat16 on NPU; a float16 sink is refused, tests/lanes/test_mimo_v2_flash.py)
    return (torch.randn(spec.num_heads, generator=torch.Generator().manual_seed(11)) * 2).to(torch.bfloat16)


def _decode_expected(batch, window, sinks):
    """float64 attention of each sequence's last query over all its keys (sglang's window: keys
    i - W .. i), sinks in each head's denominator: (bs, N * Dv)."""
    import torch

    from npu_shim.testing import attention_f64

    rows = []
    for q, k, v in zip(batch.q, batch.k, batch.v):
        length = k.shape[0]

        def allowed(segment, sq, skv):
            keys = torch.arange(skv)
            return (keys >= length - 1 - window).reshape(1, skv) if window > -1 else torch.ones(1, skv, dtype=torch.bool)

        rows.append(attention_f64(q[-1:], k, v, [0, 1], [0, length], scale=batch.spec.qk_head_dim ** -0.5,
                                  allowed=allowed, sinks=sinks).reshape(1, -1))
    return torch.cat(rows)


def _decode(batch, pool, layer, use_fia, graph_mode, sinks, method=None):
    from npu_shim.testing import record_npu_calls

    backend, layer, forward_batch, q, k, v = case.decode_inputs(batch, pool, use_fia=use_fia,
                                                                graph_mode=graph_mode, layer=layer)
    method = method or type(backend).forward_decode
    with record_npu_calls() as calls:
        out = method(backend, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=sinks)
    stored = pool.get_value_buffer(0).reshape(-1, batch.spec.num_kv_heads, batch.spec.v_head_dim)
    assert (stored[forward_batch.out_cache_loc] == v).all()        # the step's V is in the pool
    return out, calls


def test_applies_on_this_release(shim):
    rows = {r["name"]: r for r in shim.status()}
    assert rows[PATCH]["state"] == "applied", rows[PATCH]


@pytest.mark.parametrize("use_fia", [False, True], ids=["paged-attention", "fia"])
def test_upstream_decode_fails_at_the_first_step(shim, use_fia):
    import torch

    batch = cp_case.make_batch(_spec("bfloat16"), write_new_tokens=True)
    pool = _pool(batch)
    case.append_token(batch, seed=1)
    module = importlib.import_module(case.BACKEND)
    upstream = vars(module.AscendAttnBackend)["forward_decode"].__wrapped_upstream__
    with pytest.raises(NotImplementedError) as raised:
        _decode(batch, pool, _layer(batch.spec, -1), use_fia, False, None, method=upstream)
    print("upstream decode (ASCEND_USE_FIA=%d): %s" % (use_fia, raised.value))
    assert ("value head dim" in str(raised.value)) and torch.is_tensor(pool.get_value_buffer(0))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("graph_mode,use_fia", MODES, ids=MODE_IDS)
def test_extend_then_decode_of_a_full_layer_matches_float64(shim, dtype, graph_mode, use_fia):
    import torch

    from npu_shim.engine import counters

    batch = cp_case.make_batch(_spec(dtype), write_new_tokens=False)
    pool = _pool(batch)
    backend, layer, forward_batch, q, k, v = case.extend_inputs(batch, pool, use_fia)
    out = backend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=True)
    expected = torch.cat([r.reshape(r.shape[0], -1) for r in batch.reference()])
    errors = [cp_case.max_abs_err(out, expected)]
    before = counters.snapshot().get(PATCH, {})
    for step in (1, 2):
        case.append_token(batch, seed=step)
        out, calls = _decode(batch, pool, None, use_fia, graph_mode, None)
        assert [(c.name, c.kwargs.get("input_layout")) for c in calls
                if "attention" in c.name] == [("npu_fused_infer_attention_score_v2", "TND")], calls
        errors.append(cp_case.max_abs_err(out, _decode_expected(batch, -1, None)))
    after = counters.snapshot()[PATCH]
    assert after["tnd_calls"] == before.get("tnd_calls", 0) + 2
    print("full layer %s graph=%s fia=%s: extend, decode, decode max abs err %s"
          % (dtype, graph_mode, use_fia, ["%.2e" % e for e in errors]))


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("graph_mode,use_fia", MODES, ids=MODE_IDS)
def test_decode_of_a_sliding_layer_with_sinks_matches_float64(shim, dtype, graph_mode, use_fia):
    batch = cp_case.make_batch(_spec(dtype, seed=4), write_new_tokens=True)
    pool = _pool(batch)
    layer = _layer(batch.spec, WINDOW)
    sinks = _sinks(batch.spec)
    errors = []
    for step in (1, 2):
        case.append_token(batch, seed=10 + step)
        out, calls = _decode(batch, pool, layer, use_fia, graph_mode, sinks)
        (call,) = [c for c in calls if "attention" in c.name]
        assert (call.name, call.kwargs["input_layout"], call.kwargs["sparse_mode"]) == \
            ("npu_fused_infer_attention_score_v2", "TND", 4)
        assert call.kwargs["learnable_sink"] is sinks
        errors.append(cp_case.max_abs_err(out, _decode_expected(batch, WINDOW, sinks)))
    print("sliding layer (W %d, sinks) %s graph=%s fia=%s: decode max abs err %s"
          % (WINDOW, dtype, graph_mode, use_fia, ["%.2e" % e for e in errors]))


def test_the_window_and_the_sinks_count(shim):
    """The reference that ignores the window or the sinks is far from what the decode gives: the
    comparisons above can fail."""
    batch = cp_case.make_batch(_spec("float16", seed=4), write_new_tokens=True)
    pool = _pool(batch)
    sinks = _sinks(batch.spec)
    case.append_token(batch, seed=11)
    out, _ = _decode(batch, pool, _layer(batch.spec, WINDOW), True, False, sinks)
    for window, with_sinks in ((-1, sinks), (WINDOW, None)):
        wrong = _decode_expected(batch, window, with_sinks)
        assert (out.double() - wrong).abs().max().item() > 0.05


@pytest.mark.parametrize("use_fia", [False, True], ids=["paged-attention", "fia"])
def test_a_layer_with_v_equal_to_k_takes_upstreams_decode(shim, use_fia):
    import torch

    from npu_shim.engine import counters

    batch = cp_case.make_batch(_spec("bfloat16", v_head_dim=128, qk_head_dim=128, seed=6), write_new_tokens=True)
    pool = _pool(batch)
    case.append_token(batch, seed=1)
    module = importlib.import_module(case.BACKEND)
    upstream = vars(module.AscendAttnBackend)["forward_decode"].__wrapped_upstream__
    before = dict(counters.snapshot().get(PATCH, {}))
    out, calls = _decode(batch, pool, None, use_fia, False, None)
    after = counters.snapshot()[PATCH]
    assert after.get("upstream_calls", 0) == before.get("upstream_calls", 0) + 1
    assert after.get("calls", 0) == before.get("calls", 0)
    again, upstream_calls = _decode(batch, pool, None, use_fia, False, None, method=upstream)
    assert torch.equal(out, again)
    assert [(c.name, sorted(c.kwargs)) for c in calls] == [(c.name, sorted(c.kwargs)) for c in upstream_calls]
    assert [c.name for c in calls if "attention" in c.name] == \
        (["npu_fused_infer_attention_score"] if use_fia else ["_npu_paged_attention"])
    cp_case.max_abs_err(out, _decode_expected(batch, -1, None))
