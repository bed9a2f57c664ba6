"""sglang.npu_mha_v_head_dim_inline — the NPU MHA KV pool gets the model's value head dim (inline build, 0.5.14 - 0.5.15).

Why: as ``sglang.npu_mha_v_head_dim`` (read there), for the releases that build the Ascend
  plain MHA pool inline, in ``ModelRunnerKVCacheMixin._init_pools``: its
  ``NPUMHATokenToKVPool(...)`` call passes no ``v_head_dim``, so a K 192 / V 128 model gets a
  192-wide V buffer and ``set_kv_buffer`` fails in the first forward (reproduced on CPU on the
  0.5.15 wheel: ``_npu_reshape_and_cache`` refuses the V rows; with ``ASCEND_USE_FIA=1`` the
  scatter gets a mis-shaped view of V).
How: upstream's ``_init_pools``, edited
  (:class:`~npu_shim.patches._shared.source_edit.AddKeyword`): its one call of
  ``NPUMHATokenToKVPool`` gets ``v_head_dim=`` the model's, through
  :func:`npu_shim.patches.sglang.npu_mha_v_head_dim.pool_v_head_dim` (which refuses, at pool
  construction, a model one MHA pool cannot hold, naming the ways out), the attention TP width
  read as upstream reads it there (``get_attention_tp_size()``). The hybrid-SWA branch, which
  hands the class to ``SWAKVPool`` (not a call), is left as it is. A model whose V head dim
  equals K's runs upstream's ``_init_pools``, unedited.
Upstream fix: 0.5.16 moved the build into ``_build_ascend_mha_kv_pool``, still without
  ``v_head_dim`` (``sglang.npu_mha_v_head_dim``).
Remove when: the pinned sglang is 0.5.16 or later.

Below the window (0.5.11 - 0.5.13) the same inline call stands, but ``NPUMHATokenToKVPool``
takes no ``v_head_dim``: it allocates K and V as one ``(2, layers, pages, page, heads,
head_dim)`` tensor, so no edit of the call can give V its own width (not patched; read in the
0.5.11 - 0.5.13 wheels).
"""
from npu_shim.patch import Defect, Family, Patch, Selftest
from npu_shim.patches.sglang.npu_mha_v_head_dim import KEEPS, PoolCall

TARGET = "sglang.srt.model_executor.model_runner_kv_cache_mixin"
MIXIN = "ModelRunnerKVCacheMixin"

INIT_POOLS_INLINE = PoolCall(MIXIN, "_init_pools", "get_attention_tp_size()", ("get_attention_tp_size",))

PATCH = Patch(
    name="sglang.npu_mha_v_head_dim_inline",
    target=TARGET,
    replaces=("%s._init_pools" % MIXIN,),
    requires={"sglang": ""},
    outside_window={"sglang": "below the window NPUMHATokenToKVPool has one head dim for K and V (one packed "
                              "buffer): no v_head_dim to pass; above it the pool is built by "
                              "_build_ascend_mha_kv_pool (sglang.npu_mha_v_head_dim)"},
    needs_npu=True,
    families=(Family(__name__ + ":INIT_POOLS_INLINE", fence=">=0.5.14,<0.5.16", keeps=KEEPS),),
    summary="the NPU MHA KV pool built inline in _init_pools gets the model's v_head_dim; a model whose layer "
            "kinds need different per-rank KV heads is refused at pool construction, naming the way out",
    selftest=Selftest("npu_shim.selftest.sglang_v_head_dim:run", host_syncs=0,
                      arguments={"round_trip": "set_kv_buffer"}),
    defect=Defect("sglang's NPU MHA KV pool is built with V K-wide (inline build)",
                  shows="raises",
                  says="cache heads/dims (2, 192) / (2, 192) do not match key/value (2, 192) / (2, 128)"),
)
