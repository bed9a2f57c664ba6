"""vllm.glm4_1v_host_lengths — GLM-4.1V's vision tower takes its lengths from the host.

Why: GLM-4.1V's vision embeddings (``Glm4vVisionEmbeddings.forward``, the same
  code in every release read from 0.18.0 to 0.27.1) turn the per-frame
  ``lengths``, which the tower already holds as a host list, into a device
  tensor and then use each element as a repeat count
  (``image_shapes[i, 1].repeat(lengths[i])``, ``glm4_1v.py:586``/``:589`` in
  0.26.0): two device->host reads per frame. The coordinates and the lengths
  go to the device with blocking copies (``:539``, ``:549``) and, from 0.26.0,
  the image shape too (``:819`` in ``pos_embeds_interpolate``): 4 per image.
  On 0.18.0 the tower also copies ``cu_seqlens`` to the device before taking
  ``.tolist()`` of it (``:765``). In 0.18.0 .. 0.23.0 the tower copies
  ``cu_seqlens`` itself, so ``vllm.mm_encoder_host_lengths`` never sees the
  host array and vllm-ascend's attention (``vllm.mm_encoder_attn``) reads the
  tensor back once per forward. On an NPU each read drains the queue before
  the first token of every multimodal request.
How: every number is already on the host; each replacement is upstream's own method edited
  (:func:`npu_shim.patches._shared.source_edit.edit_function`, the edits are named in
  ``families.py``) only where it takes a number or makes a copy, every other statement upstream's,
  compiled at upstream's lines:
  * ``Glm4vVisionEmbeddings.forward`` (every family), for host ``lengths``: the lengths stay a host
    list (no device tensor to read the repeat counts back from), a list of image shapes is made on
    the host, and the image shapes and the coordinates go to the device with ``non_blocking=True``;
    upstream's repeat / cat / grid_sample run on the device as upstream runs them. Lengths that are
    not host data (:func:`npu_shim.patches._shared.host_data.is_host`) run upstream's.
  * copy-then-tolist shape: ``Glm4vVisionTransformer.forward`` reads ``seqlens`` from the host
    ``cu_seqlens`` rather than from its device copy, and keeps the host array on the copy
    (:func:`npu_shim.patches._shared.host_record.remember`).
  * tower-copy shape: ``compute_attn_mask_seqlen`` is wrapped as
    ``vllm.qwen2_5_vl_host_lengths`` wraps Qwen2.5-VL's: the host ``cu_seqlens`` it is handed
    keeps its values on the tensor its next ``.to`` returns (upstream's copy, upstream's
    arguments).
  * encoder-metadata shape: ``cu_seqlens`` goes through ``maybe_recompute_cu_seqlens``
    (``vllm.mm_encoder_host_lengths``); ``Glm4vVisionTransformer.forward``, for the eager call
    that builds its own metadata, has ``pos_embeds_interpolate`` make the image shape on the host
    (the embeddings copy it, and the coordinates, non-blocking), for that one call.
  Counted on vLLM's own tower (two grids with a two- and a three-frame item,
  ``npu_shim.testing.count_host_syncs``): 0 reads per forward with
  ``vllm.mm_encoder_attn`` and ``vllm.mm_encoder_host_lengths`` (upstream:
  13-14), and 0 blocking host->device copies (upstream: 3 on 0.18.0, 1 on
  0.22.1, 12 on 0.26.0) outside ``rot_pos_emb``, whose 2 on 0.18.0 .. 0.21.0
  (the host position ids indexing the device cos/sin tables) are
  ``vllm.glm4_1v_rotary_ids``'s.
Window: read in the wheels: 0.18.0 (lane vllm-0.18); 0.19.1, 0.20.2, 0.21.0,
  0.22.1 (lane vllm-0.22), 0.23.0; 0.26.0 (lane latest-vllm), 0.27.1. 0.28.0,
  0.29.0 and 0.30.0 (lane vllm-0.30) build the target sizes with NumPy on
  the host, pass the image shape as a list and copy the coordinates with
  ``async_tensor_h2d``: outside the window (the check says "not needed" on
  that shape).
Upstream fix: vLLM 0.28.0's ``Glm4vVisionEmbeddings.forward`` (host
  ``np.repeat`` of the lengths, ``async_tensor_h2d``).
Remove when: the pinned vLLM is 0.28.0 or later.
"""
from npu_shim.patch import Defect, Family, Patch, Selftest

PATCH_NAME = "vllm.glm4_1v_host_lengths"
EMBEDDINGS = "Glm4vVisionEmbeddings"
TOWER = "Glm4vVisionTransformer"
FAMILIES = "npu_shim.patches.vllm.glm4_1v_host_lengths.families:"

PATCH = Patch(
    name=PATCH_NAME,
    target="vllm.model_executor.models.glm4_1v",
    replaces=(EMBEDDINGS + ".forward", TOWER + ".forward", TOWER + ".compute_attn_mask_seqlen"),
    requires={"vllm": ""},
    outside_window={"vllm": "releases below the window were not read for this patch; above it vLLM builds "
                            "GLM-4.1V's embedding sizes on the host and copies them non-blocking itself"},
    needs_npu=True,
    families=(
        Family(FAMILIES + "COPY_THEN_TOLIST", fence=">=0.18.0,<0.19.0",
               keeps="cu_seqlens.to(self.device, non_blocking=True) and the embeddings' repeat / cat"),
        Family(FAMILIES + "TOWER_COPY",
               fence=">=0.19.0,<0.24.0",
               keeps="cu_seqlens.to(self.device, non_blocking=True) and the embeddings' repeat / cat"),
        Family(FAMILIES + "ENCODER_METADATA", fence=">=0.24.0,<0.28.0",
               keeps="pos_embeds_interpolate's coordinate ops and the embeddings' repeat / cat"),
    ),
    summary="GLM-4.1V's vision embeddings take lengths and shapes from the host and copy non-blocking; "
            "the tower's own cu_seqlens copy keeps its host array: 0 reads per tower forward",
    # None: what this patch is for; a read per layer or per forward is the defect back.
    selftest=Selftest("npu_shim.selftest.vllm_glm4_1v_host_lengths", host_syncs=0),
    defect=Defect("GLM-4.1V's vision tower reads back lengths it has on the host",
                  shows="reads", fixed_at="vllm"),
)
