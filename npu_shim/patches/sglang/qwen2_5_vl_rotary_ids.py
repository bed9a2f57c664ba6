"""sglang.qwen2_5_vl_rotary_ids — sglang's Qwen2.5-VL tower copies its rotary position ids to the device non-blocking (0.5.11 - 0.5.23).

Why: ``Qwen2_5_VisionTransformer.rot_pos_emb`` builds the position ids of every image on the
  host (``rot_pos_ids`` of the host grid: NumPy, ``torch.from_numpy``), computes the rotary
  table on the device, and indexes the device table with the host ids
  (``rotary_pos_emb_full[pos_ids]``): the index tensor goes to the device first, a blocking
  host->device copy, once per tower forward, before the first token of every image request
  (``models/qwen2_5_vl.py:497`` in 0.5.23). Counted with sglang's own tower on every sglang lane
  (``npu_shim.testing.sglang_towers``), upstream and with ``sglang.qwen2_5_vl_host_lengths``
  alike; on CUDA such an index is a synchronising copy too (benchmarks/results/cuda-syncs.txt,
  "host index into a device tensor").
How: ``rot_pos_emb`` is, on NPU with a host grid, upstream's own method with one statement
  inserted (:func:`npu_shim.patches._shared.source_edit.edit_function`, compiled at upstream's
  file and lines): just after upstream builds the rotary table, ``pos_ids = pos_ids.to(
  device=rotary_pos_emb_full.device, non_blocking=True)``, so the indexing that follows finds the
  ids on the table's device, the rule every host copy of the shim's tower patches follows
  (``sglang.qwen2_5_vl_host_lengths`` copies the window index so). The ids, the table, the
  indexing and the ``flatten(1)`` are upstream's statements, run as upstream wrote them: the
  output is ``torch.equal`` to upstream's. A grid not on the host
  (:func:`npu_shim.patches._shared.host_data.host_grid_tensor`), and a host that is not an NPU,
  go to upstream's method, unedited. The anchor is the statement that builds the table, which is
  what tells the two families apart: ``self.rotary_pos_emb(max_grid_size)`` (sized by the grid's
  largest side) or ``self.rotary_pos_emb(torch.arange(max_grid_size, device=self.device))``.
  ``check`` builds the edited method: the anchor missing, or found more than once, is a
  TargetMismatch naming it.
Upstream fix: none (0.5.23).
Remove when: sglang's Qwen2.5-VL tower moves its rotary ids to the device itself without blocking.
"""

from npu_shim.patch import Defect, Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.host_data import host_grid_tensor
from npu_shim.patches._shared.source_edit import InsertAfter, edit_function
from npu_shim.patches._shared.structure import Edited, edit_of, module_class, own_function, replace_own

TARGET = "sglang.srt.models.qwen2_5_vl"
TOWER = "Qwen2_5_VisionTransformer"
METHOD = "rot_pos_emb"

# the host ids follow the device table they index, without blocking
IDS_TO_THE_TABLE = "pos_ids = pos_ids.to(device=rotary_pos_emb_full.device, non_blocking=True)"


class _RotaryIds:
    """One shape of ``rot_pos_emb``: ``table`` is upstream's statement that builds the rotary
    table, the one line that differs between the releases, and the anchor of the edit."""

    def __init__(self, table):
        self.edits = (InsertAfter(table, IDS_TO_THE_TABLE),)

    def edited(self, module):
        """(upstream's method, the edited one); TargetMismatch where the anchor is not found once."""
        original = own_function(module_class(module, TOWER), METHOD)
        return original, edit_function(original, self.edits)

    def check(self, module, context):
        if not callable(getattr(module, "is_npu", None)):
            raise TargetMismatch("%s lacks is_npu" % TARGET)
        return {TOWER + "." + METHOD: Edited(*self.edited(module))}

    def build(self, module, context):
        return {TOWER + "." + METHOD: replace_own(module, TOWER, METHOD, self.make, context,
                                                  "upstream's method with the host position ids copied to "
                                                  "the table's device non-blocking (no blocking copy)")}

    def make(self, module, original, context):
        edited = edit_of(context, TOWER + "." + METHOD)

        def rot_pos_emb(self, grid_thw):
            context.count("calls")
            if not host_grid_tensor(grid_thw) or not module.is_npu():
                context.count("upstream_calls")
                return original(self, grid_thw)
            return edited(self, grid_thw)

        return rot_pos_emb


TABLE_BY_SIZE = _RotaryIds("rotary_pos_emb_full = self.rotary_pos_emb(max_grid_size)")
TABLE_BY_POSITIONS = _RotaryIds(
    "rotary_pos_emb_full = self.rotary_pos_emb(torch.arange(max_grid_size, device=self.device))")

PATCH = Patch(
    name="sglang.qwen2_5_vl_rotary_ids",
    target=TARGET,
    replaces=(TOWER + "." + METHOD,),
    requires={"sglang": ""},
    outside_window={"sglang": "releases below the window were not read for this patch"},
    needs_npu=True,
    families=(
        Family(__name__ + ":TABLE_BY_SIZE", fence=">=0.5.11,<0.5.15",
               keeps="rot_pos_ids, self.rotary_pos_emb(grid_thw[:, 1:].max()), the indexing and flatten(1)"),
        Family(__name__ + ":TABLE_BY_POSITIONS", fence=">=0.5.15",
               keeps="rot_pos_ids, self.rotary_pos_emb(torch.arange(..., device=self.device)), the indexing "
                     "and flatten(1)"),
    ),
    summary="Qwen2.5-VL's rot_pos_emb copies its host position ids to the device non-blocking before "
            "indexing the device rotary table: 0 blocking host->device copies there (upstream: 1 per forward)",
    # 0 host synchronisations (reads and blocking copies) over a whole tower forward: a blocking
    # copy of the ids is the defect back.
    selftest=Selftest("npu_shim.selftest.sglang_tower:run_synchronisations", host_syncs=0,
                      arguments={"tower": "Qwen2.5-VL"}),
    defect=Defect("sglang's Qwen2.5-VL tower copies its rotary position ids to the device blocking",
                  shows="reads"),
)
