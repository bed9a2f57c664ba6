"""MiMo-V2-Flash's attention layers (vLLM's own ``MiMoV2Attention``) on CPU, from a tiny config,
for the tests and ``benchmarks/bench_kv_bytes_mimo.py``.

The layers are built the way vLLM builds them (a ``VllmConfig`` with a CPU ``DeviceConfig``, a
1-rank gloo model-parallel group, ``set_current_vllm_config``). Two kinds, as in the model:

* ``full``: full attention, no sinks;
* ``swa``: a sliding window with learnable sinks (``add_swa_attention_sink_bias``);

both with the key head dim 192 and the value head dim 128 (MiMo-V2-Flash's), tiny hidden sizes.

Stand-ins, each because this machine has no NPU:

* torch_npu: npu-shim's emulation, with ``torch.npu`` registered (``register_device_module``);
* :func:`ascend_backend`: vLLM's backend selector, as the attention layer module sees it, answers
  vllm-ascend's ``AscendAttentionBackend`` -- the answer of vllm-ascend's platform
  (``NPUPlatform.get_attn_backend_cls``) for a decoder layer that is neither MLA nor sparse;
  vllm-ascend's module is imported without ``vllm_ascend/ops/__init__.py``
  (:mod:`npu_shim.testing.isolation`). A layer handed a backend by the model (upstream's DiffKV
  path) never asks the selector.

:func:`upstream_layer` builds a layer with upstream's ``__init__`` (the function the shim's
replacement keeps as ``__wrapped_upstream__``), for the "before" of each release.
"""
import contextlib
import importlib
import inspect
import itertools
import os
import types

__all__ = ["ASCEND_BACKEND", "HEAD_DIM", "KINDS", "V_HEAD_DIM", "WINDOW", "ascend_backend", "ascend_registrations",
           "attention_class",
           "build_layer", "kv_cache_spec", "model_module", "padded", "reference_layer_attention", "setup",
           "sink_attention_f64"]

HEAD_DIM, V_HEAD_DIM = 192, 128
HIDDEN, HEADS, KV_HEADS = 64, 4, 2
WINDOW = 4
KINDS = {
    "full": dict(sliding_window_size=-1),
    "swa": dict(sliding_window_size=WINDOW, add_swa_attention_sink_bias=True),
}
ASCEND_BACKEND = ("vllm_ascend.attention.attention_v1", "AscendAttentionBackend")

_CONFIG = None
_PREFIXES = itertools.count()


def setup(emulate=True):
    """The emulation (``emulate``) and the shim installed, a CPU ``VllmConfig`` with the 1-rank
    model-parallel group opened (once per process); returns the config."""
    global _CONFIG
    if _CONFIG is not None:
        return _CONFIG
    os.environ.setdefault("VLLM_PLUGINS", "")     # the lanes use "npu_shim"; never "ascend"
    import npu_shim
    from npu_shim import emulation

    if emulate:
        emulation.install()
        emulation.register_device_module()    # vllm-ascend names torch.npu at import
    npu_shim.install()
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config
    from npu_shim.testing.towers import open_one_rank_group

    config = VllmConfig(device_config=DeviceConfig(device="cpu"))
    with set_current_vllm_config(config):
        open_one_rank_group("npu_shim_mimo_")
    _CONFIG = config
    return config


def model_module():
    """vLLM's MiMo-V2-Flash model module: ``mimo_v2`` (0.21+) or ``mimo_v2_flash`` (up to 0.20)."""
    for name in ("vllm.model_executor.models.mimo_v2", "vllm.model_executor.models.mimo_v2_flash"):
        if importlib.util.find_spec(name) is not None:
            return importlib.import_module(name)
    raise ImportError("this vLLM has no MiMo-V2-Flash model module")


def attention_class():
    return model_module().MiMoV2Attention


def import_ascend_backend():
    """vllm-ascend's ``AscendAttentionBackend`` (its module imported without the ops package's
    ``__init__``, under the current config: 0.14.0rc1 reads it at import)."""
    from vllm.config import set_current_vllm_config

    from npu_shim.testing.isolation import import_vllm_ascend_module

    with set_current_vllm_config(setup()):
        return getattr(import_vllm_ascend_module(ASCEND_BACKEND[0]), ASCEND_BACKEND[1])


