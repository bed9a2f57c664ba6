"""vllm.dots_ocr_host_lengths — dots.ocr's vision tower builds its lengths from the host grid it is handed.

Why: the model hands ``DotsVisionTransformer.forward`` the grid as a host list
  (``grid_thw.tolist()``). The tower copies that list to the device (``torch.tensor(grid_thw,
  device=...)``: a blocking copy), builds ``cu_seqlens`` there with ``repeat_interleave`` by the
  device frame counts (an output size read back: 1 read), and vllm-ascend's attention (with
  ``vllm.mm_encoder_attn``) reads the result back (1 read; upstream: 1 per layer). Its
  ``rot_pos_emb`` indexes the device rotary table with position ids built on the host (the index
  goes over first: a blocking copy). Per forward: 2 reads and 2 blocking copies with the other
  patches, upstream 1 + 1 per layer and 2, every number from a list the host holds
  (``dots_ocr.py:559``/``:563`` in 0.26.0/0.30.0, counted with vLLM's own tower,
  :mod:`npu_shim.testing.census`).
How: for a host grid list (:func:`npu_shim.patches._shared.host_data.host_grid`), ``forward``
  becomes upstream's own, edited (:func:`npu_shim.patches._shared.source_edit.edit_function`) where
  it takes its numbers: the grid tensor is made on the host and copied with ``non_blocking=True``
  (upstream: ``torch.tensor(grid_thw, device=...)``); the ``cu_seqlens`` statement reads that host
  grid's columns, so upstream's ``repeat_interleave``, int32 ``cumsum`` and leading 0 run on the
  host, and the result is copied with ``non_blocking=True``, the host tensor kept on the copy
  (:func:`npu_shim.patches._shared.host_record.remember`), which the attention takes instead of
  reading back; ``rot_pos_emb`` is upstream's, edited to move its host ids to the table's device
  with ``non_blocking=True`` just before its indexing. ``compute_attn_mask_seqlen``, the blocks,
  ``post_trunk_norm`` and the merger are upstream's statements, compiled at upstream's lines, on
  the same values: the output is ``torch.equal`` to upstream's. A grid that is not a host list, and
  a traced call, go to upstream's forward. ``check`` builds both edits; the two families differ by
  the name of the device grid in their anchors (``grid_thw`` / ``grid_thw_tensor``), and a missing
  anchor is another shape (TargetMismatch naming it).
Window: read in the wheels: 0.14.1, 0.15.0, 0.16.0, 0.17.0, 0.18.0, 0.19.1, 0.20.2, 0.21.0, 0.22.1,
  0.23.0, 0.24.0, 0.25.1, 0.26.0 and 0.27.1 (the device grid named ``grid_thw``) and 0.28.0,
  0.29.0, 0.30.0 and 0.33.0 (the same statements, the device grid named ``grid_thw_tensor``);
  ``rot_pos_emb`` has one body in all of them. Run in the lanes of those
  releases. 0.13.0 has the same forward, but its towers cannot be built here (its
  ``MMEncoderAttention`` lives in ``vllm.attention.layers``): not claimed.
Upstream fix: none (0.33.0).
Remove when: dots.ocr's tower builds ``cu_seqlens`` on the host and copies it through
  ``maybe_recompute_cu_seqlens``, or vllm-ascend's attention takes host lengths from vLLM.
"""

from npu_shim.patch import Defect, Family, Patch, Selftest
from npu_shim.patches._shared import host_data, host_record
from npu_shim.patches._shared.source_edit import InsertAfter, InsertBefore, Replace, ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import Edited, edit_of, module_class, own_function, replace_own

TARGET = "vllm.model_executor.models.dots_ocr"
TOWER = "DotsVisionTransformer"
FORWARD = TOWER + ".forward"

# rot_pos_emb: the host ids go to the table's device without blocking, just before they index it.
IDS_NON_BLOCKING = (
    InsertBefore("rotary_pos_emb = rotary_pos_emb_full[pos_ids].flatten(1)",
                 "pos_ids = pos_ids.to(device=rotary_pos_emb_full.device, non_blocking=True)"),
)


