"""MiMo-V2-Flash's K (192) and V (128) caches as vllm-ascend's own model runner allocates them.

Patches: ``vllm.mimo_v2_v_head_dim`` / ``vllm.mimo_v2_flash_v_head_dim`` (the layer's KV-cache spec
carries ``head_size_v`` 128). :mod:`test_mimo_v2_flash` re-does the runner's arithmetic; here the
runner's code itself runs: ``NPUModelRunner._allocate_kv_cache_tensors`` (the raw bytes per layer,
split by ``_get_attention_kv_cache_dims``) then ``_reshape_kv_cache_tensors`` (K viewed with the
backend's ``get_kv_cache_shape``, V with ``head_size_v``), the functions of the installed
``vllm_ascend.worker.model_runner_v1``, unbound, every runner method they call the runner's own.

What is real: the two layers (vLLM's ``MiMoV2Attention``, a full one and a sliding one with sinks,
built on vllm-ascend's ``AscendAttentionBackend``, :mod:`npu_shim.testing.mimo`); their specs
(``get_kv_cache_spec``); vLLM's own planner from those specs (``get_kv_cache_groups``, the layout
resolved by ``resolve_kv_cache_layout`` from the backend's declared layouts as the engine core
does, ``get_kv_cache_config_from_groups`` for a memory budget); vLLM's ``AttentionGroup``.

Stand-ins:

* :class:`RunnerStandIn`, the ``self`` of the runner's methods: it carries only the data
  attributes in :data:`STAND_IN` (the runner's flags for features off in this serving: no
  DCP, sparse, compressed, sparse-offload, KV-pipelining or xlite; the CPU standing for the NPU
  device; one attention group per KV-cache group as ``initialize_attn_backend`` makes them);
  any other attribute resolves to ``NPUModelRunner``'s own method or fails naming it;
* :data:`UNCALLED`: three modules the runner's module imports and the KV-cache path never calls,
  EPLB's FlashLB expert placement (``vllm_ascend.eplb.core.policy.policy_flashlb``), vLLM's
  n-gram speculative proposer (``vllm.v1.spec_decode.ngram_proposer``) and the chunk-timing
  profiler (``vllm_ascend.core.profiling_chunk_predictor``), are import placeholders while their own imports, numba and scipy (declared dependencies of vLLM and
  vllm-ascend that the lanes do not install), are missing; their names refuse to be used.

Lanes: those of the claimed releases whose venv imports ``model_runner_v1`` (the ``pinned``
narrowing below): it imports ``vllm.v1.structured_output``, i.e. xgrammar 0.2.8, which needs
apache-tvm-ffi >= 0.1.11 (its own requirement; lanes pinning 0.1.9 / 0.1.10 fail its import).
"""
import contextlib
import dataclasses
import importlib.util
import inspect
import sys
import types

import pytest

PAD = ("vllm.mimo_v2_v_head_dim", "vllm.mimo_v2_flash_v_head_dim")
# Modules the runner's module imports (through vllm_ascend.eplb and vllm_ascend.spec_decode) whose
# own imports the lane lacks, and that the KV-cache path never calls: {module: (names, needs)}.
UNCALLED = {
    "vllm_ascend.eplb.core.policy.policy_flashlb": (("FlashLB", "warm_up"), ("numba", "scipy")),
    "vllm.v1.spec_decode.ngram_proposer": (("NgramProposer",), ("numba",)),
    "vllm_ascend.core.profiling_chunk_predictor": (("_finish_profiling_chunk_timing",
                                                    "_start_profiling_chunk_timing"), ("scipy",)),
}
MEMORY = 4 * 1024 * 1024          # bytes handed to vLLM's planner

# vllm.mimo_v2_flash_v_head_dim (vLLM 0.20's mimo_v2_flash module) has no lane that imports the runner yet
pytestmark = [pytest.mark.claimed(PAD[0], pinned={"apache-tvm-ffi": ">=0.1.11"}), pytest.mark.patch(PAD[0])]

# What the stand-in ``self`` carries besides the runner's methods (vllm-ascend 0.30.0rc2's
# ``_allocate_kv_cache_tensors`` / ``_reshape_kv_cache_tensors`` read these); ``None`` entries are
# filled per test (``vllm_config``, ``compilation_config``, ``kv_cache_config``, ``attn_groups``).
STAND_IN = dict(
    use_dcp=False, use_sparse=False, use_compress=False, sparse_kv_offload_enabled=False,
    runner_only_attn_layers=frozenset(),
    ascend_config=types.SimpleNamespace(kvpp_config=types.SimpleNamespace(size=1),
                                        xlite_graph_config=types.SimpleNamespace(enabled=False)),
    model_config=types.SimpleNamespace(hf_text_config=types.SimpleNamespace(model_type="mimo_v2_flash")),
)


