"""Selftests of ``sglang.npu_mha_v_head_dim`` / ``sglang.npu_mha_v_head_dim_inline`` (the pool gets
the model's V head dim) and ``sglang.npu_kv_cpu_copy_v_head_dim`` (its CPU copies view V with it).

Builds sglang's NPU MHA KV pool through the release's own builder
(``KVCacheConfigurator._build_ascend_mha_kv_pool``, or the inline build in
``ModelRunnerKVCacheMixin._init_pools`` on 0.5.14 / 0.5.15; :mod:`npu_shim.testing.sglang_kv_pool`)
for a K 192 / V 128 model (MiMo-V2-Flash's head dims; 2 KV heads, attention TP 1, 2 layers,
80 token slots in pages of 16, bfloat16: with sglang's padding page the V buffer divides into
K-wide rows, so upstream's K-wide view of V in the CPU copies takes wrong rows silently rather
than failing, which the comparison must catch), then writes random K/V of those widths into both layers
with the pool's ``set_kv_buffer`` at scattered slots (upstream's pool, V K-wide, refuses that
write) and reads them back from the pool's buffers. ``round_trip="cpu_copy"`` also takes the
written slots to the host with ``get_cpu_copy`` and loads them at other slots with
``load_cpu_copy``, and compares both. A copy is exact: the error (max |read - written|) must
be 0.

Reads counted (off an NPU the K/V inputs, the slots and the pool's buffers stand in for device
memory): the builder and ``set_kv_buffer``, none; ``get_cpu_copy`` copies each layer's K
and V rows to the host, one read per tensor and chunk: 2 layers x (K, V) = 4 (one chunk).

``round_trip="decode"`` (``sglang.npu_decode_v_head_dim``): one layer of that pool (8 query
heads over 2 KV heads, K 192 / V 128) holds two sequences of 21 and 12 tokens in shuffled pages
(:func:`npu_shim.testing.cp_case.make_batch`); one decode step of each runs through
``AscendAttnBackend.forward_decode`` (eager, ``ASCEND_USE_FIA`` off, sglang's default), which
writes the step's K/V with ``set_kv_buffer`` and must make upstream's FIA v2 TND call (any other
attention op: the error is reported as infinite) and match the float64 reference
(:func:`npu_shim.testing.attention_f64`; bfloat16, tolerance 3e-2). Reads counted around the
decode call (q, k, v, the pool's buffers, the block table, the slots and the mask as device
tensors): none; the TND lengths come from the host lengths sglang's metadata holds.
"""
import time

PATCHES = {"set_kv_buffer": ("sglang.npu_mha_v_head_dim", "sglang.npu_mha_v_head_dim_inline"),
           "cpu_copy": ("sglang.npu_kv_cpu_copy_v_head_dim",),
           "decode": ("sglang.npu_decode_v_head_dim",)}
DECODE_TOLERANCE = 3e-2       # bfloat16, N(0, 1) inputs (npu_shim.testing.cp_case.tolerance)
CONFIG = dict(num_attention_heads=8, num_key_value_heads=2, head_dim=192, v_head_dim=128)
LAYERS, TOKENS, PAGE_SIZE = 2, 80, 16
BUILT_BY = {"builder": "KVCacheConfigurator._build_ascend_mha_kv_pool",
            "inline": "ModelRunnerKVCacheMixin._init_pools"}
WRITTEN, LOADED = (3, 17, 18, 40), (50, 9, 33, 34)      # slots set_kv_buffer writes / load_cpu_copy fills


def _builder(round_trip, patch):
    """The builder patch the pool is built by: ``patch`` itself, or for the CPU copies the one of
    the two that applies to the installed release (0.5.16 on the builder's, below the inline one)."""
    from npu_shim import status
    from npu_shim.selftest import applied_target

    applied_target(patch)           # raises, naming the state, where ``patch`` is not applied
    if round_trip == "set_kv_buffer":
        return patch
    rows = {r["name"]: r for r in status()}
    builders = [name for name in PATCHES["set_kv_buffer"] if rows[name]["state"] == "applied"]
    if not builders:
        raise RuntimeError("%s: neither %s is applied here, and a pool whose V is narrower than K needs one"
                           % (patch, " nor ".join(PATCHES["set_kv_buffer"])))
    return builders[0]


