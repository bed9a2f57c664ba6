"""sglang.qwen3_vl_host_lengths — sglang's Qwen3-VL vision tower hands its attention the host lengths it built (0.5.11 - 0.5.15).

Why: before 0.5.16, ``Qwen3VLMoeVisionModel.forward`` builds ``cu_seqlens`` on the host
  (NumPy, from the host grid), moves it to "cpu" on NPU ("because of the attention op"),
  and then copies it to the device anyway (``cu_seqlens.to(self.device,
  non_blocking=True)``) for the blocks, whose only use of it on NPU is
  ``VisionAscendAttention``: that reads it back (0.5.11 - 0.5.13 ``seq_lens.to("cpu")``
  for ``_npu_flash_attention_unpad``, 0.5.14 - 0.5.15 ``cu_seqlens[1:].tolist()`` for
  FIA) in every layer. ``sglang.vision_device_lengths`` brings that to 1 read per forward
  (its own read of the device copy, ``vision_device_lengths.py:116``); the host had the
  numbers all along. (From 0.5.16 the tower hands the host tensor to
  ``prepare_vision_attention_metadata``: ``sglang.vision_host_lengths``, 0 reads.)
How: ``Qwen3VLMoeVisionModel.forward`` is, on NPU with an attention backend other than
  ``flashinfer_cudnn`` and outside the ViT graph mode, upstream's own forward with its copy of
  ``cu_seqlens`` to the device deleted (:func:`npu_shim.patches._shared.source_edit.edit_function`,
  compiled at upstream's file and lines): the blocks get the host ``cu_seqlens`` the tower built
  (what upstream's attention turns the device copy back into), as Qwen2.5-VL and GLM-4V hand
  theirs. The statement ``cu_seqlens = cu_seqlens.to(self.device, non_blocking=True)`` stands
  twice in upstream's forward: before the blocks (the copy) and in the ``if not _is_npu:``
  branch, which the edited forward, run on NPU only, never takes; the edit deletes both (count
  2). Every other statement is upstream's, run as upstream wrote it (patch embedding, position
  embedding, rotary table, ``.to("cpu")`` of a host tensor: no copy, blocks, deepstack mergers,
  merger); the attention's op call and arguments are upstream's (its host-lengths path). 0 reads
  per forward. A grid the host does not hold
  (:func:`npu_shim.patches._shared.host_data.host_grid`) goes to upstream's forward, unedited.
  ``check`` builds the edited forward: the anchor found other than twice is a TargetMismatch
  naming it. The three families delete the same copy; they differ by the forward's shape, which
  ``check`` reads as anchors too (each replaced by itself): ``x`` copied blocking or with
  ``non_blocking=True``, and whether the forward has the vectorized position embedding (it names
  ``_use_vectorized_pos_embed``), so exactly one accepts a development build.
Upstream fix: 0.5.16 (the metadata takes the host ``cu_seqlens``; its own reads are
  ``sglang.vision_host_lengths``'s).
Remove when: the pinned sglang is 0.5.16 or later.
"""

from npu_shim.patch import Defect, Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.host_data import host_grid
from npu_shim.patches._shared.source_edit import Replace, edit_function
from npu_shim.patches._shared.structure import Edited, edit_of, module_class, own_function, replace_own

TARGET = "sglang.srt.models.qwen3_vl"
TOWER = "Qwen3VLMoeVisionModel"
FORWARD = TOWER + ".forward"
MODULE_NAMES = ("envs", "get_global_server_args")
VECTORIZED = "_use_vectorized_pos_embed"

# upstream's forward, edited: the blocks get the host cu_seqlens (the copy before the blocks, and
# the same statement in the `if not _is_npu:` branch the NPU forward never takes)
HOST_CU_SEQLENS = Replace("cu_seqlens = cu_seqlens.to(self.device, non_blocking=True)", "", count=2)


def standing(statement):
    """A shape fact as an edit: ``statement`` stands once in upstream's forward (replaced by itself)."""
    return Replace(statement, statement)


