"""vllm.kimi_vl_host_grid — Kimi-VL's ``image_grid_hws`` stays on the host (vLLM 0.29's placement)
and MoonViT's ``cu_seqlens`` is known on the host.

Why: vLLM sends ``image_grid_hws`` to the device with the other multimodal
  inputs until 0.29 (every release read, 0.18.0 .. 0.28.0) (``MultiModalFieldConfig.batched("image")``), and vLLM's
  MoonViT reads it back three times per forward (``grid_hws.tolist()`` in the
  position embedding, the 2D rope and ``patch_merger``); the ``cu_seqlens``
  the encoder then builds on the device from it is read back once more by
  vllm-ascend's attention (with ``vllm.mm_encoder_attn``; without it, once per
  layer). Measured on vLLM's own tower: 6 reads per forward upstream, 4 with
  ``vllm.mm_encoder_attn``. From 0.29.0 vLLM keeps the grid on the host
  itself, and the attention's read of ``cu_seqlens`` is what remains (1 per
  forward with ``vllm.mm_encoder_attn``).
How: two replacements (one from 0.29.0), each family's check reading the shapes:
  * ``KimiVLMultiModalProcessor._get_mm_fields_config`` (before 0.29.0): upstream's runs; its
    ``image_grid_hws`` entry, where it is a plain batched field, is replaced by
    ``MultiModalFieldConfig.batched(<same modality>, keep_on_cpu=True)`` -- what
    vLLM 0.29 declares -- so vLLM's batching leaves the grid on the host and the
    three ``tolist()`` calls read nothing.
  * ``MoonVitPretrainedModel.forward`` (the tower class as ``kimi_vl``
    imports it): given a host grid (and no ``encoder_metadata``), the host
    ``cu_seqlens`` is computed from it with the encoder's own integer ops
    (``cat((0, h*w)).cumsum(dtype=int32)``), upstream's forward runs untouched
    (its ``(h*w).to(device)`` copy and device ``cumsum`` included), and the
    host array is kept on the device ``cu_seqlens`` the encoder hands its
    first block (a forward pre-hook for that one call,
    :func:`npu_shim.patches._shared.host_record.remember`);
    the attention's host read takes it instead of reading back. A device
    grid (this patch's field config off) runs upstream's path unchanged.
  Cost: with a host grid, the encoder's ``(grid_hw[:, 0] * grid_hw[:, 1])
  .to(hidden_states.device)`` becomes one blocking host->device copy of N
  integers per forward (upstream code, as in vLLM 0.29); the tests count it.
Window: vllm 0.18.0, 0.22.1, 0.26.0 (both replacements; read in the wheels
  and run in the lanes; the field config also read in 0.19.1, 0.20.0, 0.20.2,
  0.21.0, 0.22.0, 0.23.0, 0.27.1, 0.28.0) and 0.29.0, 0.30.0 (the forward only:
  the field config has ``keep_on_cpu=True`` there). The first family's fence
  ends before 0.29.0; the second's is open above, its check deciding.
Upstream fix: the grid's placement, vLLM 0.29.0 (``keep_on_cpu=True`` on
  ``image_grid_hws``); the attention's read of ``cu_seqlens``: none (vLLM
  0.29's encoder CUDA-graph path precomputes the metadata, CUDA only).
Remove when: the pinned vLLM keeps the grid on the host and vllm-ascend's
  attention stops reading ``cu_seqlens`` back (then ``vllm.mm_encoder_host_lengths``
  goes too).
"""
from npu_shim.patch import Defect, Family, Patch, Selftest

PATCH_NAME = "vllm.kimi_vl_host_grid"
PROCESSOR = "KimiVLMultiModalProcessor"
TOWER = "MoonVitPretrainedModel"

PATCH = Patch(
    name=PATCH_NAME,
    target="vllm.model_executor.models.kimi_vl",
    replaces=(PROCESSOR + "._get_mm_fields_config", TOWER + ".forward"),
    requires={"vllm": ""},
    outside_window={"vllm": "releases below the window were not read for this patch"},
    needs_npu=True,
    families=(
        Family("npu_shim.patches.vllm.kimi_vl_host_grid.families:HOST_GRID",
               fence=">=0.18.0,<0.29.0",
               keeps="(grid_hw[:, 0] * grid_hw[:, 1]).to(hidden_states.device) and MoonViT's forward"),
        Family("npu_shim.patches.vllm.kimi_vl_host_grid.families:HOST_LENGTHS",
               fence=">=0.29.0",
               keeps="upstream's field config (keep_on_cpu=True), (grid_hw[:, 0] * grid_hw[:, 1])"
                     ".to(hidden_states.device) and MoonViT's forward"),
    ),
    summary="Kimi-VL's image_grid_hws kept on the host (vLLM's later keep_on_cpu) and the host cu_seqlens "
            "kept on MoonViT's device cu_seqlens: 0 reads per MoonViT forward",
    # None: what this patch is for; a read per layer or per forward is the defect back.
    selftest=Selftest("npu_shim.selftest.vllm_kimi_vl_host_grid", host_syncs=0),
    defect=Defect("Kimi-VL's image_grid_hws moved to the device and read back", shows="reads"),
)
