"""vllm.mimo_v2_flash_pad_v — MiMo-V2-Flash's attention on Ascend (``mimo_v2_flash``): V padded, no DiffKV backend.

Why: the model of ``vllm.mimo_v2_pad_v``, under its earlier module name: vLLM 0.20.2 hands every
  layer with a value head dim unlike the key's ``FlashAttentionDiffKVBackend``, whose impl raises
  ``NameError: flash_attn_supports_sinks`` while the first sliding-window layer (learnable sinks)
  is built wherever FA varlen is missing, Ascend included (reproduced on CPU with the wheel's
  class, tests/lanes/test_mimo_v2_flash.py). Up to 0.19 the same file pads V itself (not needed).
How: the family of ``vllm.mimo_v2_pad_v`` (its ``families`` module): ``MiMoV2Attention.__init__``
  and ``forward`` edited to build the layer with ``head_size_v = head_size`` on the platform's
  backend and pad V / cut the output, as the file did up to 0.19. ``NPU_SHIM_VLLM_MIMO_PAD_V=0``
  turns it off. A layer with learnable sinks (the sliding-window layers) is refused at build, as
  in ``vllm.mimo_v2_pad_v`` (the op's page does not take V_D 192 with GQA, paging or sinks);
  ``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1`` builds it padded anyway.
Window: read in the wheel 0.20.2 (0.21.0 moved the file to ``mimo_v2``).
Upstream fix: none.
Remove when: as ``vllm.mimo_v2_pad_v``.
"""
from npu_shim.patch import Family, Patch, Selftest

PATCH = Patch(
    name="vllm.mimo_v2_flash_pad_v",
    target="vllm.model_executor.models.mimo_v2_flash",
    replaces=("MiMoV2Attention.__init__", "MiMoV2Attention.forward"),
    requires={"vllm": ">=0.20.0,<0.21.0"},
    outside_window={"vllm": "below, the model pads V itself; above, it lives in mimo_v2 (vllm.mimo_v2_pad_v)"},
    needs_npu=True,
    families=(
        Family("npu_shim.patches.vllm.mimo_v2_pad_v.families:PAD_V", fence=">=0.20.0,<0.21.0",
               keeps="vllm-ascend's own attention backend and op calls; the model's V padded to the key head dim"),
    ),
    selftest=Selftest("npu_shim.selftest.vllm_mimo_v2_pad_v", host_syncs=0, arguments={"model": "mimo_v2_flash"}),
    summary="MiMo-V2-Flash (mimo_v2_flash)'s full layers build and serve on Ascend: V padded to the key head "
            "dim instead of a DiffKV backend that crashes there; its sink layers refused at build "
            "(NPU_SHIM_VLLM_MIMO_PAD_SINKS=1 to pad them)",
)
