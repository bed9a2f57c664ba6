"""sglang.qwen2_5_vl_host_lengths — sglang's Qwen2.5-VL vision tower builds its window and image bounds on the host (0.5.11 - 0.5.23).

Why: ``Qwen2_5_VisionTransformer.forward`` (the same code in 0.5.11 - 0.5.15, and again,
  with the vision attention metadata, in 0.5.16 - 0.5.23) has every length on the host:
  ``grid_thw`` is the processor's host tensor and ``get_window_index`` returns the window
  bounds as a host list and the window index as a host tensor. The tower still copies the
  bounds to the device with blocking copies (``torch.tensor(cu_window_seqlens,
  device=x.device)``, ``torch.tensor([0], device=x.device)``, the image bounds'
  ``.to(device=x.device)``) and the window index too (``window_index.to(device=x.device)``),
  deduplicates the window bounds there (``torch.unique_consecutive``: its output shape
  depends on the data, a read), and on NPU moves both bound tensors back to "cpu" ("because
  of npu_flash_attention_unpad operator restriction"): 3 device->host reads and 4 blocking
  host->device copies per tower forward (``models/qwen2_5_vl.py:521,560,561`` in 0.5.23,
  measured with sglang's own tower on the lanes, ``npu_shim.testing.sglang_towers``), before
  the first token of every image request.
How: ``Qwen2_5_VisionTransformer.forward`` is, on NPU, upstream's own forward with four
  expressions edited (:func:`npu_shim.patches._shared.source_edit.edit_function`, compiled at
  upstream's file and lines), so the bounds are built where upstream ends up wanting them, on
  the host: ``torch.tensor(cu_window_seqlens, ...)`` and ``torch.tensor([0], ...)`` lose their
  ``device=x.device``, the grid's cumulative sum loses the ``device=`` of its ``.to``, and the
  window index is copied with ``non_blocking=True``. Everything else runs as upstream wrote it:
  ``torch.unique_consecutive`` of the same int32 values (on the host), the same two ``torch.cat``,
  upstream's ``.to("cpu")`` on NPU (on a host tensor it returns the tensor itself: no copy), the
  vision attention metadata built from the same host tensors (``sglang.vision_host_lengths``
  serves those with 0 reads), every op of the data path (patch embedding, rotary table, window
  gather, blocks, merger, reverse gather) in upstream's order with upstream's arguments. 0 reads
  and 0 blocking copies per forward. The ViT graph path (``enable_cg``), a grid not on the host
  (:func:`npu_shim.patches._shared.host_data.host_grid_tensor`), and a host that is not an NPU go
  to upstream's forward, unedited.
  ``check`` builds the edited forward: an anchor missing, or found more often than once, is a
  TargetMismatch naming it. The two families edit the same four expressions; they differ by
  whether the forward builds the vision attention metadata (it names
  ``prepare_vision_attention_metadata``), so exactly one accepts a development build. No body
  digest: the edit keeps whatever else upstream's forward does, and ``get_window_index`` (whose
  host list and host index the host bounds come from) is left as upstream's; that it still hands
  host data is what the tower tests' read counts check on every sglang lane.
Upstream fix: none (0.5.23).
Remove when: sglang's Qwen2.5-VL tower keeps its bounds on the host on NPU.
"""

from npu_shim.patch import Defect, Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.host_data import host_grid_tensor
from npu_shim.patches._shared.source_edit import ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import Edited, edit_of, module_class, own_function, replace_own

TARGET = "sglang.srt.models.qwen2_5_vl"
TOWER = "Qwen2_5_VisionTransformer"
FORWARD = TOWER + ".forward"
METADATA_BUILDER = "prepare_vision_attention_metadata"

# upstream's forward, edited: the bounds built on the host, the window index copied non-blocking
EDITS = (
    # the window bounds (a host list): deduplicated on the host, not copied to the device first
    ReplaceExpression("torch.tensor(cu_window_seqlens, device=x.device, dtype=torch.int32)",
                      "torch.tensor(cu_window_seqlens, dtype=torch.int32)"),
    ReplaceExpression("window_index.to(device=x.device)", "window_index.to(device=x.device, non_blocking=True)"),
    # the image bounds: the same cat and cumulative sum, on the host
    ReplaceExpression("torch.tensor([0], device=x.device, dtype=torch.int32)", "torch.tensor([0], dtype=torch.int32)"),
    ReplaceExpression("(grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).cumsum(dim=0)"
                      ".to(device=x.device, dtype=torch.int32)",
                      "(grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).cumsum(dim=0).to(dtype=torch.int32)"),
)


class _Tower:
    """One shape of the tower's forward: ``metadata`` -- it builds the vision attention metadata
    and hands it to the blocks (its code names ``prepare_vision_attention_metadata``)."""

    def __init__(self, metadata):
        self.metadata, self.edits = metadata, EDITS

    def edited(self, module):
        """(upstream's forward, the edited one); TargetMismatch where the forward is not this shape."""
        original = own_function(module_class(module, TOWER), "forward")
        edited = edit_function(original, self.edits)
        if (METADATA_BUILDER in original.__code__.co_names) != self.metadata:
            raise TargetMismatch("%s %s %s" % (FORWARD, "does not call" if self.metadata else "calls",
                                               METADATA_BUILDER))
        return original, edited

    def check(self, module, context):
        if not callable(getattr(module, "is_npu", None)):
            raise TargetMismatch("%s lacks is_npu" % TARGET)
        return {FORWARD: Edited(*self.edited(module))}

    def build(self, module, context):
        return {FORWARD: replace_own(module, TOWER, "forward", self.make_forward, context,
                                     "upstream's forward with the window and image bounds built on the "
                                     "host and the window index copied non-blocking (no read, no "
                                     "blocking copy)")}

    def make_forward(self, module, original, context):
        edited = edit_of(context, FORWARD)

        def forward(self, x, grid_thw):
            context.count("calls")
            if self.enable_cg or not host_grid_tensor(grid_thw) or not module.is_npu():
                context.count("upstream_calls")
                return original(self, x, grid_thw)
            context.count("upstream_host_copies")    # upstream: 3 reads here
            return edited(self, x, grid_thw)

        return forward


BEFORE_METADATA = _Tower(metadata=False)
METADATA = _Tower(metadata=True)

PATCH = Patch(
    name="sglang.qwen2_5_vl_host_lengths",
    target=TARGET,
    replaces=(FORWARD,),
    requires={"sglang": ""},
    outside_window={"sglang": "releases below the window were not read for this patch"},
    needs_npu=True,
    families=(
        Family(__name__ + ":BEFORE_METADATA",
               fence=">=0.5.11,<0.5.16",
               keeps="upstream's tower ops in upstream's order; the blocks take host cu_seqlens, as upstream "
                     "hands them on NPU"),
        Family(__name__ + ":METADATA",
               fence=">=0.5.16",
               keeps="upstream's tower ops in upstream's order; prepare_vision_attention_metadata on host "
                     "cu_seqlens, as upstream hands them on NPU"),
    ),
    summary="Qwen2.5-VL's tower builds its window and image bounds on the host and copies its window index "
            "non-blocking: 0 reads and 0 blocking host->device copies per forward (upstream: 3 and 4)",
    # 0: what this patch is for; a read is the defect back.
    selftest=Selftest("npu_shim.selftest.sglang_tower:run", host_syncs=0, arguments={"tower": "Qwen2.5-VL"}),
    defect=Defect("sglang's Qwen2.5-VL tower reads its window and image bounds back from the device",
                  shows="reads"),
)
