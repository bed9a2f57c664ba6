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
How: ``rot_pos_emb`` is replaced, on NPU with a host grid, by upstream's body with the ids moved
  to the table's device with ``non_blocking=True`` before the same indexing, the rule every host
  copy of the shim's tower patches follows (``sglang.qwen2_5_vl_host_lengths`` copies the window
  index so). The ids, the table (upstream's own statement of the release, one family each) and the
  ``flatten(1)`` are upstream's, in upstream's order: the output is ``torch.equal`` to upstream's.
  A grid not on the host, and a host that is not an NPU, go to upstream's method. ``check`` accepts
  only the bodies the replacement was written from (source parsed, docstring and comments left out,
  hashed): 0.5.11 - 0.5.14 size the table by ``grid_thw[:, 1:].max()``, 0.5.15 - 0.5.23 by
  ``torch.arange(int(grid_thw[:, 1:].max()), device=self.device)``.
Upstream fix: none (0.5.23).
Remove when: sglang's Qwen2.5-VL tower moves its rotary ids to the device itself without blocking.
"""

from npu_shim.patch import Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.host_data import host_grid_tensor
from npu_shim.patches._shared.structure import expect_body, module_class, own_function, replace_own

TARGET = "sglang.srt.models.qwen2_5_vl"
TOWER = "Qwen2_5_VisionTransformer"
METHOD = "rot_pos_emb"

# body_digest of the upstream bodies the replacement was written from
ROT_POS_EMB_BY_SIZE = {"5dd2b19f3308"}         # the releases family table-by-size was read in
ROT_POS_EMB_BY_POSITIONS = {"c1f5e64ea25d"}    # the releases family table-by-positions was read in


def _table_by_size(tower, grid_thw):
    max_grid_size = grid_thw[:, 1:].max()
    return tower.rotary_pos_emb(max_grid_size)


def _table_by_positions(tower, grid_thw):
    import torch

    max_grid_size = int(grid_thw[:, 1:].max())
    return tower.rotary_pos_emb(torch.arange(max_grid_size, device=tower.device))


class _RotaryIds:
    """One shape of ``rot_pos_emb``: ``table`` is upstream's statement that builds the rotary
    table from the grid, the only line that differs between the releases."""

    def __init__(self, digests, table):
        self.digests, self.table = digests, table

    def check(self, module, context):
        expect_body(own_function(module_class(module, TOWER), METHOD), self.digests,
                    "the %s replacement" % context.patch)
        if not callable(getattr(module, "is_npu", None)):
            raise TargetMismatch("%s lacks is_npu" % TARGET)

    def build(self, module, context):
        return {TOWER + "." + METHOD: replace_own(module, TOWER, METHOD, self.make, context,
                                                  "the host position ids copied to the device "
                                                  "non-blocking (no blocking copy)")}

    def make(self, module, original, context):
        import torch

        table_of = self.table

        def rot_pos_emb(self, grid_thw):
            context.count("calls")
            if not host_grid_tensor(grid_thw) or not module.is_npu():
                context.count("upstream_calls")
                return original(self, grid_thw)
            pos_ids = []
            for t, h, w in grid_thw:
                base = self.rot_pos_ids(h, w, self.spatial_merge_size)
                pos_ids.append(base if t == 1 else base.repeat(t, 1))
            pos_ids = torch.cat(pos_ids, dim=0)
            rotary_pos_emb_full = table_of(self, grid_thw)
            # upstream indexes the device table with the host ids: a blocking copy of the index
            pos_ids = pos_ids.to(device=rotary_pos_emb_full.device, non_blocking=True)
            return rotary_pos_emb_full[pos_ids].flatten(1)

        return rot_pos_emb


TABLE_BY_SIZE = _RotaryIds(ROT_POS_EMB_BY_SIZE, _table_by_size)
TABLE_BY_POSITIONS = _RotaryIds(ROT_POS_EMB_BY_POSITIONS, _table_by_positions)

PATCH = Patch(
    name="sglang.qwen2_5_vl_rotary_ids",
    target=TARGET,
    replaces=(TOWER + "." + METHOD,),
    requires={"sglang": ">=0.5.11"},
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
)
