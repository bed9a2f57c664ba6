"""One plain (non-CP) prefill through ``AscendAttnBackend.forward_extend``, from real sglang parts.

Used by test_sglang_small_page_fia.py. Builds on npu_shim/testing/cp_case.py (Spec, random
sequences with cached prefixes in a paged cache with shuffled pages, the
``ReqToTokenPool``, ``RadixAttention``, ``ForwardBatch`` and the real
``init_forward_metadata``), and adds:

* sglang's own NPU KV pool, ``NPUMHATokenToKVPool`` (made on ``device="cpu"``),
  holding the sequences at the slots of the block table; ``forward_extend``
  reads it with ``get_key_buffer`` / ``get_value_buffer``. The new tokens'
  K/V are already in it, so the call runs with ``save_kv_cache=False``: the
  pool's ``set_kv_buffer`` calls an NPU scatter op the emulation does not
  provide, and writing the cache is not what is under test.
* the backend attributes ``forward_extend`` reads on a plain prefill
  (``AscendAttnBackend.__init__`` needs a ModelRunner and an NPU): the
  switches as a default non-MLA model has them (``use_fia`` from
  ``ASCEND_USE_FIA`` as sglang reads it, ``use_mla``, ``use_alibi``,
  ``use_fa``, ``is_dllm_model`` off, ``attn_cp_size`` 1) and the masks from
  ``AscendAttnMaskBuilder`` (``generate_attn_mask(128, "norm")`` for the qlens
  op, ``generate_mask_flag(2048)`` for FIA).
"""
import torch

from npu_shim.testing import cp_case


def make_pool(module_pool, batch):
    """sglang's NPUMHATokenToKVPool on CPU, filled with the batch's paged cache."""
    spec = batch.spec
    if spec.v_head_dim != spec.qk_head_dim:
        raise ValueError("the NPU pool has one head dim up to 0.5.13; use equal K and V head dims")
    slots = batch.k_cache.shape[0]
    pool = module_pool.NPUMHATokenToKVPool(
        size=slots - spec.page_size, page_size=spec.page_size, dtype=spec.dtype,
        head_num=spec.num_kv_heads, head_dim=spec.qk_head_dim, layer_num=1, device="cpu",
        enable_memory_saver=False)
    k_buffer, v_buffer = pool.get_key_buffer(0), pool.get_value_buffer(0)
    k_buffer.view(slots, spec.num_kv_heads, spec.qk_head_dim).copy_(batch.k_cache)
    v_buffer.view(slots, spec.num_kv_heads, spec.v_head_dim).copy_(batch.v_cache)
    return pool


def prefill_inputs(module, module_pool, batch):
    """(backend, layer, forward_batch, q, k, v) for one plain prefill of ``batch``."""
    from sglang.srt.utils import get_bool_env_var

    spec = batch.spec
    forward_batch = cp_case.make_forward_batch(batch, None)
    total = sum(spec.extend_lens)
    forward_batch.num_token_non_padded_cpu = total
    forward_batch.global_num_token_non_padded_cpu = total
    backend = cp_case.make_backend(module, batch, forward_batch)
    backend.use_fia = get_bool_env_var("ASCEND_USE_FIA", "False")
    backend.use_mla = False
    backend.use_alibi = False
    backend.use_fa = False
    backend.is_dllm_model = False
    backend.attn_cp_size = 1
    backend.token_to_kv_pool = make_pool(module_pool, batch)
    forward_batch.token_to_kv_pool = backend.token_to_kv_pool     # 0.5.11-0.5.12 read it here
    backend.mask = module.AscendAttnMaskBuilder.generate_attn_mask(128, "norm", spec.dtype)
    k_new, v_new = batch.packed_new_kv()
    q = batch.packed_q()
    return backend, cp_case.make_layer(spec), forward_batch, q, k_new.reshape(total, -1), v_new.reshape(total, -1)


def expected(batch):
    """The float64 reference for every new token in batch order, (sum L, N * Dv)."""
    return torch.cat([r.reshape(r.shape[0], -1) for r in batch.reference()])
