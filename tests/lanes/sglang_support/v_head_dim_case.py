"""sglang's NPU MHA KV pool built by the release's own builder, for models whose V head dim differs,
and one prefill / decode through ``AscendAttnBackend`` on it.

Used by test_sglang_npu_mha_v_head_dim.py, test_sglang_npu_decode_v_head_dim.py and
benchmarks/bench_kv_bytes_sglang.py. The pool, the stand-in model config and the decode inputs are
:mod:`npu_shim.testing.sglang_kv_pool` (the selftests build theirs there too; that module says what
is real); this module adds the prefill inputs.
"""
import importlib

import torch

from npu_shim.testing.sglang_kv_pool import (  # noqa: F401  (re-exported for the test and the benchmark)
    BACKEND, CONFIGURATOR, MIMO, MIXIN, POOL, STANDARD, append_token, build_pool, build_swa_pool, builder_kind,
    decode_inputs, fill_prefixes, hybrid_swa_attrs, model_config)


def install_shim():
    """The emulation and the shim installed, the modules the patches target imported, sglang's
    server args set for CPU; returns ``npu_shim`` (the test modules' fixture)."""
    import npu_shim

    from sglang_support import shim

    shim.install(POOL, BACKEND, lambda: CONFIGURATOR if builder_kind() == "builder" else MIXIN)
    return npu_shim


# -- one prefill through AscendAttnBackend.forward_extend on the built pool ----------------------

def extend_inputs(batch, pool, use_fia, backend_attrs=None):
    """(backend, layer, forward_batch, q, k, v) for one plain prefill of ``batch`` whose new tokens'
    K/V the call writes into ``pool`` (``save_kv_cache=True``); ``backend_attrs``: as
    :func:`~npu_shim.testing.sglang_kv_pool.decode_inputs`."""
    from npu_shim.testing import cp_case

    module = importlib.import_module(BACKEND)
    spec = batch.spec
    forward_batch = cp_case.make_forward_batch(batch, None)
    total = sum(spec.extend_lens)
    forward_batch.num_token_non_padded_cpu = total
    forward_batch.global_num_token_non_padded_cpu = total
    forward_batch.token_to_kv_pool = pool
    backend = cp_case.make_backend(module, batch, forward_batch, **(backend_attrs or {}))
    backend.use_fia = use_fia
    backend.use_mla = backend.use_alibi = backend.use_fa = backend.is_dllm_model = False
    backend.attn_cp_size = 1
    backend.token_to_kv_pool = pool
    backend.native_attn = module.AscendTorchNativeAttnBackend()
    backend.mask = module.AscendAttnMaskBuilder.generate_attn_mask(128, "norm", spec.dtype)
    k_new, v_new = batch.packed_new_kv()      # (T, Nkv, D) / (T, Nkv, Dv), as RadixAttention passes them
    return backend, cp_case.make_layer(spec), forward_batch, batch.packed_q(), k_new, v_new
