"""sglang's NPU MHA KV pool built by the release's own builder, for models whose V head dim differs.

Shared by the selftests of ``sglang.npu_mha_v_head_dim`` / ``_inline`` /
``sglang.npu_kv_cpu_copy_v_head_dim`` (npu_shim/selftest/sglang_v_head_dim.py), their lane test
and the KV-bytes benchmark. What is real (the installed sglang):

* the builder: ``KVCacheConfigurator._build_ascend_mha_kv_pool`` where the release has it, else
  the inline call in ``ModelRunnerKVCacheMixin._init_pools`` (run on a stand-in runner whose
  ``server_args.attention_backend`` is ``"ascend"``, up to the pool's construction: the
  allocator that follows is not under test, and :class:`PoolBuilt` stops the run there);
* ``NPUMHATokenToKVPool`` (made on the device asked for: ``"cpu"`` on the emulation) and its
  ``set_kv_buffer``, ``get_cpu_copy`` / ``load_cpu_copy``;
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


def _from_init_pools(config, tokens, page_size, layers, dtype, device):
    mixin = importlib.import_module(MIXIN)
    runner = _Runner(
        model_config=config, server_args=_server_args(page_size, device), page_size=page_size,
        kv_cache_dtype=dtype, device=device, max_total_num_tokens=tokens, max_running_requests=4,
        req_to_token_pool=object(), is_draft_worker=True, mambaish_config=None, is_hybrid_swa=False,
        use_mla_backend=False, num_effective_layers=layers, start_layer=0, end_layer=layers,
        enable_hisparse=False)
    runner._validate_prefill_only_disable_kv_cache_pool_family = lambda *a, **k: None
    try:
        mixin.ModelRunnerKVCacheMixin._init_pools(runner)
    except PoolBuilt:
        return runner.token_to_kv_pool
    raise AssertionError("_init_pools returned without building token_to_kv_pool")