class _SpecConfig:
    """The config a layer's ``get_kv_cache_spec`` reads: the CPU ``VllmConfig``, its
    ``model_config`` (None here: no checkpoint) standing in as a model that is not MLA (what
    the sliding-window spec asks on some releases)."""

    def __init__(self, config):
        self._config = config
        self.model_config = types.SimpleNamespace(use_mla=False)

    def __getattr__(self, name):
        return getattr(self._config, name)


def kv_cache_spec(layer):
    """``layer.attn.get_kv_cache_spec`` under the CPU config (:class:`_SpecConfig`)."""
    return layer.attn.get_kv_cache_spec(_SpecConfig(setup()))


@contextlib.contextmanager
def ascend_backend(asked=None):
    """Inside the block, the backend selector the attention layer module calls answers vllm-ascend's
    ``AscendAttentionBackend``; each call's keyword/positional arguments are appended to ``asked``
    (a list) when given."""
    backend = import_ascend_backend()
    layer_module = inspect.getmodule(model_module().Attention)
    original = layer_module.get_attn_backend

    def get_attn_backend(*args, **kwargs):
        if asked is not None:
            asked.append(inspect.signature(original).bind(*args, **kwargs).arguments)
        return backend

    layer_module.get_attn_backend = get_attn_backend
    try:
        yield backend
    finally:
        layer_module.get_attn_backend = original


@contextlib.contextmanager
def padded(sinks=False):
    """Inside the block, ``NPU_SHIM_VLLM_MIMO_PAD_V=1`` (and ``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1`` with
    ``sinks``): this process's settings (the environment's, with those switches on) replaced,
    restored after; a layer with V != K is then built with V padded to the key head dim."""
    from npu_shim import _config

    switches = dict(NPU_SHIM_VLLM_MIMO_PAD_V="1", **({"NPU_SHIM_VLLM_MIMO_PAD_SINKS": "1"} if sinks else {}))
    previous = _config.use_settings(_config.Settings(dict(os.environ, **switches)))
    try:
        yield
    finally:
        _config.use_settings(previous)


def layer_arguments(kind, prefix):
    return dict(hidden_size=HIDDEN, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM,
                v_head_dim=V_HEAD_DIM, prefix=prefix, **KINDS[kind])


def build_layer(kind, init=None, dtype=None, **overrides):
    """A ``MiMoV2Attention`` of ``kind`` (:data:`KINDS`), built under the current config with a
    fresh prefix (vLLM registers each attention layer by name); ``init``: the ``__init__`` to run
    (default: the class's own, patched or not). Weights random, sinks random."""
    import torch
    from vllm.config import set_current_vllm_config

    config = setup()
    cls = attention_class()
    arguments = layer_arguments(kind, "model.layers.%d.self_attn" % next(_PREFIXES))
    arguments.update(overrides)
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype or torch.float32)
    try:
        with set_current_vllm_config(config):
            layer = cls.__new__(cls)
            (init or cls.__init__)(layer, **arguments)
    finally:
        torch.set_default_dtype(previous)
    generator = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for parameter in layer.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator, dtype=torch.float64) * 0.3)
    return layer


def upstream_init():
    """Upstream's ``MiMoV2Attention.__init__`` (the patched class keeps it as ``__wrapped_upstream__``)."""
    init = attention_class().__init__
    return getattr(init, "__wrapped_upstream__", init)


def sink_attention_f64(q, k, v, sinks=None, window=None, scale=None):
    """Causal attention of one sequence ``q`` (T, N, D), ``k`` (T, Nkv, D), ``v`` (T, Nkv, Dv) in
    float64, from the definition: query i sees keys j <= i, and, with a ``window``, only the last
    ``window`` of them (j > i - window); a learnable sink s_h adds exp(s_h) to head h's softmax
    denominator (a logit with a zero value). Built on :func:`npu_shim.testing.reference.attention_f64`
    (its log-sum-exp gives the sink's share)."""
    import torch

    from npu_shim.testing.reference import attention_f64

    t = q.shape[0]
    allowed = None
    if window is not None:
        def allowed(segment, sq, skv):
            rows = torch.arange(sq).unsqueeze(1) + (skv - sq)
            return torch.arange(skv).unsqueeze(0) > rows - window
    out, lse = attention_f64(q, k, v, [0, t], scale=scale, causal=True, allowed=allowed, return_lse=True)
    if sinks is None:
        return out
    sinks = sinks.detach().to("cpu", torch.float64).view(1, -1)
    keep = 1.0 / (1.0 + torch.exp(sinks - lse))          # exp(lse) / (exp(lse) + exp(sink))
    return out * keep.unsqueeze(-1)


