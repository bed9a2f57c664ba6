"""sglang's NPU MHA KV pool built by the release's own builder, for models whose V head dim differs.

Used by test_sglang_npu_mha_v_head_dim.py and benchmarks/bench_kv_bytes_sglang.py. What is real
(the lane's sglang wheel):

* the builder: ``KVCacheConfigurator._build_ascend_mha_kv_pool`` where the release has it, else
  the inline call in ``ModelRunnerKVCacheMixin._init_pools`` (run on a stand-in runner whose
  ``server_args.attention_backend`` is ``"ascend"``, up to the pool's construction: the
  allocator that follows is not under test, and :class:`PoolBuilt` stops the run there);
* ``NPUMHATokenToKVPool`` (made on ``device="cpu"``) and its ``set_kv_buffer``,
  ``get_cpu_copy`` / ``load_cpu_copy``, on npu-shim's emulated torch_npu ops;
* the model config's KV-head arithmetic: ``ModelConfig.get_num_kv_heads``,
  ``get_total_num_kv_heads`` and ``get_swa_num_kv_heads`` of the release, run on a stand-in
  config holding a Hugging Face-style text config (:func:`model_config`).

Not real: the configurator / runner object (a namespace with the attributes the builder reads),
the TP width (stated with ``get_parallel().override`` from 0.5.16, the mixin's
``get_attention_tp_size`` before).
"""
import contextlib
import importlib
from types import SimpleNamespace

import torch

CONFIGURATOR = "sglang.srt.mem_cache.kv_cache_configurator"
MIXIN = "sglang.srt.model_executor.model_runner_kv_cache_mixin"
POOL = "sglang.srt.hardware_backend.npu.memory_pool_npu"

# MiMo-V2-Flash's attention shapes (its config.json): full layers 4 KV heads, SWA layers 8, both
# K 192 / V 128; 64 query heads each.
MIMO = dict(num_attention_heads=64, num_key_value_heads=4, head_dim=192, v_head_dim=128,
            swa_num_attention_heads=64, swa_num_key_value_heads=8, swa_head_dim=192, swa_v_head_dim=128)
STANDARD = dict(num_attention_heads=32, num_key_value_heads=8, head_dim=128)


class PoolBuilt(Exception):
    """Raised by the stand-in runner once ``_init_pools`` has set its ``token_to_kv_pool``."""


def model_config(**text):
    """A stand-in ModelConfig: ``text`` as its ``hf_text_config``; head dims normalised as sglang's
    ModelConfig does (``v_head_dim`` absent -> ``head_dim``); the KV-head methods are the
    release's own."""
    from sglang.srt.configs.model_config import ModelConfig

    class Config:
        get_num_kv_heads = ModelConfig.get_num_kv_heads
        get_total_num_kv_heads = ModelConfig.get_total_num_kv_heads
        get_swa_num_kv_heads = ModelConfig.get_swa_num_kv_heads

    config = Config()
    hf = SimpleNamespace(architectures=["StandIn"], model_type="stand_in", **text)
    config.hf_config = config.hf_text_config = hf
    config.is_draft_model = False
    config.head_dim = text["head_dim"]
    config.v_head_dim = text.get("v_head_dim") or config.head_dim
    config.swa_head_dim = text.get("swa_head_dim", config.head_dim)
    config.swa_v_head_dim = text.get("swa_v_head_dim", config.swa_head_dim)
    config.num_attention_heads = text["num_attention_heads"]
    return config


@contextlib.contextmanager
def attention_tp(tp):
    """The attention TP width the builder reads, stated for this process."""
    configurator = _module(CONFIGURATOR)
    if configurator is not None and hasattr(configurator, "get_parallel"):
        from npu_shim.testing import cp_case

        with cp_case.simulated_rank(tp_size=tp, attn_tp_size=tp, moe_tp_size=tp):
            yield
        return
    mixin = importlib.import_module(MIXIN)
    saved = mixin.get_attention_tp_size
    mixin.get_attention_tp_size = lambda: tp
    try:
        yield
    finally:
        mixin.get_attention_tp_size = saved


def _module(name):
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def builder_kind():
    """"builder" (``_build_ascend_mha_kv_pool``) or "inline" (``_init_pools``)."""
    configurator = _module(CONFIGURATOR)
    if configurator is not None and hasattr(configurator.KVCacheConfigurator, "_build_ascend_mha_kv_pool"):
        return "builder"
    return "inline"


def build_pool(config, *, tp=1, tokens=64, page_size=16, layers=2, dtype=torch.bfloat16):
    """The NPU MHA pool the release's own builder makes for ``config`` at attention TP ``tp``."""
    bind_emulated_ops()
    with attention_tp(tp):
        if builder_kind() == "builder":
            return _from_builder(config, tokens, page_size, layers, dtype)
        return _from_init_pools(config, tokens, page_size, layers, dtype)


def bind_emulated_ops():
    """memory_pool_npu imports torch_npu only where sglang detects an NPU (``if is_npu():``);
    bind the emulated one there, as that import would on the NPU box."""
    import torch_npu

    importlib.import_module(POOL).torch_npu = torch_npu


def _server_args(page_size):
    from npu_shim.testing import cp_case

    args = cp_case.set_cpu_server_args()
    args.page_size, args.attention_backend, args.enable_memory_saver = page_size, "ascend", False
    return args


def _from_builder(config, tokens, page_size, layers, dtype):
    configurator = importlib.import_module(CONFIGURATOR)
    runner = SimpleNamespace(
        model_config=config, pool_page_size=page_size,    # 0.5.16 reads server_args.page_size
        server_args=SimpleNamespace(page_size=page_size, enable_memory_saver=False),
        kv_cache_dtype=dtype, device="cpu",
        layer_info=SimpleNamespace(num_effective_layers=layers, start_layer=0, end_layer=layers))
    return configurator.KVCacheConfigurator._build_ascend_mha_kv_pool(runner, max_total_num_tokens=tokens)


class _Runner(SimpleNamespace):
    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "token_to_kv_pool":
            raise PoolBuilt()


def _from_init_pools(config, tokens, page_size, layers, dtype):
    mixin = importlib.import_module(MIXIN)
    runner = _Runner(
        model_config=config, server_args=_server_args(page_size), page_size=page_size,
        kv_cache_dtype=dtype, device="cpu", max_total_num_tokens=tokens, max_running_requests=4,
        req_to_token_pool=object(), is_draft_worker=True, mambaish_config=None, is_hybrid_swa=False,
        use_mla_backend=False, num_effective_layers=layers, start_layer=0, end_layer=layers,
        enable_hisparse=False)
    runner._validate_prefill_only_disable_kv_cache_pool_family = lambda *a, **k: None
    try:
        mixin.ModelRunnerKVCacheMixin._init_pools(runner)
    except PoolBuilt:
        return runner.token_to_kv_pool
    raise AssertionError("_init_pools returned without building token_to_kv_pool")


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
