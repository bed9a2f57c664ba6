"""sglang.npu_mha_v_head_dim — the NPU MHA KV pool gets the model's value head dim (builder from 0.5.16).

Why: sglang's Ascend plain MHA pool (``--disable-hybrid-swa-memory``, or any non-SWA model) is
  built by ``KVCacheConfigurator._build_ascend_mha_kv_pool`` without ``v_head_dim``, although
  ``NPUMHATokenToKVPool`` takes it and the CUDA builder passes it. For a model whose V head dim
  differs from K's (MiMo-V2-Flash: K 192 / V 128) the V buffer is K-wide, and the first
  ``set_kv_buffer`` fails: ``_npu_reshape_and_cache`` refuses V rows narrower than the cache
  (``ASCEND_USE_FIA`` off), the FIA scatter gets a mis-shaped view of V (up to 0.5.17) or
  "NPU KV scatter row mismatch" (0.5.18 on). Reproduced on CPU with the emulated ops on the
  0.5.16 and 0.5.23 wheels. sglang PR #39058 passed ``v_head_dim`` there and was closed unmerged.
  Beyond the dim: one MHA pool has one KV head count and one pair of head dims for every
  layer. MiMo-V2-Flash's full-attention layers have 4 KV heads and its sliding-window layers
  8; per rank (``max(1, heads // attention TP)``, sglang's ``get_num_kv_heads`` /
  ``get_swa_num_kv_heads``, and the model's own layers) they differ below attention TP 8, and
  the plain pool cannot hold the SWA layers' rows: upstream fails in the first forward.
How: upstream's builder, edited (:class:`~npu_shim.patches._shared.source_edit.AddKeyword`): its
  ``NPUMHATokenToKVPool(...)`` call gets ``v_head_dim=`` the model's, from :func:`pool_v_head_dim`,
  which first refuses, at pool construction (start-up), a model whose layer kinds need different
  per-rank KV geometry, naming the ways out: keep the hybrid SWA pool (drop
  ``--disable-hybrid-swa-memory``) or serve at an attention TP where the counts agree. A model
  whose V head dim equals K's takes upstream's builder, unedited. The value head dim travels
  in the pool's constructor: no class or module state, two pools keep their own.
  (0.5.14 / 0.5.15 build the pool inline: ``sglang.npu_mha_v_head_dim_inline``; the pool's
  CPU offload copies: ``sglang.npu_kv_cpu_copy_v_head_dim``.)
Upstream fix: none released (PR #39058 closed unmerged).
Remove when: the pinned sglang passes ``v_head_dim`` to the NPU MHA pool (the family's check
  then says NotNeeded).
"""
import ast
import inspect
import textwrap

from npu_shim.patch import Defect, Family, NotNeeded, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.source_edit import AddKeyword, edit_function
from npu_shim.patches._shared.structure import Edited, edit_of, module_class, own_function, replace_own

TARGET = "sglang.srt.mem_cache.kv_cache_configurator"
CONFIGURATOR = "KVCacheConfigurator"
BUILDER = "_build_ascend_mha_kv_pool"
POOL = "NPUMHATokenToKVPool"
HELPER = "npu_shim_pool_v_head_dim"
KEEPS = "NPUMHATokenToKVPool(...) as upstream calls it, with the model's v_head_dim added"
PATCH_NAME = "sglang.npu_mha_v_head_dim"


def layer_kinds(model_config, attn_tp_size):
    """``{kind: (KV heads per rank, K head dim, V head dim)}`` of the model's attention layers, as
    sglang computes them: full layers ``get_num_kv_heads``; sliding-window layers, where the
    config declares their own geometry (``swa_num_key_value_heads``, ``swa_head_dim``,
    ``swa_v_head_dim``), ``get_swa_num_kv_heads`` and the SWA dims."""
    kinds = {"full-attention": (model_config.get_num_kv_heads(attn_tp_size), model_config.head_dim,
                                model_config.v_head_dim)}
    text = model_config.hf_text_config
    if any(getattr(text, name, None) is not None
           for name in ("swa_num_key_value_heads", "swa_head_dim", "swa_v_head_dim")):
        head_dim = getattr(model_config, "swa_head_dim", None) or getattr(text, "swa_head_dim", None) \
            or model_config.head_dim
        v_head_dim = getattr(model_config, "swa_v_head_dim", None) or getattr(text, "swa_v_head_dim", None) \
            or head_dim
        kinds["sliding-window"] = (model_config.get_swa_num_kv_heads(attn_tp_size), head_dim, v_head_dim)
    return kinds


def fitting_tp(model_config, attn_tp_size):
    """The smallest attention TP (a power of two above ``attn_tp_size``) at which every layer kind
    has the same per-rank geometry; None where none does (the head dims differ)."""
    tp = attn_tp_size * 2
    while tp <= 1024:
        if len(set(layer_kinds(model_config, tp).values())) == 1:
            return tp
        tp *= 2
    return None