def _device_buffers(pool):
    """The pool's tensors (its K/V buffers: a list per layer, or one tensor whose rows are the
    layers, as the release keeps them), to stand in for device memory in the count on CPU."""
    import torch

    found = []
    for value in vars(pool).values():
        items = value if isinstance(value, (list, tuple)) else [value]
        found += [t for t in items if isinstance(t, torch.Tensor)]
    return found


def _layer(pool, layer_id):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(num_heads=CONFIG["num_attention_heads"], head_dim=pool.head_dim,
                          scaling=pool.head_dim ** -0.5, num_kv_heads=pool.head_num, layer_id=layer_id,
                          v_head_dim=CONFIG["v_head_dim"])


def _rows(buffer, pool, width, slots):
    return buffer.reshape(-1, pool.head_num, width)[slots]


def _error(read, written):
    import torch

    if tuple(read.shape) != tuple(written.shape):
        raise RuntimeError("read back %s, wrote %s" % (tuple(read.shape), tuple(written.shape)))
    return (read.to("cpu", torch.float64) - written.to("cpu", torch.float64)).abs().max().item()


def run(device=None, round_trip="set_kv_buffer", patch=None):
    from npu_shim.selftest import on_upstream

    import torch

    from npu_shim.engine import counters
    from npu_shim.testing import count_host_syncs
    from npu_shim.testing import sglang_kv_pool as kv_pool

    if round_trip not in PATCHES:
        raise ValueError("round_trip must be one of %s, not %r" % (sorted(PATCHES), round_trip))
    device = device or "cpu"
    builder = _builder(round_trip, patch)
    if round_trip == "decode":
        return _decode(device, builder, patch)
    dtype = torch.bfloat16
    gen = torch.Generator().manual_seed(0)
    heads = CONFIG["num_key_value_heads"]
    written = [(torch.randn(len(WRITTEN), heads, CONFIG["head_dim"], generator=gen).to(device, dtype),
                torch.randn(len(WRITTEN), heads, CONFIG["v_head_dim"], generator=gen).to(device, dtype))
               for _ in range(LAYERS)]
    slots = torch.tensor(WRITTEN, device=device)
    targets = torch.tensor(LOADED, device=device)
    calls = {name: counters.snapshot().get(name, {}).get("calls", 0) for name in (builder, patch)}

    started = time.perf_counter()
    with count_host_syncs(device_tensors=[slots, targets] + [t for kv in written for t in kv]) as syncs:
        pool = kv_pool.build_pool(kv_pool.model_config(**CONFIG), tp=1, tokens=TOKENS, page_size=PAGE_SIZE,
                                  layers=LAYERS, dtype=dtype, device=device)
        syncs.mark_device(*_device_buffers(pool))
        for layer_id, (k, v) in enumerate(written):
            pool.set_kv_buffer(_layer(pool, layer_id), slots, k, v)
        if round_trip == "cpu_copy":
            with kv_pool.npu_device_module():
                copy = pool.get_cpu_copy(slots)
                pool.load_cpu_copy(copy, targets)
    if device != "cpu":
        torch.npu.synchronize()
    seconds = time.perf_counter() - started

    if (pool.head_dim, pool.v_head_dim) != (CONFIG["head_dim"], CONFIG["v_head_dim"]):
        raise RuntimeError("the pool was built with K %d / V %d, the model's are K %d / V %d"
                           % (pool.head_dim, pool.v_head_dim, CONFIG["head_dim"], CONFIG["v_head_dim"]))
    now = counters.snapshot()
    for name in {builder, patch} - {off for off in (builder, patch) if on_upstream(off)}:
        if now.get(name, {}).get("calls", 0) <= calls[name]:
            raise RuntimeError("%s did not run (its calls counter stayed at %d)" % (name, calls[name]))
    errors = []
    for layer_id, (k, v) in enumerate(written):
        buffers = (pool.get_key_buffer(layer_id), pool.get_value_buffer(layer_id))
        errors += [_error(_rows(buffers[0], pool, pool.head_dim, slots), k),
                   _error(_rows(buffers[1], pool, pool.v_head_dim, slots), v)]
        if round_trip == "cpu_copy":
            host_k, host_v = copy[layer_id][0]
            errors += [_error(host_k, k), _error(host_v, v),
                       _error(_rows(buffers[0], pool, pool.head_dim, targets), k),
                       _error(_rows(buffers[1], pool, pool.v_head_dim, targets), v)]
    return {
        "max_abs_err": max(errors),
        "tolerance": 0.0,
        "host_syncs": syncs.count,
        "seconds": seconds,
        "detail": "NPUMHATokenToKVPool built by %s (%s), K %d / V %d, %d KV heads, %d layers, bfloat16 on %s: "
                  "set_kv_buffer at slots %s read back%s; error 0 expected (copies)" % (
                      BUILT_BY[kv_pool.builder_kind()], builder, pool.head_dim, pool.v_head_dim, heads, LAYERS, device,
                      list(WRITTEN), ", get_cpu_copy -> load_cpu_copy at slots %s" % list(LOADED)
                      if round_trip == "cpu_copy" else ""),
    }