def reference_layer_attention(layer, q, k, v):
    """What ``layer``'s attention should give for one sequence's ``q``/``k``/``v`` as the model
    splits them (value head dim :data:`V_HEAD_DIM`), float64, (T, heads * v_head_dim)."""
    t = q.shape[0]
    window = layer.attn.sliding_window if getattr(layer.attn, "sliding_window", None) else None
    sinks = getattr(layer, "attention_sink_bias", None)
    out = sink_attention_f64(q.view(t, layer.num_heads, layer.head_dim),
                             k.view(t, layer.num_kv_heads, layer.head_dim),
                             v.view(t, layer.num_kv_heads, layer.v_head_dim),
                             sinks=sinks, window=window, scale=layer.scaling)
    return out.reshape(t, -1)


def kv_bytes_per_token(spec):
    """Bytes a KV-cache spec takes per token of one layer (its page over its block)."""
    return spec.page_size_bytes / spec.block_size


def ascend_prefill_decode(layer, tokens=6, seed=0, num_blocks=2, block_size=128, around_decode=None,
                          device="cpu", value_cache_width=None, null_block=False):
    """One sequence through vllm-ascend's own ``AscendAttentionBackendImpl.forward`` (the emulated
    torch_npu ops underneath): a prefill of ``tokens`` tokens (``PrefillNoCache``), then one decode
    step (``DecodeOnly``) reading the paged K/V caches the prefill wrote, on the q/k/v the layer's
    own projections and rotary give. A layer built padded (its ``Attention``'s ``head_size_v`` is
    the key head dim) gets V padded by the patch's :func:`pad_v` and the output cut by its
    :func:`unpad_output` (what the padded ``forward`` does around ``self.attn``); a native one
    (``head_size_v`` 128) gets separate K (192) and V (128) caches and its own V. The metadata
    is what vllm-ascend's builder gives one sequence (fields named as in ``AscendMetadata``), under
    vLLM's ``set_forward_context``. Returns (output (tokens + 1, heads * v_head_dim) float64, the
    float64 reference of :func:`reference_layer_attention`). ``around_decode(device_tensors)``: a
    context manager entered around the decode step's pad, impl call and cut (e.g. a host-sync
    counter, handed the tensors that live on the device there). ``device``: where the layer, the
    caches and the metadata's device tensors live (``"npu"`` for the real kernels; the layer is
    moved there). ``value_cache_width``: the V cache's last dim where it is not the layer's V head
    dim (what a runner allocates from a spec that carries no ``head_size_v``). ``null_block``: as
    vLLM's KV-cache manager lays out a sliding-window layer's blocks, block 0 is the null block
    (filled here with large random K and V, so that reading it shows), the sequence's blocks are
    1, 2, ..., and at the decode step each block whose every token lies before the window (all
    positions < p - W + 1 for the query at p; vLLM's ``SlidingWindowManager`` frees them) has its
    block-table entry pointed at the null block; ``num_blocks`` counts the null block."""
    import contextlib
    import dataclasses
    import sys

    import torch
    from vllm.config import set_current_vllm_config
    from vllm.forward_context import get_forward_context, set_forward_context

    from npu_shim.patches.vllm.mimo_v2_v_head_dim import families

    import_ascend_backend()
    ascend = sys.modules[ASCEND_BACKEND[0]]
    metadata_class, state = ascend.AscendMetadata, ascend.AscendAttentionState
    dtype = next(layer.parameters()).dtype
    layer.to(device)
    attn, impl = layer.attn, layer.attn.impl
    head, value_width = layer.head_dim, getattr(attn, "head_size_v", layer.head_dim)
    pad_v, unpad_output = families.pad_v, families.unpad_output      # nothing done to a native layer
    key_cache = torch.zeros(num_blocks, block_size, layer.num_kv_heads, head, dtype=dtype, device=device)
    value_cache = torch.zeros(num_blocks, block_size, layer.num_kv_heads, value_cache_width or value_width,
                              dtype=dtype, device=device)
    generator = torch.Generator().manual_seed(seed)
    first = 1 if null_block else 0           # the sequence's first physical block
    if null_block:
        if num_blocks < first + -(-(tokens + 1) // block_size):
            raise ValueError("null_block: %d blocks of %d hold neither the null block and %d tokens"
                             % (num_blocks, block_size, tokens + 1))
        key_cache[0] = (8 * torch.randn(key_cache[0].shape, generator=generator)).to(device, dtype)
        value_cache[0] = (8 * torch.randn(value_cache[0].shape, generator=generator)).to(device, dtype)
    hidden = torch.randn(tokens + 1, layer.qkv_proj.input_size, generator=generator).to(device, dtype)
    positions = torch.arange(tokens + 1, device=device)
    with torch.no_grad():
        qkv, _ = layer.qkv_proj(hidden)
        q, k, v = qkv.split([layer.q_size, layer.k_size, layer.v_size], dim=-1)
        q, k = layer.rotary_emb(positions, q, k)
    values = pad_v(layer, v)
    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool, device=device), diagonal=1)
    outputs = []
    config = setup()
    steps = ((state.PrefillNoCache, 0, tokens), (state.DecodeOnly, tokens, tokens + 1))
    fields = {f.name for f in dataclasses.fields(metadata_class)}
    window = getattr(attn, "sliding_window", None)
    # up to vllm-ascend 0.18 the builder also hands a sliding layer's band mask (swa_mask: 2048 x 2048
    # bool, True = masked, above the diagonal and `window` or more below it)
    swa_mask = None
    if "swa_mask" in fields and window:
        full = torch.ones(2048, 2048, dtype=torch.bool, device=device)
        swa_mask = torch.triu(full, diagonal=1) | torch.tril(full, diagonal=-window)
    with set_current_vllm_config(config):
        for step, start, stop in steps:
            n = stop - start
            decode = step == state.DecodeOnly
            table = torch.arange(first, num_blocks, dtype=torch.int32)
            if null_block and decode and window:
                skipped = stop - 1 - window + 1              # positions before the decode query's window
                table[: max(0, skipped // block_size)] = 0   # freed blocks: the null block
            given = dict(
                attn_mask=mask, attn_state=step, num_actual_tokens=n, num_decode_tokens=n if decode else 0,
                num_prefills=0 if decode else 1, num_decodes=1 if decode else 0,
                seq_lens=torch.tensor([stop], device=device), seq_lens_cpu=torch.tensor([stop]), seq_lens_list=[stop],
                actual_seq_lengths_q=[n], query_start_loc=torch.tensor([0, n], device=device), max_query_len=n,
                block_tables=table.to(device).unsqueeze(0),
                slot_mapping=torch.arange(start + first * block_size, stop + first * block_size, dtype=torch.int32,
                                          device=device), causal=True,
                swa_mask=swa_mask)
            metadata = metadata_class(**{k: v for k, v in given.items() if k in fields})
            output = torch.zeros(n, layer.num_heads, value_width, dtype=dtype, device=device)
            on_device = (q, k, v, key_cache, value_cache, output, metadata.block_tables, metadata.slot_mapping,
                         metadata.seq_lens, metadata.query_start_loc, mask)
            around = around_decode(on_device) if decode and around_decode else contextlib.nullcontext()
            with set_forward_context(None, config, num_tokens=n), around:
                context = get_forward_context()
                if not hasattr(context, "capturing"):
                    context.capturing = False     # what vllm-ascend's own forward context sets outside capture
                step_v = pad_v(layer, v[start:stop]) if decode else values[start:stop]
                result = impl.forward(attn, q[start:stop].view(n, -1, head), k[start:stop].view(n, -1, head),
                                      step_v.view(n, -1, value_width), (key_cache, value_cache), metadata, output)
                outputs.append(unpad_output(layer, result.reshape(n, -1)))
    return torch.cat(outputs).double().cpu(), reference_layer_attention(layer, q.cpu(), k.cpu(), v.cpu())


# vllm-ascend's register_ascend_customop imports every one of its ops modules; two of their imports
# are missing from the lanes, both only used on the NPU: scipy (a declared dependency of vllm-ascend
# the lanes do not install; vllm_ascend.attention.indexer, reached through ops.mla, builds a Hadamard
# matrix with it) and fla_npu (NPU-only kernels, not on the package index; vllm_ascend.ops.gdn).
REGISTRATION_PLACEHOLDERS = ("scipy", "fla_npu")


class _RegistrationConfig(_SpecConfig):
    """The config ``register_ascend_customop`` reads: :class:`_SpecConfig`, its model a model that
    is not DeepSeek's MLA (vllm-ascend 0.20 - 0.22 ask, to register the MLA gate)."""

    def __init__(self, config):
        super().__init__(config)
        self.model_config = types.SimpleNamespace(use_mla=False, is_deepseek_mla=False)


@contextlib.contextmanager
def import_placeholders(roots):
    """Inside the block, a module of ``roots`` (top-level names) that is not installed imports as a
    placeholder whose names are classes that refuse to be instantiated; after the block the
    placeholders leave ``sys.modules`` and the finder ``sys.meta_path``."""
    import importlib.abc
    import importlib.machinery
    import sys

    from npu_shim.emulation.placeholders import placeholder_class

    missing = {root for root in roots if importlib.util.find_spec(root) is None}

    class Finder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
        def find_spec(self, fullname, path=None, target=None):
            if fullname.split(".")[0] not in missing:
                return None
            return importlib.machinery.ModuleSpec(fullname, self, is_package=True)

        def create_module(self, spec):
            module = types.ModuleType(spec.name, "npu-shim test import placeholder for %s" % spec.name)
            module.__path__ = []

            def __getattr__(name, prefix=spec.name):
                if name.startswith("__"):
                    raise AttributeError(name)
                return placeholder_class(prefix + "." + name)

            module.__getattr__ = __getattr__
            return module

        def exec_module(self, module):
            pass

    finder = Finder()
    sys.meta_path.insert(0, finder)
    try:
        yield
    finally:
        sys.meta_path.remove(finder)
        for name in [n for n in sys.modules if n.split(".")[0] in missing]:
            del sys.modules[name]


def _gemm_on_cpu():
    """vllm-ascend's ``torch.ops.vllm.unquantized_gemm`` (its linear layers' matmul; 0.20+), which
    it registers for the NPU dispatch key only, also registered for CPU with the very function
    upstream registers (``vllm_ascend.ops.linear.unquantized_gemm``: ``F.linear``). Once per
    process; nothing where the op does not exist."""
    import sys

    import torch

    linear = sys.modules.get("vllm_ascend.ops.linear")
    op = getattr(getattr(torch.ops, "vllm", None), "unquantized_gemm", None) if linear else None
    if op is None or getattr(_gemm_on_cpu, "done", False):
        return
    library = torch.library.Library("vllm", "IMPL")
    library.impl("unquantized_gemm", linear.unquantized_gemm, "CPU")
    _gemm_on_cpu.done, _gemm_on_cpu.library = True, library


@contextlib.contextmanager
def ascend_registrations():
    """Inside the block, vLLM builds layers as on a vllm-ascend worker: vllm-ascend's
    ``init_ascend_config`` and ``register_ascend_customop`` (upstream's own functions, called as the
    platform's worker calls them) have run, so vLLM's ``PluggableLayer.__new__`` / ``CustomOp``
    hand out vllm-ascend's classes (``AscendQKVParallelLinear`` for ``QKVParallelLinear``, ...).
    Stand-ins: :data:`REGISTRATION_PLACEHOLDERS` while it imports, :class:`_RegistrationConfig`,
    :func:`_gemm_on_cpu`. After the block vLLM's registry of out-of-tree classes and vllm-ascend's
    "registered" flag are what they were (the rest of the process builds vLLM's own classes)."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor import custom_op

    from npu_shim.testing.isolation import import_vllm_ascend_module

    config = setup()
    registry = vars(custom_op).get("op_registry_oot")
    if registry is None:
        registry = custom_op.CustomOp.op_registry_oot
    saved = dict(registry)
    with set_current_vllm_config(config):
        utils = import_vllm_ascend_module("vllm_ascend.utils")
        ascend_config = import_vllm_ascend_module("vllm_ascend.ascend_config")
        flag = vars(utils).get("_ASCEND_CUSTOMOP_IS_REIGISTERED", False)
        utils._ASCEND_CUSTOMOP_IS_REIGISTERED = False
        try:
            ascend_config.init_ascend_config(config)
            with import_placeholders(REGISTRATION_PLACEHOLDERS):
                utils.register_ascend_customop(_RegistrationConfig(config))
            _gemm_on_cpu()
            yield registry
        finally:
            registry.clear()
            registry.update(saved)
            utils._ASCEND_CUSTOMOP_IS_REIGISTERED = flag
