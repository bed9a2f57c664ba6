"""MiMo-V2-Flash-like layers (K 192 / V 128) on sglang's hybrid SWA pool, the default for the model, on
the real sglang wheels.

sglang builds, for the Ascend backend and a hybrid-SWA model, an ``SWAKVPool`` of two
``NPUMHATokenToKVPool`` (full layers, sliding-window layers): ``_build_ascend_swa_kv_pool`` of the
configurator, or the inline branch of ``_init_pools`` in 0.5.14 / 0.5.15. For MiMo
(``is_hybrid_swa_compress``: its architecture in the release's ``MIMO_V2_MODEL_ARCHS``) the builder
passes both sub-pools the V head dim and the SWA one its own KV head count. Built here by the
release's own code (npu_shim.testing.sglang_kv_pool.build_swa_pool), at attention TP 1, for a full
layer (4 KV heads) and a sliding-window layer (8 KV heads, learnable sinks), 8 query heads each:

* both sub-pools hold K 192 and V 128 wide, each with its layer kind's KV head count;
* the sliding-window layer's slots go through the full-to-SWA index mapping (a page permutation
  registered on the pool, as sglang's SWA allocator does; pages of the SWA pool differ from the full
  pool's): ``set_kv_buffer`` of the prefill and of each decode step writes each layer's K and V
  where its sub-pool keeps them;
* the release's ``AscendAttnBackend.forward_extend`` then two ``forward_decode`` steps (the decode
  through ``sglang.npu_decode_v_head_dim``: upstream's FIA v2 TND call, with the SWA block table on
  the sliding layer), eager and graph mode, match the float64 reference (sglang's window: a query at
  position i sees keys i - W .. i; sinks in each head's denominator) in bfloat16 and float16;
* in decode, the sliding layer's pages wholly before the window are evicted as sglang's SWA
  allocator frees them (mapping to the SWA pool's page 0, which holds garbage): the window keeps
  the result exact.

The sliding layer's prefill (sinks) takes upstream's FIA v2 TND call in both modes: with
``ASCEND_USE_FIA=1`` as upstream makes it, and without it (sglang's default) through
``sglang.npu_decode_v_head_dim``'s edit of ``forward_extend``. Upstream without FIA hands the layer
to sgl_kernel_npu's ``attention_sinks_prefill_triton``, which takes K's head dim (192) for V and the
output (its source; see the patch's docstring): silently wrong. The kernel cannot run here; the
import placeholder (tests/placeholders) raises when called, so a prefill that reached it fails the
test: shown by upstream's own ``forward_extend`` reaching it. A V == K layer's prefill is left to
upstream's code (reaching the kernel without FIA, torch.equal with FIA), and the routed prefill makes
the device->host reads upstream's FIA call makes (none), no more.
"""
import importlib

import pytest

pytestmark = [pytest.mark.claimed("sglang.npu_decode_v_head_dim"),
              pytest.mark.patch("sglang.npu_decode_v_head_dim")]

from sglang_support import v_head_dim_case as case  # noqa: E402  (tests/lanes/conftest.py)

from npu_shim.testing import cp_case  # noqa: E402

WINDOW = 6
FULL, SWA = 0, 1          # layer ids: one full-attention layer, one sliding-window layer
HEADS, FULL_KV, SWA_KV = 8, 4, 8
PATCH = "sglang.npu_decode_v_head_dim"
# the two prefill paths (ASCEND_USE_FIA off / on) and the two ways into the decode (eager, graph);
# eager-fia and graph without FIA decode the same way (test_sglang_npu_decode_v_head_dim.py)
MODES = [(False, False), (True, True)]
MODE_IDS = ["eager", "graph-fia"]


@pytest.fixture(scope="module")
def shim():
    return case.install_shim()


def _batches(dtype, seed):
    """The same sequences (slots, pages, request rows) seen by the full layer and the sliding
    layer: one batch per KV head count. Lengths 40 and 21 (prefixes 34 and 12), pages of 16."""
    import torch

    batches = [cp_case.make_batch(cp_case.Spec(
        extend_lens=(6, 9), prefix_lens=(34, 12), page_size=16, num_heads=HEADS, num_kv_heads=kv,
        qk_head_dim=192, v_head_dim=128, dtype=getattr(torch, dtype), seed=seed), write_new_tokens=False)
        for kv in (FULL_KV, SWA_KV)]
    assert all(torch.equal(a, b) for a, b in zip(batches[0].slots, batches[1].slots))
    return batches