def pool_v_head_dim(model_config, attn_tp_size, patch=PATCH_NAME):
    """The model's value head dim for its one NPU MHA pool, after refusing a model that one pool
    cannot hold (see the module docstring)."""
    kinds = layer_kinds(model_config, attn_tp_size)
    if len(set(kinds.values())) > 1:
        shown = "; ".join("%s layers %d KV heads per rank, K %d / V %d" % ((kind,) + geometry)
                          for kind, geometry in kinds.items())
        tp = fitting_tp(model_config, attn_tp_size)
        raise ValueError(
            "npu-shim (%s): one NPU MHA KV pool cannot hold this model at attention TP %d (%s): the plain "
            "pool (--disable-hybrid-swa-memory) has one KV head count and one pair of head dims for every "
            "layer. Keep the hybrid SWA memory pool (drop --disable-hybrid-swa-memory)%s."
            % (patch, attn_tp_size, shown,
               " or serve with attention TP >= %d, where the layer kinds agree" % tp if tp else ""))
    return model_config.v_head_dim


def pool_calls(function, callee=POOL):
    """The keyword names of each call of ``callee`` in ``function``'s source."""
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError) as exc:
        raise TargetMismatch("%s: no source to read (%s)" % (function.__qualname__, exc)) from None
    return [{keyword.arg for keyword in node.keywords} for node in ast.walk(tree)
            if isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id == callee]


class PoolCall:
    """One shape: ``owner.name`` calls ``NPUMHATokenToKVPool(...)`` once, without ``v_head_dim``;
    ``tp`` is the expression of the attention TP width in that function's module."""

    def __init__(self, owner, name, tp, module_names):
        self.owner, self.name, self.tp, self.module_names = owner, name, tp, module_names

    @property
    def path(self):
        return "%s.%s" % (self.owner, self.name)

    def edits(self):
        return (AddKeyword(POOL, keyword="v_head_dim", value="%s(self.model_config, %s)" % (HELPER, self.tp)),)

    def check(self, module, context):
        function = own_function(module_class(module, self.owner), self.name)
        calls = pool_calls(function)
        if len(calls) != 1:
            raise TargetMismatch("%s calls %s %d times, not once" % (self.path, POOL, len(calls)))
        if "v_head_dim" in calls[0]:
            raise NotNeeded("%s passes v_head_dim to %s" % (self.path, POOL))
        missing = [name for name in self.module_names if name not in vars(module)]
        if missing:
            raise TargetMismatch("%s lacks %s" % (module.__name__, ", ".join(missing)))
        def v_head_dim(model_config, attn_tp_size):
            return pool_v_head_dim(model_config, attn_tp_size, context.patch)

        return {self.path: Edited(function, edit_function(function, self.edits(), names={HELPER: v_head_dim}))}

    def build(self, module, context):
        return {self.path: replace_own(module, self.owner, self.name, self.make, context,
                                       "the NPU MHA pool gets the model's v_head_dim (refused at start-up "
                                       "where one pool cannot hold the model's layer kinds)")}

    def make(self, module, original, context):
        edited = edit_of(context, self.path)

        def builder(self, *args, **kwargs):
            if self.model_config.v_head_dim == self.model_config.head_dim:
                context.count("upstream_calls")
                return original(self, *args, **kwargs)
            context.count("calls")
            return edited(self, *args, **kwargs)

        return builder


ASCEND_MHA_BUILDER = PoolCall(CONFIGURATOR, BUILDER, "get_parallel().attn_tp_size", ("get_parallel",))

PATCH = Patch(
    name=PATCH_NAME,
    target=TARGET,
    replaces=("%s.%s" % (CONFIGURATOR, BUILDER),),
    requires={"sglang": ""},
    outside_window={"sglang": "below the window the pool is built inline in _init_pools "
                              "(sglang.npu_mha_v_head_dim_inline)"},
    needs_npu=True,
    families=(Family(__name__ + ":ASCEND_MHA_BUILDER", fence=">=0.5.16", keeps=KEEPS),),
    summary="the NPU MHA KV pool gets the model's v_head_dim (K 192 / V 128 models); a model whose layer "
            "kinds need different per-rank KV heads is refused at pool construction, naming the way out",
    selftest=Selftest("npu_shim.selftest.sglang_v_head_dim:run", host_syncs=0,
                      arguments={"round_trip": "set_kv_buffer"}),
    defect=Defect("sglang's NPU MHA KV pool is built with V K-wide",
                  shows="raises",
                  says="cache heads/dims (2, 192) / (2, 192) do not match key/value (2, 192) / (2, 128)"),
)
