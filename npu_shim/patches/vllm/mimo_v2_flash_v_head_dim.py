"""vllm.mimo_v2_flash_v_head_dim — MiMo-V2-Flash's attention on Ascend (``mimo_v2_flash``): V's own head dim, no DiffKV backend.

Why: the model of ``vllm.mimo_v2_v_head_dim``, under its earlier module name: vLLM 0.20.2 hands every
  layer with a value head dim unlike the key's ``FlashAttentionDiffKVBackend``, whose impl raises
  ``NameError: flash_attn_supports_sinks`` while the first sliding-window layer (learnable sinks)
  is built wherever FA varlen is missing, Ascend included (reproduced on CPU with the wheel's
  class, tests/lanes/test_mimo_v2_flash.py). Up to 0.19 the same file pads V itself (not needed).
How: the family of ``vllm.mimo_v2_v_head_dim`` (its ``families`` module): ``MiMoV2Attention.__init__``
  edited to build the layer on the platform's backend with its own V head dim (served by
  ``vllm.ascend_attention_v_head_dim``; refused at build where it is not), or, with
  ``NPU_SHIM_VLLM_MIMO_PAD_V=1``, with V padded (``forward`` pads V and cuts the output, as the
  file did up to 0.19; sink layers then refused unless ``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1``).
  ``NPU_SHIM_VLLM_MIMO_V_HEAD_DIM=0`` turns it off.
Window: read in the wheel 0.20.2 (0.21.0 moved the file to ``mimo_v2``).
Upstream fix: none.
Remove when: as ``vllm.mimo_v2_v_head_dim``.
"""
from npu_shim.patch import Defect, Family, Patch, Selftest

PATCH = Patch(
    name="vllm.mimo_v2_flash_v_head_dim",
    target="vllm.model_executor.models.mimo_v2_flash",
    replaces=("MiMoV2Attention.__init__", "MiMoV2Attention.forward"),
    requires={"vllm": ""},
    outside_window={"vllm": "below, the model pads V itself; above, it lives in mimo_v2 (vllm.mimo_v2_v_head_dim)"},
    needs_npu=True,
    families=(
        Family("npu_shim.patches.vllm.mimo_v2_v_head_dim.families:V_HEAD_DIM", fence=">=0.20.0,<0.21.0",
               keeps="vllm-ascend's own attention backend and op calls (served by vllm.ascend_attention_v_head_dim); "
                     "V padded only with NPU_SHIM_VLLM_MIMO_PAD_V=1"),
    ),
    selftest=Selftest("npu_shim.selftest.vllm_mimo_v2_v_head_dim", host_syncs=0, arguments={"model": "mimo_v2_flash"}),
    defect=Defect("MiMo-V2-Flash's attention picks vLLM's DiffKV (FlashAttention) backend on Ascend",
                  shows="raises", says="AssertionError: FlashAttention version not detected"),
    summary="MiMo-V2-Flash (mimo_v2_flash) builds and serves on Ascend: no DiffKV backend, the platform's backend "
            "with separate K 192 / V 128 caches; NPU_SHIM_VLLM_MIMO_PAD_V=1 pads V instead",
)