class _Tower:
    """One shape of the tower's forward: ``x_copy``, upstream's statement copying ``x`` to the
    device (blocking, or with ``non_blocking=True``), and ``vectorized`` (the vectorized position
    embedding when ``_use_vectorized_pos_embed`` says so)."""

    def __init__(self, x_copy, vectorized):
        self.vectorized = vectorized
        self.edits = (standing(x_copy), HOST_CU_SEQLENS)

    def edited(self, module):
        """(upstream's forward, the edited one); TargetMismatch where the forward is not this shape."""
        original = own_function(module_class(module, TOWER), "forward")
        edited = edit_function(original, self.edits)
        if (VECTORIZED in original.__code__.co_names) != self.vectorized:
            raise TargetMismatch("%s %s %s" % (FORWARD, "does not call" if self.vectorized else "calls",
                                               VECTORIZED))
        return original, edited

    def check(self, module, context):
        missing = [name for name in MODULE_NAMES if not hasattr(module, name)]
        if missing or "_is_npu" not in vars(module):
            raise TargetMismatch("%s lacks %s" % (TARGET, ", ".join(missing + ["_is_npu"])))
        return {FORWARD: Edited(*self.edited(module))}

    def build(self, module, context):
        return {FORWARD: replace_own(module, TOWER, "forward", self.make_forward, context,
                                     "upstream's forward handing the blocks the host cu_seqlens the tower "
                                     "built (no read back in the attention)")}

    def make_forward(self, module, original, context):
        edited = edit_of(context, FORWARD)

        def forward(self, x, grid_thw):
            context.count("calls")
            if (module.envs.SGLANG_VIT_ENABLE_CUDA_GRAPH.get() or not module._is_npu or host_grid(grid_thw) is None
                    or module.get_global_server_args().mm_attention_backend == "flashinfer_cudnn"):
                context.count("upstream_calls")
                return original(self, x, grid_thw)
            # upstream: on NPU moved to "cpu", then copied to the device for the blocks, whose
            # attention reads it back in every layer
            context.count("upstream_host_copies")
            return edited(self, x, grid_thw)

        return forward


BLOCKING_X = _Tower("x = x.to(device=self.device, dtype=self.dtype)", vectorized=False)
NON_BLOCKING_X = _Tower("x = x.to(device=self.device, dtype=self.dtype, non_blocking=True)", vectorized=False)
VECTORIZED_POS_EMBED = _Tower("x = x.to(device=self.device, dtype=self.dtype, non_blocking=True)", vectorized=True)

KEEPS = "upstream's tower ops in upstream's order; the attention's op call on host lengths (upstream's path)"

PATCH = Patch(
    name="sglang.qwen3_vl_host_lengths",
    target=TARGET,
    replaces=(FORWARD,),
    requires={"sglang": ""},
    outside_window={"sglang": "above the window the tower hands its host cu_seqlens to the vision attention "
                              "metadata (sglang.vision_host_lengths); releases below the window were not read for this patch"},
    needs_npu=True,
    families=(
        Family(__name__ + ":BLOCKING_X", fence=">=0.5.11,<0.5.13", keeps=KEEPS),
        Family(__name__ + ":NON_BLOCKING_X", fence=">=0.5.13,<0.5.15", keeps=KEEPS),
        Family(__name__ + ":VECTORIZED_POS_EMBED", fence=">=0.5.15,<0.5.16", keeps=KEEPS),
    ),
    summary="Qwen3-VL's tower (before the vision attention metadata) hands its blocks the host cu_seqlens it built instead of a device "
            "copy its attention reads back: 0 reads per forward (upstream: 1 per layer; "
            "sglang.vision_device_lengths alone: 1)",
    # 0: what this patch is for; a read is the defect back.
    selftest=Selftest("npu_shim.selftest.sglang_tower:run", host_syncs=0, arguments={"tower": "Qwen3-VL"}),
    defect=Defect("sglang's Qwen3-VL tower reads back the lengths it built on the host",
                  shows="reads", fixed_at="sglang"),
)