def host_lengths(device_grid):
    """forward's edits where upstream names its device grid ``device_grid``: that grid made on the
    host and copied non-blocking, ``cu_seqlens`` built from the host grid's columns and copied
    non-blocking with the host tensor kept on the copy, and the rotary ids of ``rot_pos_emb``
    edited by :data:`IDS_NON_BLOCKING` (``ids_non_blocking``)."""
    return (
        ReplaceExpression("self.rot_pos_emb(grid_thw)", "ids_non_blocking(self, grid_thw)"),
        Replace("%s = torch.tensor(grid_thw, device=hidden_states.device, dtype=torch.long)" % device_grid,
                "host_grid_thw = torch.tensor(grid_thw, dtype=torch.long)\n"
                "%s = host_grid_thw.to(device=hidden_states.device, non_blocking=True)" % device_grid),
    ) + tuple(ReplaceExpression("%s[:, %d]" % (device_grid, column), "host_grid_thw[:, %d]" % column)
              for column in range(3)) + (
        InsertAfter("cu_seqlens = torch.cat([cu_seqlens.new_zeros(1), cu_seqlens])",
                    "host_cu_seqlens = cu_seqlens\n"
                    "cu_seqlens = cu_seqlens.to(device=hidden_states.device, non_blocking=True)\n"
                    "host_record.remember(cu_seqlens, host_cu_seqlens)"),
    )


def host_list(grid_thw):
    """True for what the model hands the tower: a list of ``[t, h, w]`` host integers."""
    return isinstance(grid_thw, (list, tuple)) and host_data.host_grid(grid_thw) is not None


class _Tower:
    def __init__(self, device_grid):
        self.device_grid = device_grid

    def check(self, module, context):
        tower = module_class(module, TOWER)
        forward = own_function(tower, "forward")
        return {FORWARD: Edited(forward, self.edited(tower, forward))}

    def edited(self, tower, forward):
        """The tower's ``forward`` edited; TargetMismatch naming a missing anchor."""
        ids_non_blocking = edit_function(own_function(tower, "rot_pos_emb"), IDS_NON_BLOCKING)
        return edit_function(forward, self.edits(),
                             names={"ids_non_blocking": ids_non_blocking, "host_record": host_record})

    def edits(self):
        return host_lengths(self.device_grid)

    def build(self, module, context):
        return {FORWARD: replace_own(module, TOWER, "forward", self.make_forward, context,
                                     "lengths and rotary ids from the host grid, copies non-blocking "
                                     "(no read, no blocking copy)")}

    def make_forward(self, module, original, context):
        import torch

        edited = edit_of(context, FORWARD)

        def forward(self, hidden_states, grid_thw):
            context.count("calls")
            if not host_list(grid_thw) or torch.jit.is_tracing():
                context.count("upstream_calls")
                return original(self, hidden_states, grid_thw)
            return edited(self, hidden_states, grid_thw)

        return forward


GRID_THW = _Tower("grid_thw")
GRID_THW_TENSOR = _Tower("grid_thw_tensor")

PATCH = Patch(
    name="vllm.dots_ocr_host_lengths",
    target=TARGET,
    replaces=(FORWARD,),
    requires={"vllm": ""},
    outside_window={"vllm": "the release below the window has the same forward, but its towers cannot be built here (its "
                            "MMEncoderAttention lives in vllm.attention.layers): not run, not claimed; earlier "
                            "releases were not read for this patch"},
    needs_npu=True,
    families=(
        Family(__name__ + ":GRID_THW", fence=">=0.14.0,<0.28.0",
               keeps="upstream's tower ops in upstream's order on host-built lengths; copies non_blocking=True"),
        Family(__name__ + ":GRID_THW_TENSOR", fence=">=0.28.0",
               keeps="upstream's tower ops in upstream's order on host-built lengths; copies non_blocking=True"),
    ),
    summary="dots.ocr's tower builds cu_seqlens from the host grid list and copies it, the grid and its rotary "
            "ids non-blocking: 0 reads and 0 blocking copies per forward (with the other patches: 2 and 2)",
    # 0 host synchronisations (reads and blocking copies) over a whole tower forward.
    selftest=Selftest("npu_shim.selftest.vllm_census_tower:run_synchronisations", host_syncs=0,
                      arguments={"tower": "dots.ocr"}),
    defect=Defect("dots.ocr's vision tower reads back the lengths of the grid it was handed on the host",
                  shows="reads"),
)
