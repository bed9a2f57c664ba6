"""Selftest of ``sglang.small_page_fia``: a prefill at page sizes 16, 32 and 64 through the patched forward_extend.

Runs sglang's ``AscendAttnBackend.forward_extend`` (wrapped by the shim) on a
plain prefill of three sequences of uneven length, one with a cached prefix,
GQA (8 query heads over 2 KV heads x 128), in sglang's ``NPUMHATokenToKVPool``
with shuffled pages, ``ASCEND_USE_FIA`` unset, once per page size the qlens op is
reported wrong at (16, 32 and 64: sglang issue #38196, PR #39905, CANN 9.0 on
910C / A3). Each call must go through sglang's FIA prefill branch
(``npu_fused_infer_attention_score``; on an NPU this is what avoids the qlens
op's wrong results at small pages) and match the float64 causal reference; the
row reports the largest error over the page sizes. If a call reached any other
op, the error is reported as infinite. Page size 128 (where the patch keeps
upstream's qlens call) is not run: the emulated qlens op computes what its documentation says, so it
could not show the op's reported defect either.

The backend is made with ``object.__new__`` and given what a plain prefill
reads (its ``__init__`` needs a whole ``ModelRunner``): the model switches as a
default non-MLA model has them, the masks from ``AscendAttnMaskBuilder`` and a
``ForwardMetadata`` holding the block table and the host lengths.
"""
import os
import random
import time

PATCH_NAME = "sglang.small_page_fia"
EXTEND_LENS = (37, 70, 21)
PREFIX_LENS = (0, 19, 4)
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 128
PAGE_SIZES = (16, 32, 64)     # the page sizes sglang PR #39905 found the qlens op wrong at
TOLERANCE = {"float32": 2e-5, "float16": 4e-3}


def _patched_module():
    from npu_shim.patches._shared.structure import replacement_of
    from npu_shim.selftest import applied_target, on_upstream

    module = applied_target(PATCH_NAME)
    # sglang.npu_decode_v_head_dim may wrap this patch's forward_extend (V != K sink prefill)
    if not on_upstream(PATCH_NAME) and replacement_of(module.AscendAttnBackend.__dict__["forward_extend"], PATCH_NAME) is None:
        raise RuntimeError("%s reports applied but forward_extend is not the shim's" % PATCH_NAME)
    if os.environ.get("ASCEND_USE_FIA", "").strip():
        raise RuntimeError("ASCEND_USE_FIA is set: the patch leaves that choice alone; unset it to "
                           "run this selftest")
    return module


def run(device=None):
    results = [run_page(page_size, device) for page_size in PAGE_SIZES]
    worst = max(results, key=lambda r: r["max_abs_err"])
    return dict(worst, seconds=sum(r["seconds"] for r in results),
                max_abs_err=max(r["max_abs_err"] for r in results),
                host_syncs=sum(r["host_syncs"] for r in results),
                detail="; ".join(r["detail"] for r in results))