def _placeholder_module(name, names, missing):
    """An import placeholder of module ``name``: each of ``names`` a class that refuses to be
    instantiated or called (subclassing it works: upstream subclasses ``NgramProposer``)."""
    from npu_shim.emulation.placeholders import placeholder_class

    module = types.ModuleType(name, "Import placeholder (npu-shim tests): %s not installed in this lane."
                              % " / ".join(missing))
    for attr in names:
        setattr(module, attr, placeholder_class(name + "." + attr))
    return module


def _runner_class():
    """``NPUModelRunner``, its module imported with the :data:`UNCALLED` modules as placeholders
    while their own imports are missing (restored to unimported after)."""
    from npu_shim.testing import mimo

    mimo.import_ascend_backend()
    placed = {}
    for name, (names, needs) in UNCALLED.items():
        missing = [dist for dist in needs if importlib.util.find_spec(dist) is None]
        if missing and name not in sys.modules:
            placed[name] = sys.modules[name] = _placeholder_module(name, names, missing)
    try:
        from vllm_ascend.worker.model_runner_v1 import NPUModelRunner
    finally:
        for name, module in placed.items():
            if sys.modules.get(name) is module:
                del sys.modules[name]
    return NPUModelRunner


class RunnerStandIn:
    """Stand-in ``self`` for ``NPUModelRunner``'s KV-cache methods: the data attributes given,
    and the runner class's own methods bound to it; anything else raises AttributeError."""

    def __init__(self, runner_class, **data):
        self.__dict__.update(data)
        self._runner_class = runner_class

    def __getattr__(self, name):
        attr = getattr(self.__dict__["_runner_class"], name, None)
        if isinstance(attr, property):
            return attr.fget(self)
        if callable(attr) and hasattr(attr, "__get__"):
            return attr.__get__(self)
        raise AttributeError("RunnerStandIn carries no %r (add it to STAND_IN if the runner reads it)" % name)


@contextlib.contextmanager
def _resolved_layout(config, backend, specs):
    """vLLM's KV-cache layout resolved as the engine core resolves it (restored after); nothing
    to do on a vLLM whose planner takes no layout (no ``resolve_kv_cache_layout``)."""
    from vllm.v1.attention.backends import utils

    if not hasattr(utils, "resolve_kv_cache_layout"):
        yield
        return
    get_supported_kv_cache_layouts, resolve_kv_cache_layout = (utils.get_supported_kv_cache_layouts,
                                                               utils.resolve_kv_cache_layout)
    previous = config.cache_config.kv_cache_layout
    try:
        resolve_kv_cache_layout(config, [[layout.name for layout in get_supported_kv_cache_layouts([backend])]],
                                specs.values())
        yield
    finally:
        config.cache_config.kv_cache_layout = previous


@contextlib.contextmanager
def _hybrid_manager(config, hybrid):
    """vLLM's hybrid KV-cache manager on (a group per layer kind: the sliding layer keeps its
    ``SlidingWindowSpec``) or off (one group: specs unified to ``FullAttentionSpec``); restored after."""
    scheduler = config.scheduler_config
    previous = scheduler.disable_hybrid_kv_cache_manager
    scheduler.disable_hybrid_kv_cache_manager = not hybrid
    try:
        yield
    finally:
        scheduler.disable_hybrid_kv_cache_manager = previous