def _decode(device, builder, patch):
    from npu_shim.selftest import on_upstream

    import torch

    from npu_shim.engine import counters
    from npu_shim.testing import attention_f64, count_host_syncs, cp_case, record_npu_calls
    from npu_shim.testing import sglang_kv_pool as kv_pool

    spec = cp_case.Spec(extend_lens=(5, 9), prefix_lens=(16, 3), page_size=PAGE_SIZE,
                        num_heads=CONFIG["num_attention_heads"], num_kv_heads=CONFIG["num_key_value_heads"],
                        qk_head_dim=CONFIG["head_dim"], v_head_dim=CONFIG["v_head_dim"], dtype=torch.bfloat16,
                        seed=0)
    calls_before = {name: counters.snapshot().get(name, {}).get("calls", 0) for name in (builder, patch)}
    batch = cp_case.make_batch(spec, write_new_tokens=True)
    pool = kv_pool.build_pool(kv_pool.model_config(**CONFIG), tp=1, tokens=batch.k_cache.shape[0] - PAGE_SIZE,
                              page_size=PAGE_SIZE, layers=1, dtype=spec.dtype, device=device)
    kv_pool.fill_prefixes(pool, batch)
    kv_pool.append_token(batch, seed=1)
    backend, layer, forward_batch, q, k, v = kv_pool.decode_inputs(batch, pool, use_fia=False)
    backend.device = device
    backend.fia_mask = backend.fia_mask.to(device)
    metadata = backend.forward_metadata
    metadata.block_tables = metadata.block_tables.to(device)
    forward_batch.out_cache_loc = forward_batch.out_cache_loc.to(device)
    forward_batch.seq_lens = forward_batch.seq_lens.to(device)
    q, k, v = q.to(device), k.to(device), v.to(device)

    started = time.perf_counter()
    with count_host_syncs(device_tensors=[q, k, v, metadata.block_tables, forward_batch.out_cache_loc,
                                          forward_batch.seq_lens, backend.fia_mask] + _device_buffers(pool)) \
            as syncs, record_npu_calls() as calls:
        out = type(backend).forward_decode(backend, q, k, v, layer, forward_batch, save_kv_cache=True)
    if device != "cpu":
        torch.npu.synchronize()
    seconds = time.perf_counter() - started

    now = counters.snapshot()
    for name in {builder, patch} - {off for off in (builder, patch) if on_upstream(off)}:
        if now.get(name, {}).get("calls", 0) <= calls_before[name]:
            raise RuntimeError("%s did not run (its calls counter stayed at %d)" % (name, calls_before[name]))
    expected = torch.cat([attention_f64(qs[-1:], ks, vs, [0, 1], [0, ks.shape[0]], scale=layer.scaling)
                          .reshape(1, -1) for qs, ks, vs in zip(batch.q, batch.k, batch.v)])
    err = (out.detach().to("cpu", torch.float64) - expected).abs().max().item()
    ops = [(c.name, c.kwargs.get("input_layout")) for c in calls if "attention" in c.name]
    if ops != [("npu_fused_infer_attention_score_v2", "TND")]:
        err = float("inf")
    return {
        "max_abs_err": err,
        "tolerance": DECODE_TOLERANCE,
        "host_syncs": syncs.count,
        "seconds": seconds,
        "detail": "AscendAttnBackend.forward_decode (eager, ASCEND_USE_FIA off) of a K %d / V %d layer, %d query "
                  "heads over %d KV heads, sequences of %s tokens in pages of %d, bfloat16 on %s, pool built by "
                  "%s -> %s" % (pool.head_dim, pool.v_head_dim, spec.num_heads, spec.num_kv_heads,
                                [len(s) for s in batch.slots], PAGE_SIZE, device, builder,
                                ", ".join("%s %s" % op for op in ops) or "no attention op"),
    }