def run_page(page_size, device=None):
    import importlib

    import numpy as np
    import torch
    from sglang.srt.layers.radix_attention import RadixAttention
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from npu_shim.testing import attention_f64, count_host_syncs, record_npu_calls

    device = device or "cpu"
    module = _patched_module()
    pool_module = importlib.import_module("sglang.srt.hardware_backend.npu.memory_pool_npu")
    dtype = torch.float16  # taken by the real op on every device class that has it (emulation.dtypes)
    gen = torch.Generator().manual_seed(0)
    seq_lens = [p + n for p, n in zip(PREFIX_LENS, EXTEND_LENS)]
    total = sum(EXTEND_LENS)
    q = [torch.randn(n, HEADS, HEAD_DIM, generator=gen) for n in EXTEND_LENS]
    k = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in seq_lens]
    v = [torch.randn(n, KV_HEADS, HEAD_DIM, generator=gen) for n in seq_lens]

    pages = [-(-n // page_size) for n in seq_lens]
    free = list(range(1, sum(pages) + 3))
    random.Random(0).shuffle(free)
    pool = pool_module.NPUMHATokenToKVPool(
        size=len(free) * page_size, page_size=page_size, dtype=dtype, head_num=KV_HEADS,
        head_dim=HEAD_DIM, layer_num=1, device=device, enable_memory_saver=False)
    k_flat = pool.get_key_buffer(0).view(-1, KV_HEADS, HEAD_DIM)
    v_flat = pool.get_value_buffer(0).view(-1, KV_HEADS, HEAD_DIM)
    k_flat.fill_(1e3)
    v_flat.fill_(-1e3)
    block_table = torch.zeros(len(seq_lens), max(pages), dtype=torch.int32)
    for s, n in enumerate(seq_lens):
        owned = [free.pop() for _ in range(pages[s])]
        block_table[s, :len(owned)] = torch.tensor(owned, dtype=torch.int32)
        positions = torch.arange(n)
        where = (torch.tensor(owned)[positions // page_size] * page_size + positions % page_size).to(device)
        k_flat[where], v_flat[where] = k[s].to(device, dtype), v[s].to(device, dtype)

    layer = RadixAttention(num_heads=HEADS, head_dim=HEAD_DIM, scaling=HEAD_DIM ** -0.5,
                           num_kv_heads=KV_HEADS, layer_id=0)
    backend = object.__new__(module.AscendAttnBackend)
    backend.page_size, backend.device = page_size, device
    backend.use_fia = backend.use_mla = backend.use_alibi = backend.use_fa = False
    backend.is_dllm_model = backend.is_hybrid_swa = backend.use_sliding_window_kv_pool = False
    backend.attn_cp_size = 1
    backend.token_to_kv_pool = pool
    backend.mask = module.AscendAttnMaskBuilder.generate_attn_mask(128, "norm", dtype).to(device)
    backend.fia_mask = module.AscendAttnMaskBuilder.generate_mask_flag(2048).to(device)
    backend.forward_metadata = module.ForwardMetadata(
        block_tables=block_table.to(device),
        extend_seq_lens_cpu_int=torch.tensor(EXTEND_LENS, dtype=torch.int32),
        seq_lens_cpu_int=torch.tensor(seq_lens, dtype=torch.int32),
        seq_lens_list_cumsum=np.cumsum(EXTEND_LENS))
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.EXTEND, batch_size=len(EXTEND_LENS),
        input_ids=torch.zeros(total, dtype=torch.int64), req_pool_indices=torch.arange(len(EXTEND_LENS)),
        seq_lens=torch.tensor(seq_lens), out_cache_loc=torch.zeros(total, dtype=torch.int64),
        seq_lens_sum=sum(seq_lens), seq_lens_cpu=torch.tensor(seq_lens),
        extend_seq_lens=torch.tensor(EXTEND_LENS), extend_prefix_lens=torch.tensor(PREFIX_LENS),
        extend_seq_lens_cpu=list(EXTEND_LENS), extend_prefix_lens_cpu=list(PREFIX_LENS))
    forward_batch.num_token_non_padded_cpu = forward_batch.global_num_token_non_padded_cpu = total
    forward_batch.token_to_kv_pool = pool     # 0.5.12's forward_extend reads the pool from the batch
    packed_q = torch.cat(q).reshape(total, -1).to(device, dtype)
    new_k = torch.cat([ks[p:] for ks, p in zip(k, PREFIX_LENS)]).reshape(total, -1).to(device, dtype)
    new_v = torch.cat([vs[p:] for vs, p in zip(v, PREFIX_LENS)]).reshape(total, -1).to(device, dtype)

    started = time.perf_counter()
    with count_host_syncs(device_tensors=[packed_q, new_k, new_v]) as counter, record_npu_calls() as calls:
        out = module.AscendAttnBackend.forward_extend(backend, packed_q, new_k, new_v, layer, forward_batch,
                                                      save_kv_cache=False)
    if device != "cpu":
        torch.npu.synchronize()
    seconds = time.perf_counter() - started
    expected = torch.cat([attention_f64(qs.to(dtype), ks.to(dtype), vs.to(dtype), [0, qs.shape[0]],
                                        [0, ks.shape[0]], scale=layer.scaling, causal=True)
                          .reshape(qs.shape[0], -1) for qs, ks, vs in zip(q, k, v)])
    err = (out.detach().to("cpu", torch.float64) - expected).abs().max().item()
    if [c.name for c in calls] != ["npu_fused_infer_attention_score"]:
        err = float("inf")
    return {
        "max_abs_err": err,
        "tolerance": TOLERANCE[str(dtype).replace("torch.", "")],
        "host_syncs": counter.count,
        "seconds": seconds,
        "detail": "AscendAttnBackend.forward_extend, page size %d (ASCEND_USE_FIA unset) -> %s; %s new "
                  "tokens (prefixes %s), %d heads over %d KV heads x %d, shuffled pages, %s on %s" % (
                      page_size, "+".join(c.name for c in calls) or "no NPU op",
                      "/".join(map(str, EXTEND_LENS)), "/".join(map(str, PREFIX_LENS)), HEADS, KV_HEADS,
                      HEAD_DIM, str(dtype).replace("torch.", ""), device),
    }
