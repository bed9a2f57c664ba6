"""vllm.mimo_v2_pad_v — MiMo-V2-Flash's attention on Ascend: V padded to the key head dim, no DiffKV backend.

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
  ``set_head_size_v`` runs), and the one ``Attention(...)`` call is made with ``head_size_v`` equal
  to ``head_size``; ``forward`` pads V with zeros to the key head dim before ``self.attn`` and
  cuts the output back to the value head dim after it -- the statements of vLLM's own model up
  to 0.19, which vllm-ascend serves. Zero V columns give zero output columns, so the result is
  the attention with V of 128. Each layer pads by its own head dims: nothing is shared between
  models. Cost: the V cache is 192 wide instead of 128: (192 + 192) / (192 + 128) = 1.2x the KV
  bytes of a native K 192 / V 128 cache (benchmarks/bench_kv_bytes_mimo.py).
  ``NPU_SHIM_VLLM_MIMO_PAD_V=0`` turns it off (upstream's DiffKV path).
  Layers with learnable sinks (MiMo's sliding-window layers, ``sinks=`` through ``Attention``'s
  ``**extra_impl_args``) are refused at build (``NotImplementedError`` naming the layer), never
  mid-request: padded, vllm-ascend would hand torch_npu's ``npu_fused_infer_attention_score_v2``
  V_D 192 with GQA, a paged cache and ``learnable_sink``, which that op's page (op-plugin revision
  5e735e5) does not take ("GQA和PA场景不支持V_D等于192"; learnable_sink "仅支持value的d小于等于128");
  vLLM 0.15 - 0.19 make the same padded call. So on this patch only the full layers serve, and
  MiMo-V2-Flash as a whole does not build by default. ``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1`` builds the
  sink layers padded anyway, for a CANN that takes that call (unproven here: the emulation,
  following the page, refuses it). The documented path -- a separate 128-wide V cache and FIA v2
  with V_D 128 -- is not built.
Window: read in the wheels 0.21.0, 0.23.0, 0.24.0, 0.27.1, 0.28.0, 0.29.0 and 0.30.0 (one shape of
  ``__init__``/``forward`` where the edits anchor); 0.20.2 has the same class in
  ``mimo_v2_flash`` (``vllm.mimo_v2_flash_pad_v``). Not claimed above 0.30: on the lanes' vLLM 0.32
  with vllm-ascend 0.30.0rc2 the edits apply and the layer runs, but vLLM's
  ``get_kv_cache_spec`` calls ``AscendAttentionBackend.get_supported_kernel_block_sizes`` with an
  argument that release's backend does not take (``TypeError``, any model's layer).
Upstream fix: none (vLLM 0.30.0; no vllm-ascend release has a different-V-dim backend).
Remove when: vllm-ascend serves a layer with ``head_size_v != head_size`` (separate K and V caches,
  its op calls with the V head dim) and the model lets the platform choose the backend.
"""
from npu_shim.patch import Family, Patch, Selftest

PATCH = Patch(
    name="vllm.mimo_v2_pad_v",
    target="vllm.model_executor.models.mimo_v2",
    replaces=("MiMoV2Attention.__init__", "MiMoV2Attention.forward"),
    requires={"vllm": ">=0.21.0,<0.31.0"},
    outside_window={"vllm": "below, the model lives in mimo_v2_flash (vllm.mimo_v2_flash_pad_v); above, not read "
                            "(the lanes pair those releases with an older vllm-ascend whose backend vLLM's "
                            "KV-cache spec calls with arguments it does not take, for every model)"},
    needs_npu=True,
    families=(
        Family("npu_shim.patches.vllm.mimo_v2_pad_v.families:PAD_V", fence=">=0.21.0,<0.31.0",
               keeps="vllm-ascend's own attention backend and op calls; the model's V padded to the key head dim"),
    ),
    selftest=Selftest("npu_shim.selftest.vllm_mimo_v2_pad_v", host_syncs=0, arguments={"model": "mimo_v2"}),
    summary="MiMo-V2-Flash's full layers build and serve on Ascend: V padded to the key head dim (6/5 the KV "
            "bytes) instead of a DiffKV backend that crashes there; its sliding-window layers (sinks) refused "
            "at build (the op's page does not take V_D 192 with sinks), NPU_SHIM_VLLM_MIMO_PAD_SINKS=1 to pad them",
)