def allocate(mimo, layers, hybrid=False, mutate_spec=None, reshape=True, bind=False):
    """The runner's K/V caches for ``layers``: ({layer name: (K, V)}, kv_cache_config, {name: spec});
    with ``reshape=False`` the raw allocation (``_allocate_kv_cache_tensors``' answer) instead of
    the caches; with ``bind=True`` through ``initialize_kv_cache_tensors`` (allocation, reshape and
    vLLM's ``bind_kv_cache`` onto the layers), the stand-in then also carrying the runner's empty
    ``shared_kv_cache_layers`` and ``kv_caches``."""
    import torch
    from vllm.config import set_current_vllm_config
    from vllm.v1.core import kv_cache_utils
    from vllm.v1.worker.utils import AttentionGroup

    runner = _runner_class()
    backend = mimo.import_ascend_backend()
    config = mimo.setup()
    specs = {layer.attn.layer_name: mimo.kv_cache_spec(layer) for layer in layers}
    if mutate_spec is not None:
        specs = {name: mutate_spec(spec) for name, spec in specs.items()}
    with set_current_vllm_config(config), _resolved_layout(config, backend, specs), _hybrid_manager(config, hybrid):
        groups = kv_cache_utils.get_kv_cache_groups(config, specs)
        kv_cache_config = kv_cache_utils.get_kv_cache_config_from_groups(config, groups, MEMORY)
        attn_groups = [[AttentionGroup(backend=backend, layer_names=group.layer_names,
                                       kv_cache_spec=group.kv_cache_spec, kv_cache_group_id=index)]
                       for index, group in enumerate(kv_cache_config.kv_cache_groups)]
        me = RunnerStandIn(runner, vllm_config=config, compilation_config=config.compilation_config,
                           kv_cache_config=kv_cache_config, attn_groups=attn_groups, device=torch.device("cpu"),
                           use_hybrid_blocks=len(attn_groups) > 1,      # as initialize_kv_cache sets it
                           **STAND_IN)
        if bind:
            me.shared_kv_cache_layers, me.kv_caches = {}, []
            return runner.initialize_kv_cache_tensors(me, kv_cache_config, **({"kernel_block_sizes": None} if (
                "kernel_block_sizes" in inspect.signature(runner.initialize_kv_cache_tensors).parameters) else {})), \
                kv_cache_config, specs
        raw = runner._allocate_kv_cache_tensors(me, kv_cache_config)
        if not reshape:
            return raw, kv_cache_config, specs
        # kernel_block_sizes (a later release's argument): None, the spec's own block size
        extra = {"kernel_block_sizes": None} if "kernel_block_sizes" in inspect.signature(
            runner._reshape_kv_cache_tensors).parameters else {}
        caches = runner._reshape_kv_cache_tensors(me, kv_cache_config, raw, **extra)
    return caches, kv_cache_config, specs


def _byte_range(tensor):
    start = tensor.data_ptr()
    return start, start + tensor.numel() * tensor.element_size()


@pytest.fixture(scope="module")
def mimo():
    from npu_shim.testing import mimo

    mimo.setup()
    return mimo


@pytest.fixture(scope="module")
def layers(mimo):
    import torch

    with mimo.ascend_backend():
        return [mimo.build_layer(kind, dtype=torch.bfloat16) for kind in mimo.KINDS]


def test_runner_gives_each_layer_k_192_and_v_128(mimo, layers):
    """vLLM's hybrid KV-cache manager off (one group: the sliding layer's spec unified to a full
    one): each layer gets (K, V): K (blocks, block, kv heads, 192), V (..., 128), the spec's dtype,
    contiguous, K and V and the layers' caches over disjoint bytes; the block count is what the
    memory budget holds at (192 + 128) per token and KV head: MEMORY // (page * layers per group).
    (The runner takes its one-tensor-per-layer path here, K then V in it, split by ``head_size_v``.)"""
    caches, kv_cache_config, specs = allocate(mimo, layers)
    assert set(caches) == set(specs)
    groups = kv_cache_config.kv_cache_groups
    assert len(groups) == 1, groups
    spans = []
    for name, spec in specs.items():
        assert (spec.head_size, spec.head_size_v) == (mimo.HEAD_DIM, mimo.V_HEAD_DIM)
        key, value = caches[name]
        element = key.element_size()
        group_spec = next(group.kv_cache_spec for group in groups if name in group.layer_names)
        block_size = group_spec.block_size
        page = group_spec.page_size_bytes
        assert page == block_size * spec.num_kv_heads * (mimo.HEAD_DIM + mimo.V_HEAD_DIM) * element
        blocks = MEMORY // (page * max(len(group.layer_names) for group in groups))
        assert kv_cache_config.num_blocks == blocks
        assert tuple(key.shape) == (blocks, block_size, mimo.KV_HEADS, mimo.HEAD_DIM), key.shape
        assert tuple(value.shape) == (blocks, block_size, mimo.KV_HEADS, mimo.V_HEAD_DIM), value.shape
        assert key.dtype == value.dtype == spec.dtype
        assert key.is_contiguous() and value.is_contiguous()
        spans += [_byte_range(key), _byte_range(value)]
    spans.sort()
    for (_, end), (start, _) in zip(spans, spans[1:]):
        assert end <= start, spans                    # no two caches share a byte
    # and writing every K leaves every V as it was
    for key, value in caches.values():
        value.fill_(2)
    for key, _ in caches.values():
        key.fill_(1)
    assert all(bool((value == 2).all()) for _, value in caches.values())


