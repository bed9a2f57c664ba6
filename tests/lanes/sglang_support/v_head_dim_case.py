"""sglang's NPU MHA KV pool built by the release's own builder, for models whose V head dim differs,
and one prefill / decode through ``AscendAttnBackend`` on it.

Used by test_sglang_npu_mha_v_head_dim.py and benchmarks/bench_kv_bytes_sglang.py. The pool and the
stand-in model config are :mod:`npu_shim.testing.sglang_kv_pool` (the selftests build theirs there
too; that module says what is real); this module adds the backend inputs.
"""
import importlib

import torch

from npu_shim.testing.sglang_kv_pool import (  # noqa: F401  (re-exported for the test and the benchmark)
    CONFIGURATOR, MIMO, MIXIN, POOL, STANDARD, build_pool, builder_kind, model_config)


# -- one prefill through AscendAttnBackend.forward_extend on the built pool ----------------------

BACKEND = "sglang.srt.hardware_backend.npu.attention.ascend_backend"


def fill_prefixes(pool, batch):
    """The batch's cached prefixes (and garbage in the slots nobody owns, and in the new tokens'
    slots, which ``set_kv_buffer`` must overwrite) in layer 0 of ``pool``."""
    spec = batch.spec
    slots = batch.k_cache.shape[0]
    pool.get_key_buffer(0).view(slots, spec.num_kv_heads, spec.qk_head_dim).copy_(batch.k_cache)
    pool.get_value_buffer(0).view(slots, spec.num_kv_heads, spec.v_head_dim).copy_(batch.v_cache)


def extend_inputs(batch, pool, use_fia):
    """(backend, layer, forward_batch, q, k, v) for one plain prefill of ``batch`` whose new tokens'
    K/V the call writes into ``pool`` (``save_kv_cache=True``)."""
    from npu_shim.testing import cp_case

    module = importlib.import_module(BACKEND)
    spec = batch.spec
    forward_batch = cp_case.make_forward_batch(batch, None)
    total = sum(spec.extend_lens)
    forward_batch.num_token_non_padded_cpu = total
    forward_batch.global_num_token_non_padded_cpu = total
    forward_batch.token_to_kv_pool = pool
    backend = cp_case.make_backend(module, batch, forward_batch)
    backend.use_fia = use_fia
    backend.use_mla = backend.use_alibi = backend.use_fa = backend.is_dllm_model = False
    backend.attn_cp_size = 1
    backend.token_to_kv_pool = pool
    backend.native_attn = module.AscendTorchNativeAttnBackend()
    backend.mask = module.AscendAttnMaskBuilder.generate_attn_mask(128, "norm", spec.dtype)
    k_new, v_new = batch.packed_new_kv()      # (T, Nkv, D) / (T, Nkv, Dv), as RadixAttention passes them
    return backend, cp_case.make_layer(spec), forward_batch, batch.packed_q(), k_new, v_new


def decode_inputs(batch, pool):
    """(backend, layer, forward_batch, q, k, v) for one decode step after ``batch`` (every
    sequence's last token is the one decoded: its K/V go through ``set_kv_buffer``)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from npu_shim.testing import cp_case

    module = importlib.import_module(BACKEND)
    spec = batch.spec
    last = torch.stack([slots[-1] for slots in batch.slots])
    extra = {}
    import dataclasses

    if "req_to_token_pool" in {f.name for f in dataclasses.fields(ForwardBatch)}:
        extra["req_to_token_pool"] = batch.req_to_token_pool
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=spec.bs,
        input_ids=torch.zeros(spec.bs, dtype=torch.int64), req_pool_indices=batch.req_pool_indices,
        seq_lens=torch.tensor(spec.seq_lens, dtype=torch.int64), out_cache_loc=last,
        seq_lens_sum=sum(spec.seq_lens), seq_lens_cpu=torch.tensor(spec.seq_lens, dtype=torch.int64),
        **extra)
    forward_batch.token_to_kv_pool = pool
    backend = cp_case.make_backend(module, batch, forward_batch)
    backend.use_fia = True
    backend.use_mla = backend.use_alibi = backend.use_fa = backend.is_dllm_model = False
    backend.attn_cp_size = 1
    backend.token_to_kv_pool = pool
    q = torch.stack([q[-1] for q in batch.q]).reshape(spec.bs, -1)
    k = torch.stack([k[-1] for k in batch.k])
    v = torch.stack([v[-1] for v in batch.v])
    return backend, cp_case.make_layer(spec), forward_batch, q, k, v
