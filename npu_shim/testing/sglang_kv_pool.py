"""sglang's NPU MHA KV pool built by the release's own builder, for models whose V head dim differs.

Shared by the selftests of ``sglang.npu_mha_v_head_dim`` / ``_inline`` /
``sglang.npu_kv_cpu_copy_v_head_dim`` / ``sglang.npu_decode_v_head_dim``
(npu_shim/selftest/sglang_v_head_dim.py), their lane tests (the hybrid SWA pool's:
tests/lanes/test_sglang_npu_hybrid_swa_v_head_dim.py) and the KV-bytes benchmark. What is
real (the installed sglang):

* the builder: ``KVCacheConfigurator._build_ascend_mha_kv_pool`` where the release has it, else
  the inline call in ``ModelRunnerKVCacheMixin._init_pools`` (run on a stand-in runner whose
  ``server_args.attention_backend`` is ``"ascend"``, up to the pool's construction: the
  allocator that follows is not under test, and :class:`PoolBuilt` stops the run there);
* ``NPUMHATokenToKVPool`` (made on the device asked for: ``"cpu"`` on the emulation) and its
  ``set_kv_buffer``, ``get_cpu_copy`` / ``load_cpu_copy``;
* the hybrid SWA pool (:func:`build_swa_pool`): ``KVCacheConfigurator._build_ascend_swa_kv_pool``
  where the release has it, else the hybrid branch of ``_init_pools``, its ``SWAKVPool`` of two NPU
  MHA pools, ``is_hybrid_swa_compress`` decided by the release's ``MIMO_V2_MODEL_ARCHS``; the
  full-to-SWA index mapping is the caller's (sglang's SWA allocator makes it), and
  :func:`hybrid_swa_attrs` gives the backend what its ``__init__`` reads off a hybrid runner;
* the model config's KV-head arithmetic: ``ModelConfig.get_num_kv_heads``,
  ``get_total_num_kv_heads`` and ``get_swa_num_kv_heads`` of the release, run on a stand-in
  config holding a Hugging Face-style text config (:func:`model_config`);
* for a decode step on the pool (:func:`decode_inputs`, :func:`append_token`):
  ``AscendAttnBackend.forward_decode`` / ``forward_decode_graph`` and its
  ``init_forward_metadata``, a real ``ForwardBatch`` and ``ReqToTokenPool``
  (:mod:`npu_shim.testing.cp_case` makes the batch; the backend is made without its
  ``__init__``, which needs a whole ``ModelRunner``, and given what the decode reads).

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
BACKEND = "sglang.srt.hardware_backend.npu.attention.ascend_backend"

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


def build_pool(config, *, tp=1, tokens=64, page_size=16, layers=2, dtype=torch.bfloat16, device="cpu"):
    """The NPU MHA pool the release's own builder makes for ``config`` at attention TP ``tp``
    (sglang's server args published first: the builder reads them from 0.5.19, ``get_exec()``)."""
    bind_torch_npu()
    with attention_tp(tp):
        if builder_kind() == "builder":
            from npu_shim.testing import cp_case

            cp_case.set_cpu_server_args()
            return _from_builder(config, tokens, page_size, layers, dtype, device)
        return _from_init_pools(config, tokens, page_size, layers, dtype, device)


def bind_torch_npu():
    """memory_pool_npu imports torch_npu only where sglang detects an NPU (``if is_npu():``);
    bind the importable one there (off an NPU, the emulation), as that import would on the NPU box."""
    import torch_npu

    importlib.import_module(POOL).torch_npu = torch_npu


@contextlib.contextmanager
def npu_device_module():
    """``torch.npu`` for the duration, where it is absent: the pool's CPU copies call
    ``torch.npu.synchronize()``, and the emulation does not create ``torch.npu`` (see
    :func:`npu_shim.emulation.register_device_module` for why); the emulated ``torch_npu.npu``
    stands in. Where ``torch.npu`` exists (a real torch_npu) nothing changes."""
    if hasattr(torch, "npu"):
        yield
        return
    from npu_shim import emulation

    if not emulation.is_emulated():
        raise RuntimeError("torch.npu is absent and torch_npu is not the emulation")
    import torch_npu

    torch.npu = torch_npu.npu
    try:
        yield
    finally:
        del torch.npu


def _server_args(page_size, device):
    from npu_shim.testing import cp_case

    args = cp_case.set_cpu_server_args()
    args.page_size, args.attention_backend, args.enable_memory_saver = page_size, "ascend", False
    args.device = device
    return args


def _from_builder(config, tokens, page_size, layers, dtype, device):
    configurator = importlib.import_module(CONFIGURATOR)
    runner = SimpleNamespace(
        model_config=config, pool_page_size=page_size,    # 0.5.16 reads server_args.page_size
        server_args=SimpleNamespace(page_size=page_size, enable_memory_saver=False),
        kv_cache_dtype=dtype, device=device,
        layer_info=SimpleNamespace(num_effective_layers=layers, start_layer=0, end_layer=layers))
    return configurator.KVCacheConfigurator._build_ascend_mha_kv_pool(runner, max_total_num_tokens=tokens)


class _Runner(SimpleNamespace):
    def __setattr__(self, name, value):
        super().__setattr__(name, value)
        if name == "token_to_kv_pool":
            raise PoolBuilt()


def _from_init_pools(config, tokens, page_size, layers, dtype, device, **runner_fields):
    """The pool the release's inline ``_init_pools`` builds on a stand-in runner; ``runner_fields``
    add to or override its fields (the hybrid SWA branch's)."""
    mixin = importlib.import_module(MIXIN)
    fields = dict(
        model_config=config, server_args=_server_args(page_size, device), page_size=page_size,
        kv_cache_dtype=dtype, device=device, max_total_num_tokens=tokens, max_running_requests=4,
        req_to_token_pool=object(), is_draft_worker=True, mambaish_config=None, is_hybrid_swa=False,
        use_mla_backend=False, num_effective_layers=layers, start_layer=0, end_layer=layers,
        enable_hisparse=False)
    fields.update(runner_fields)
    runner = _Runner(**fields)
    runner._validate_prefill_only_disable_kv_cache_pool_family = lambda *a, **k: None
    try:
        mixin.ModelRunnerKVCacheMixin._init_pools(runner)
    except PoolBuilt:
        return runner.token_to_kv_pool
    raise AssertionError("_init_pools returned without building token_to_kv_pool")


# -- one decode step through AscendAttnBackend.forward_decode on a built pool ---------------------

def fill_prefixes(pool, batch):
    """The batch's cached prefixes (and garbage in the slots nobody owns, and in the new tokens'
    slots, which ``set_kv_buffer`` must overwrite) in layer 0 of ``pool``."""
    spec = batch.spec
    slots = batch.k_cache.shape[0]
    pool.get_key_buffer(0).view(slots, spec.num_kv_heads, spec.qk_head_dim).copy_(batch.k_cache)
    pool.get_value_buffer(0).view(slots, spec.num_kv_heads, spec.v_head_dim).copy_(batch.v_cache)


def decode_inputs(batch, pool, *, use_fia=True, graph_mode=False, layer=None, backend_attrs=None):
    """(backend, layer, forward_batch, q, k, v) for one decode step after ``batch`` (every
    sequence's last token is the one decoded: its K/V go through ``set_kv_buffer``). The sequence
    lengths are the batch's (``batch.slots``: :func:`append_token` grows them); ``graph_mode``
    states the backend's (``forward_decode`` then calls ``forward_decode_graph``); ``layer`` by
    default the batch's plain one; ``backend_attrs`` go to :func:`~npu_shim.testing.cp_case.make_backend`
    (:func:`hybrid_swa_attrs`)."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    from npu_shim.testing import cp_case

    module = importlib.import_module(BACKEND)
    spec = batch.spec
    seq_lens = [len(slots) for slots in batch.slots]
    last = torch.stack([slots[-1] for slots in batch.slots])
    extra = {}
    import dataclasses

    if "req_to_token_pool" in {f.name for f in dataclasses.fields(ForwardBatch)}:
        extra["req_to_token_pool"] = batch.req_to_token_pool
    forward_batch = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=spec.bs,
        input_ids=torch.zeros(spec.bs, dtype=torch.int64), req_pool_indices=batch.req_pool_indices,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int64), out_cache_loc=last,
        seq_lens_sum=sum(seq_lens), seq_lens_cpu=torch.tensor(seq_lens, dtype=torch.int64),
        **extra)
    forward_batch.token_to_kv_pool = pool
    backend = cp_case.make_backend(module, batch, forward_batch, **(backend_attrs or {}))
    backend.use_fia = use_fia
    backend.use_mla = backend.use_alibi = backend.use_fa = backend.is_dllm_model = False
    backend.graph_mode, backend.enable_torch_compile = graph_mode, False
    backend.attn_cp_size = 1
    backend.token_to_kv_pool = pool
    backend.native_attn = module.AscendTorchNativeAttnBackend()
    q = torch.stack([q[-1] for q in batch.q]).reshape(spec.bs, -1)
    k = torch.stack([k[-1] for k in batch.k])
    v = torch.stack([v[-1] for v in batch.v])
    return backend, layer or cp_case.make_layer(spec), forward_batch, q, k, v


def append_token(batch, seed):
    """One more token per sequence (the next decode step's): random q / k / v of the batch's
    shapes, its slot the next one in the sequence's last page (the page must have room), entered
    in ``req_to_token`` as sglang's allocator would. Nothing is written to a pool."""
    spec = batch.spec
    gen = torch.Generator().manual_seed(seed)
    ps = spec.page_size
    for s, slots in enumerate(batch.slots):
        pos = len(slots)
        if pos % ps == 0:
            raise ValueError("sequence %d fills its last page: no slot for one more token here" % s)
        slot = (slots[-1] // ps) * ps + pos % ps
        batch.req_to_token_pool.req_to_token[batch.req_pool_indices[s], pos] = int(slot)
        batch.slots[s] = torch.cat([slots, slot.reshape(1)])

        def randn(*shape):
            return torch.randn(*shape, generator=gen).to(spec.dtype)

        batch.q[s] = torch.cat([batch.q[s], randn(1, spec.num_heads, spec.qk_head_dim)])
        batch.k[s] = torch.cat([batch.k[s], randn(1, spec.num_kv_heads, spec.qk_head_dim)])
        batch.v[s] = torch.cat([batch.v[s], randn(1, spec.num_kv_heads, spec.v_head_dim)])


# -- the hybrid SWA pool (full and sliding-window layers in two sub-pools) ------------------------

MIMO_ARCH = "MiMoV2FlashForCausalLM"


def mimo_is_hybrid_swa_compress():
    """The runner's ``is_hybrid_swa_compress`` for MiMo-V2-Flash, as the release's ModelConfig
    decides it (its architecture in ``MIMO_V2_MODEL_ARCHS``): True gives the SWA sub-pool its own
    head count and both sub-pools the V head dim."""
    from sglang.srt.configs import model_config

    return MIMO_ARCH in getattr(model_config, "MIMO_V2_MODEL_ARCHS", ())


def build_swa_pool(config, *, full_layer_ids, swa_layer_ids, tp=1, tokens=64, swa_tokens=48, page_size=16,
                   dtype=torch.bfloat16, device="cpu"):
    """The hybrid SWA pool (``SWAKVPool`` of two ``NPUMHATokenToKVPool``) the release's own code makes
    for ``config`` at attention TP ``tp`` on the Ascend backend: ``_build_ascend_swa_kv_pool`` where
    the configurator has it, else the inline branch of ``_init_pools``. ``config`` is a
    :func:`model_config` whose text config names ``swa_num_key_value_heads``."""
    bind_torch_npu()
    config.full_attention_layer_ids = list(full_layer_ids)      # where the builder reads them
    config.swa_attention_layer_ids = list(swa_layer_ids)        # (from 0.5.22: layer_info)
    config.hf_config.architectures = [MIMO_ARCH]
    layers = len(full_layer_ids) + len(swa_layer_ids)
    compress = mimo_is_hybrid_swa_compress()
    with attention_tp(tp):
        configurator = _module(CONFIGURATOR)
        if configurator is not None and hasattr(configurator.KVCacheConfigurator, "_build_ascend_swa_kv_pool"):
            from npu_shim.testing import cp_case

            cp_case.set_cpu_server_args()
            runner = SimpleNamespace(
                model_config=config, pool_page_size=page_size, is_hybrid_swa_compress=compress,
                server_args=SimpleNamespace(page_size=page_size, enable_memory_saver=False),
                kv_cache_dtype=dtype, device=device, post_capture_kv_active=False, draft_swa_full_capacity=False,
                layer_info=SimpleNamespace(num_effective_layers=layers, start_layer=0, end_layer=layers,
                                           full_attention_layer_ids=list(full_layer_ids),
                                           swa_attention_layer_ids=list(swa_layer_ids)))
            return configurator.KVCacheConfigurator._build_ascend_swa_kv_pool(
                runner, full_max_total_num_tokens=tokens, swa_max_total_num_tokens=swa_tokens)
        return _from_init_pools(config, tokens, page_size, layers, dtype, device, full_max_total_num_tokens=tokens,
                                swa_max_total_num_tokens=swa_tokens, is_hybrid_swa=True,
                                is_hybrid_swa_compress=compress)


def hybrid_swa_attrs(pool, window):
    """What ``AscendAttnBackend.__init__`` sets for a hybrid SWA pool (``model_runner.is_hybrid_swa``):
    the pool's registered full-to-SWA index mapping, the model's window, and
    ``use_sliding_window_kv_pool`` (an ``SWAKVPool`` with SWA layers)."""
    return dict(is_hybrid_swa=True, full_to_swa_index_mapping=pool.full_to_swa_index_mapping,
                sliding_window_size=window, use_sliding_window_kv_pool=pool.swa_layer_nums > 0,
                token_to_kv_pool=pool)