def test_runner_binds_each_layer_its_own_caches(mimo, layers):
    """Through ``initialize_kv_cache_tensors``: each layer's ``kv_cache`` is the (K 192, V 128)
    pair the runner made for it."""
    caches, _, _ = allocate(mimo, layers, bind=True)
    for layer in layers:
        bound = layer.attn.kv_cache
        pair = bound[0] if isinstance(bound, list) else bound
        assert pair is caches[layer.attn.layer_name]
        assert (pair[0].shape[-1], pair[1].shape[-1]) == (mimo.HEAD_DIM, mimo.V_HEAD_DIM)


@pytest.mark.parametrize("hybrid", [False, True], ids=["one-group", "hybrid-groups"])
def test_runner_with_equal_head_dims_gives_equal_caches(mimo, hybrid):
    """Standard layers (K = V = 128, a full one and a sliding one with sinks) through the same
    code, the hybrid manager off and on: K and V both 128 wide, the block count from the page."""
    with mimo.ascend_backend():
        layers = [mimo.build_layer(kind, head_dim=128, v_head_dim=128) for kind in mimo.KINDS]
    caches, kv_cache_config, _ = allocate(mimo, layers, hybrid=hybrid)
    groups = kv_cache_config.kv_cache_groups
    assert len(groups) == (2 if hybrid else 1), groups
    page = groups[0].kv_cache_spec.page_size_bytes
    assert kv_cache_config.num_blocks == MEMORY // (page * max(len(group.layer_names) for group in groups))
    for key, value in caches.values():
        assert key.shape == value.shape and key.shape[-1] == 128 and key.shape[0] == kv_cache_config.num_blocks


def test_spec_without_the_v_head_dim_gives_a_192_wide_v(mimo, layers):
    """The check can fail: the same layers' specs with head_size_v set to the key's (what a spec
    that lost the layer's V head dim says) give a 192-wide V and fewer blocks."""
    caches, kv_cache_config, _ = allocate(mimo, layers,
                                          mutate_spec=lambda spec: dataclasses.replace(spec, head_size_v=spec.head_size))
    for key, value in caches.values():
        assert value.shape[-1] == key.shape[-1] == mimo.HEAD_DIM


@contextlib.contextmanager
def _upstream_split():
    """Inside the block, the runner's module calls upstream's ``calc_split_factor`` (float ratios)."""
    runner = sys.modules["vllm_ascend.worker.model_runner_v1"]
    patched = runner.calc_split_factor
    runner.calc_split_factor = patched.__wrapped_upstream__
    try:
        yield
    finally:
        runner.calc_split_factor = patched


@pytest.mark.patch(PAD[0], "vllm.ascend_kv_split_exact")
def test_hybrid_groups_sliding_layer_split_exact(mimo, layers):
    """vLLM's hybrid KV-cache manager on (a group per layer kind): the sliding layer keeps its
    ``SlidingWindowSpec`` and the runner splits its bytes into K and V by ``calc_split_factor([192,
    128])``. Before (upstream's float ratios: 320 / 192 rounds up in binary) K comes out one byte
    short of blocks * page * 192 / 320 and ``_reshape_kv_cache_tensors`` fails its own page
    assertion: KV-cache initialisation raises. After (``vllm.ascend_kv_split_exact``) the split is
    exact and each layer gets K 192 / V 128. K = V (factor 2.0, exact) never hits it: see
    test_runner_with_equal_head_dims_gives_equal_caches."""
    runner = sys.modules["vllm_ascend.worker.model_runner_v1"]
    assert runner.calc_split_factor.__npu_shim_patch__ == "vllm.ascend_kv_split_exact"
    with _upstream_split():
        raw, kv_cache_config, specs = allocate(mimo, layers, hybrid=True, reshape=False)
        (sliding,) = [name for name, spec in specs.items() if type(spec).__name__ == "SlidingWindowSpec"]
        key, value = raw[sliding]
        layer_bytes = kv_cache_config.num_blocks * specs[sliding].page_size_bytes
        assert value.numel() == layer_bytes * mimo.V_HEAD_DIM // (mimo.HEAD_DIM + mimo.V_HEAD_DIM)
        assert key.numel() == layer_bytes * mimo.HEAD_DIM // (mimo.HEAD_DIM + mimo.V_HEAD_DIM) - 1
        with pytest.raises(AssertionError):
            allocate(mimo, layers, hybrid=True)
    caches, kv_cache_config, specs = allocate(mimo, layers, hybrid=True)
    assert len(kv_cache_config.kv_cache_groups) == 2
    for name in specs:
        key, value = caches[name]
        assert (key.shape[-1], value.shape[-1]) == (mimo.HEAD_DIM, mimo.V_HEAD_DIM)
        assert key.shape[0] == value.shape[0] and key.is_contiguous() and value.is_contiguous()
