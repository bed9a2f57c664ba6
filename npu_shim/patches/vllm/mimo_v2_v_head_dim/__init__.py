"""vllm.mimo_v2_v_head_dim — MiMo-V2-Flash's attention on Ascend: the platform's backend with V's own head dim, no DiffKV backend.

Why: MiMo-V2-Flash's value head dim (128) differs from its key head dim (192). From vLLM 0.20 the
  model hands every such layer a DiffKV backend of its own choosing, past the platform's:
  ``FlashAttentionDiffKVBackend`` up to 0.23, whose impl raises ``NameError:
  flash_attn_supports_sinks`` while the first sliding-window layer (the one with learnable sinks)
  is built wherever FA varlen is missing, Ascend included; from 0.24 ``TRITON_ATTN_DIFFKV``
  wherever FA-DiffKV is unsupported, whose packed ``(N, bs, H, 320)`` / ``(N, H, bs, 320)``
  cache shape vllm-ascend takes through ``get_kv_cache_shape`` and cannot view as K and V (0.24 -
  0.28), and which has no ``get_kv_cache_shape`` at all from 0.29 (``AttributeError`` at KV-cache
  initialisation in vllm-ascend's model runner). Reproduced on CPU with each wheel's model class
  (tests/lanes/test_mimo_v2_flash.py). The DiffKV backends also keep ``head_size_v`` on the class:
  two models in one process share it.
How: ``MiMoV2Attention.__init__`` and ``forward`` are upstream's, edited
  (:func:`npu_shim.patches._shared.source_edit.edit_function`; family module ``families``): the
  DiffKV branch's condition becomes ``False`` (so ``attn_backend=None``: the platform picks
  vllm-ascend's ``AscendAttentionBackend`` as for every other model, and no class-global
  ``set_head_size_v`` runs), and the one ``Attention(...)`` call goes through a per-layer choice.
  By default it is upstream's call, ``head_size_v`` 128: vLLM's KV-cache spec carries it and
  vllm-ascend's model runner allocates a 192-wide K cache and a 128-wide V cache, which
  ``vllm.ascend_attention_v_head_dim`` serves with vllm-ascend's own FIA v2 call (the op's page,
  op-plugin revision 5e735e5, documents TND with Q/K 192 and V 128 with GQA, page attention and
  ``learnable_sink``). Where that patch does not serve the layer's impl, the layer is refused at
  build, naming the way out. ``NPU_SHIM_VLLM_MIMO_PAD_V=1`` builds it with ``head_size_v`` =
  ``head_size`` instead, and ``forward`` pads V with zeros before ``self.attn`` and cuts the
  output back after it (the statements of vLLM's own model up to 0.19): 1.2x the KV bytes
  ((192 + 192) / (192 + 128), benchmarks/bench_kv_bytes_mimo.py) and, for the sliding-window
  layers, an FIA v2 call with V_D 192, GQA, paging and ``learnable_sink`` that the page does not
  take ("GQA和PA场景不支持V_D等于192"; learnable_sink "仅支持value的d小于等于128"): padded, such a
  layer is refused at build unless ``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1``. ``forward``'s pad and cut
  act only on a layer built padded (its own ``attn.head_size_v``): nothing is shared between
  layers or models. ``NPU_SHIM_VLLM_MIMO_V_HEAD_DIM=0`` turns the patch off (upstream's DiffKV path).
Window: read in the wheels 0.21.0, 0.23.0, 0.24.0, 0.27.1, 0.28.0, 0.29.0 and 0.30.0 (one shape of
  ``__init__``/``forward`` where the edits anchor); 0.20.2 has the same class in
  ``mimo_v2_flash`` (``vllm.mimo_v2_flash_v_head_dim``). Not claimed above 0.30: on the lanes' vLLM 0.32
  with vllm-ascend 0.30.0rc2 the edits apply and the layer runs, but vLLM's
  ``get_kv_cache_spec`` calls ``AscendAttentionBackend.get_supported_kernel_block_sizes`` with an
  argument that release's backend does not take (``TypeError``, any model's layer).
Upstream fix: none (vLLM 0.30.0; no vllm-ascend release has a different-V-dim backend).
Remove when: vllm-ascend serves a layer with ``head_size_v != head_size`` and the model lets the
  platform choose the backend.
"""
from npu_shim.patch import Defect, Family, Patch, Selftest

PATCH = Patch(
    name="vllm.mimo_v2_v_head_dim",
    target="vllm.model_executor.models.mimo_v2",
    replaces=("MiMoV2Attention.__init__", "MiMoV2Attention.forward"),
    requires={"vllm": ""},
    outside_window={"vllm": "below, the model lives in mimo_v2_flash (vllm.mimo_v2_flash_v_head_dim); above, not read "
                            "(the lanes pair those releases with an older vllm-ascend whose backend vLLM's "
                            "KV-cache spec calls with arguments it does not take, for every model)"},
    needs_npu=True,
    families=(
        Family("npu_shim.patches.vllm.mimo_v2_v_head_dim.families:V_HEAD_DIM", fence=">=0.21.0,<0.31.0",
               keeps="vllm-ascend's own attention backend and op calls (served by vllm.ascend_attention_v_head_dim); "
                     "V padded only with NPU_SHIM_VLLM_MIMO_PAD_V=1"),
    ),
    selftest=Selftest("npu_shim.selftest.vllm_mimo_v2_v_head_dim", host_syncs=0, arguments={"model": "mimo_v2"}),
    defect=Defect("MiMo-V2's attention picks vLLM's DiffKV backend, not the platform's, on Ascend",
                  shows="raises",
                  says=("FlashAttention version not detected", "'AscendMetadata' object has no attribute")),
    summary="MiMo-V2-Flash builds and serves on Ascend: no DiffKV backend (which crashes there), the platform's "
            "backend with separate K 192 / V 128 caches (vllm.ascend_attention_v_head_dim serves them); "
            "NPU_SHIM_VLLM_MIMO_PAD_V=1 pads V to 192 instead (6/5 the KV bytes; sink layers then refused)",
)