def _pool(full, swa):
    """The release's hybrid SWA pool, its full-to-SWA mapping (a page permutation) registered, the
    cached prefixes (and garbage elsewhere) written into both sub-pools."""
    import random

    import torch

    spec = full.spec
    ps, slots = spec.page_size, full.k_cache.shape[0]
    config = case.model_config(num_attention_heads=HEADS, num_key_value_heads=FULL_KV, head_dim=192,
                               v_head_dim=128, swa_num_attention_heads=HEADS, swa_num_key_value_heads=SWA_KV,
                               swa_head_dim=192, swa_v_head_dim=128)
    pool = case.build_swa_pool(config, full_layer_ids=[FULL], swa_layer_ids=[SWA], tokens=slots - ps,
                               swa_tokens=slots - ps, page_size=ps, dtype=spec.dtype)
    assert type(pool).__name__ == "SWAKVPool"
    for layer, kv in ((FULL, FULL_KV), (SWA, SWA_KV)):
        assert tuple(pool.get_key_buffer(layer).reshape(slots, kv, -1).shape[1:]) == (kv, 192)
        assert tuple(pool.get_value_buffer(layer).reshape(slots, kv, -1).shape[1:]) == (kv, 128)
    pages = list(range(1, slots // ps))
    random.Random(5).shuffle(pages)
    page_map = torch.tensor([0] + pages)
    mapping = page_map[torch.arange(slots) // ps] * ps + torch.arange(slots) % ps
    assert not torch.equal(mapping, torch.arange(slots))
    pool.register_mapping(mapping)
    pool.get_key_buffer(FULL).view(slots, FULL_KV, 192).copy_(full.k_cache)
    pool.get_value_buffer(FULL).view(slots, FULL_KV, 128).copy_(full.v_cache)
    pool.get_key_buffer(SWA).view(slots, SWA_KV, 192)[mapping] = swa.k_cache
    pool.get_value_buffer(SWA).view(slots, SWA_KV, 128)[mapping] = swa.v_cache
    return pool


def _layer(kv, layer_id, window):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(num_heads=HEADS, head_dim=192, scaling=192 ** -0.5, num_kv_heads=kv,
                          layer_id=layer_id, v_head_dim=128, sliding_window_size=window)


def _sinks(dtype):
    import torch

    # bfloat16 whatever the model dtype: FIA v2's page takes learnable_sink as bfloat16 only (sglang's
    # gpt-oss makes its sinks bfloat16 on NPU; a float16 sink is refused, tests/lanes/test_mimo_v2_flash.py)
    return (torch.randn(HEADS, generator=torch.Generator().manual_seed(11)) * 2).to(torch.bfloat16)


def _expected(batch, queries, window, sinks):
    """float64 attention of each sequence's last ``queries`` queries over its keys: causal, and with
    ``window`` > -1 keys i - W .. i only; sinks in each head's denominator. (T, N * Dv)."""
    import torch

    from npu_shim.testing import attention_f64

    rows = []
    for q, k, v, n in zip(batch.q, batch.k, batch.v, queries):
        length = k.shape[0]

        def allowed(segment, sq, skv):
            pos = torch.arange(length - sq, length).reshape(sq, 1)
            keys = torch.arange(skv).reshape(1, skv)
            return keys >= pos - window if window > -1 else torch.ones(sq, skv, dtype=torch.bool)

        rows.append(attention_f64(q[-n:], k, v, [0, n], [0, length], scale=192 ** -0.5, causal=True,
                                  allowed=allowed, sinks=sinks).reshape(n, -1))
    return torch.cat(rows)


def _stored(pool, layer, kv, loc, k, v):
    """The step's K and V are where the layer's sub-pool keeps them (the SWA layer: the mapped slots)."""
    slots = pool.get_key_buffer(layer).numel() // (kv * 192)
    if layer == SWA:
        loc = pool.full_to_swa_index_mapping[loc]
    assert (pool.get_key_buffer(layer).reshape(slots, kv, 192)[loc] == k).all()
    assert (pool.get_value_buffer(layer).reshape(slots, kv, 128)[loc] == v).all()


def _evict_outside_window(pool, batch):
    """sglang's SWA allocator frees the pages of the sliding layer wholly before the window
    (full_to_swa mapping -> 0): the SWA pool's page 0 holds garbage."""
    ps = batch.spec.page_size
    for slots in batch.slots:
        first_seen = len(slots) - 1 - WINDOW       # the next decode step's query sees from here on
        for start in range(0, (first_seen // ps) * ps, ps):
            pool.full_to_swa_index_mapping[slots[start:start + ps]] = 0


@pytest.mark.parametrize("dtype", ["bfloat16", "float16"])
@pytest.mark.parametrize("graph_mode,use_fia", MODES, ids=MODE_IDS)
def test_full_and_sliding_layers_on_the_hybrid_swa_pool_match_float64(shim, dtype, graph_mode, use_fia):
    import torch

    from npu_shim.testing import record_npu_calls

    full, swa = _batches(dtype, seed=7)
    pool = _pool(full, swa)
    sinks = _sinks(dtype)
    layers = {FULL: (full, _layer(FULL_KV, FULL, -1), -1, None, FULL_KV),
              SWA: (swa, _layer(SWA_KV, SWA, WINDOW), WINDOW, sinks, SWA_KV)}
    errors = {FULL: [], SWA: []}
    routed = shim.stats()[PATCH].get("sink_prefill_tnd_calls", 0)
    for layer_id, (batch, layer, window, layer_sinks, kv) in layers.items():
        backend, _, forward_batch, q, k, v = case.extend_inputs(
            batch, pool, use_fia, backend_attrs=case.hybrid_swa_attrs(pool, WINDOW))
        with record_npu_calls() as calls:
            out = backend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=True, sinks=layer_sinks)
        if layer_sinks is not None:       # the sink branch: FIA v2 TND, with or without ASCEND_USE_FIA
            (call,) = [c for c in calls if "attention" in c.name]
            assert (call.name, call.kwargs["input_layout"], call.kwargs["sparse_mode"]) == \
                ("npu_fused_infer_attention_score_v2", "TND", 4)
            assert call.kwargs["learnable_sink"] is layer_sinks
            assert torch.equal(call.kwargs["block_table"], backend.forward_metadata.block_tables_swa)
        _stored(pool, layer_id, kv, forward_batch.out_cache_loc, k, v)
        errors[layer_id].append(cp_case.max_abs_err(out, _expected(batch, batch.spec.extend_lens, window,
                                                                   layer_sinks)))
    assert shim.stats()[PATCH].get("sink_prefill_tnd_calls", 0) - routed == (0 if use_fia else 1)
    for step in (1, 2):
        for layer_id, (batch, layer, window, layer_sinks, kv) in layers.items():
            case.append_token(batch, seed=20 + step)
            if layer_id == SWA:
                _evict_outside_window(pool, batch)
            backend, _, forward_batch, q, k, v = case.decode_inputs(
                batch, pool, use_fia=use_fia, graph_mode=graph_mode, layer=layer,
                backend_attrs=case.hybrid_swa_attrs(pool, WINDOW))
            with record_npu_calls() as calls:
                out = type(backend).forward_decode(backend, q, k, v, layer, forward_batch, save_kv_cache=True,
                                                   sinks=layer_sinks)
            (call,) = [c for c in calls if "attention" in c.name]
            assert (call.name, call.kwargs["input_layout"], call.kwargs["sparse_mode"]) == \
                ("npu_fused_infer_attention_score_v2", "TND", 4 if window > -1 else 3)
            assert call.kwargs["learnable_sink"] is layer_sinks
            _stored(pool, layer_id, kv, forward_batch.out_cache_loc, k, v)
            errors[layer_id].append(cp_case.max_abs_err(out, _expected(batch, [1] * batch.spec.bs, window,
                                                                       layer_sinks)))
    assert torch.equal(full.slots[0], swa.slots[0])
    assert len(errors[FULL]) == 3 and len(errors[SWA]) == 3
    print("hybrid SWA pool %s graph=%s fia=%s: full layer (extend, decode, decode) %s; sliding layer (W %d, "
          "sinks) %s" % (dtype, graph_mode, use_fia, ["%.2e" % e for e in errors[FULL]], WINDOW,
                         ["%.2e" % e for e in errors[SWA]]))


def test_the_window_the_sinks_and_the_mapping_count(shim):
    """A reference without the window or the sinks is far from the sliding layer's decode, and so is
    the decode made with the full pool's block table (the mapping not applied): the comparisons above
    can fail."""
    full, swa = _batches("float16", seed=7)
    pool = _pool(full, swa)
    sinks = _sinks("float16")
    layer = _layer(SWA_KV, SWA, WINDOW)
    case.append_token(swa, seed=21)
    backend, _, forward_batch, q, k, v = case.decode_inputs(
        swa, pool, use_fia=True, layer=layer, backend_attrs=case.hybrid_swa_attrs(pool, WINDOW))
    out = type(backend).forward_decode(backend, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=sinks)
    cp_case.max_abs_err(out, _expected(swa, [1, 1], WINDOW, sinks))
    for window, with_sinks in ((-1, sinks), (WINDOW, None)):
        assert (out.double() - _expected(swa, [1, 1], window, with_sinks)).abs().max().item() > 0.05
    backend.forward_metadata.block_tables_swa = backend.forward_metadata.block_tables.to(backend.forward_metadata
                                                                                         .block_tables_swa.dtype)
    unmapped = type(backend).forward_decode(backend, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=sinks)
    assert (unmapped.double() - _expected(swa, [1, 1], WINDOW, sinks)).abs().max().item() > 0.05


@pytest.mark.parametrize("layer_id", [FULL, SWA], ids=["full", "sliding"])
def test_upstream_eager_decode_fails_on_the_hybrid_pool(shim, layer_id):
    """Without ``sglang.npu_decode_v_head_dim`` the eager decode (``ASCEND_USE_FIA=1``) of either
    layer kind makes a call whose documentation does not cover V != K: FIA v1 BSND over the full
    layer's caches (refused for V != K), FIA v2 BSND over the sliding layer's (the page asks key and
    value of the same shape outside TND; the emulation implements v2 in TND only and refuses it).
    Mid-request, as on the plain pool; graph mode with FIA takes upstream's TND call there."""
    full, swa = _batches("bfloat16", seed=7)
    pool = _pool(full, swa)
    batch, kv, window, sinks = ((full, FULL_KV, -1, None) if layer_id == FULL
                                else (swa, SWA_KV, WINDOW, _sinks("bfloat16")))
    case.append_token(batch, seed=21)
    layer = _layer(kv, layer_id, window)
    backend, _, forward_batch, q, k, v = case.decode_inputs(
        batch, pool, use_fia=True, layer=layer, backend_attrs=case.hybrid_swa_attrs(pool, WINDOW))
    upstream = vars(importlib.import_module(case.BACKEND).AscendAttnBackend)["forward_decode"].__wrapped_upstream__
    with pytest.raises(NotImplementedError) as raised:
        upstream(backend, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=sinks)
    print("upstream eager decode, %s layer: %s" % ("full" if layer_id == FULL else "sliding", raised.value))


def _upstream_extend():
    from npu_shim.patches._shared.structure import upstream_of

    return upstream_of(vars(importlib.import_module(case.BACKEND).AscendAttnBackend)["forward_extend"])


def _sliding_prefill(dtype="bfloat16", use_fia=False):
    full, swa = _batches(dtype, seed=7)
    pool = _pool(full, swa)
    backend, _, forward_batch, q, k, v = case.extend_inputs(
        swa, pool, use_fia, backend_attrs=case.hybrid_swa_attrs(pool, WINDOW))
    return swa, pool, backend, forward_batch, q, k, v


def test_upstream_sink_prefill_without_fia_reaches_the_triton_kernel(shim):
    """Upstream's own forward_extend, ASCEND_USE_FIA off (the default), K 192 / V 128 sliding layer
    with sinks: sgl_kernel_npu's attention_sinks_prefill_triton (the placeholder raises where the real
    kernel would return a wrong result)."""
    from sgl_kernel_npu import PlaceholderKernelError

    _, _, backend, forward_batch, q, k, v = _sliding_prefill()
    with pytest.raises(PlaceholderKernelError, match="attention_sinks_prefill_triton"):
        _upstream_extend()(backend, q, k, v, _layer(SWA_KV, SWA, WINDOW), forward_batch, save_kv_cache=True,
                           sinks=_sinks("bfloat16"))


def test_routed_sink_prefill_reads_no_more_than_upstreams_fia_call(shim):
    """The routed prefill (FIA off) and upstream's with ASCEND_USE_FIA=1: the same op call and
    arguments, the same output, the same device->host reads (q, k, v, the pool's buffers, the block
    tables, the sinks and the device lengths standing in for device tensors)."""
    import torch

    from npu_shim.testing import count_host_syncs, record_npu_calls

    outs, reads, ops = [], [], []
    for use_fia, forward in ((False, None), (True, _upstream_extend())):
        _, pool, backend, forward_batch, q, k, v = _sliding_prefill(use_fia=use_fia)
        sinks = _sinks("bfloat16")
        metadata = backend.forward_metadata
        device = [q, k, v, sinks, metadata.block_tables, metadata.block_tables_swa, metadata.seq_lens,
                  metadata.extend_seq_lens, forward_batch.out_cache_loc, forward_batch.seq_lens,
                  backend.fia_mask, pool.full_to_swa_index_mapping]
        device += [pool.get_key_buffer(i) for i in (FULL, SWA)] + [pool.get_value_buffer(i) for i in (FULL, SWA)]
        layer = _layer(SWA_KV, SWA, WINDOW)
        with count_host_syncs(device_tensors=device) as syncs, record_npu_calls() as calls:
            if forward is None:
                out = backend.forward_extend(q, k, v, layer, forward_batch, save_kv_cache=True, sinks=sinks)
            else:
                out = forward(backend, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=sinks)
        outs.append(out)
        reads.append(sorted(e.location for e in syncs.events))
        ops.append([(c.name, c.kwargs.get("input_layout"), c.kwargs.get("sparse_mode")) for c in calls])
    assert torch.equal(outs[0], outs[1])
    assert reads[0] == reads[1], reads
    assert ops[0] == ops[1] and ("npu_fused_infer_attention_score_v2", "TND", 4) in ops[0], ops


def test_v_equal_k_sink_prefill_stays_upstreams(shim):
    """A layer with V == K (128) and sinks: without FIA the patched forward_extend hands it to the triton
    kernel as upstream does (the placeholder raises); with FIA its output is torch.equal to upstream's."""
    import torch

    from sgl_kernel_npu import PlaceholderKernelError

    from npu_shim.testing import cp_case

    spec = cp_case.Spec(extend_lens=(6, 9), prefix_lens=(34, 12), page_size=16, num_heads=HEADS,
                        num_kv_heads=SWA_KV, qk_head_dim=128, v_head_dim=128, dtype=torch.bfloat16, seed=3)
    from sglang.srt.layers.radix_attention import RadixAttention

    layer = RadixAttention(num_heads=HEADS, head_dim=128, scaling=128 ** -0.5, num_kv_heads=SWA_KV,
                           layer_id=0, sliding_window_size=WINDOW)
    sinks = _sinks("bfloat16")
    before = shim.stats()[PATCH].get("sink_prefill_tnd_calls", 0)
    outs = []
    for use_fia in (False, True):
        for forward in (None, _upstream_extend()):
            batch = cp_case.make_batch(spec, write_new_tokens=False)
            config = case.model_config(num_attention_heads=HEADS, num_key_value_heads=SWA_KV, head_dim=128)
            pool = case.build_pool(config, tp=1, tokens=batch.k_cache.shape[0] - 16, page_size=16, layers=1,
                                   dtype=spec.dtype)
            case.fill_prefixes(pool, batch)
            backend, _, forward_batch, q, k, v = case.extend_inputs(batch, pool, use_fia)
            call = forward or type(backend).forward_extend
            if not use_fia:
                with pytest.raises(PlaceholderKernelError, match="attention_sinks_prefill_triton"):
                    call(backend, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=sinks)
            else:
                outs.append(call(backend, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=sinks))
    assert torch.equal(outs[0], outs[1])
    assert shim.stats()[PATCH].get("sink_prefill_tnd_calls", 0) == before
