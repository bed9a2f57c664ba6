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
How: ``Qwen2_5_VisionTransformer.forward`` is replaced, on NPU, by upstream's body with
  the bounds built where upstream ends up wanting them, on the host: the window bounds
  deduplicated there (``torch.unique_consecutive`` of the same int32 values), the image
  bounds concatenated there (the same two ``torch.cat`` and the same cumulative sum), and
  the window index copied with ``non_blocking=True``. Every op on the data path (patch
  embedding, rotary table, the window gather, the blocks, the merger, the reverse gather)
  is upstream's, in upstream's order, with the same arguments; the blocks get the same
  ``cu_seqlens`` values on the host, as upstream hands them on NPU (0.5.16+: through
  ``prepare_vision_attention_metadata``, which ``sglang.vision_host_lengths`` serves with 0
  reads). 0 reads and 0 blocking copies per forward. The ViT graph path
  (``enable_cg``), a grid not on the host, and a host that is not an NPU go to upstream's
  forward.
  ``check`` accepts only the bodies the replacement was written from: the forward and
  ``get_window_index`` (whose host list and host index it relies on) must hash to bodies read
  in the wheels (source parsed, docstring and comments left out).
Upstream fix: none (0.5.23).
Remove when: sglang's Qwen2.5-VL tower keeps its bounds on the host on NPU.
"""

from npu_shim.patch import Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.host_data import host_grid_tensor
from npu_shim.patches._shared.structure import expect_body, module_class, own_function, replace_own

TARGET = "sglang.srt.models.qwen2_5_vl"
TOWER = "Qwen2_5_VisionTransformer"
FORWARD = TOWER + ".forward"

# body_digest of the upstream bodies the replacement was written from
FORWARD_BEFORE_METADATA = {"f09cc0024a6f"}     # the releases family before-metadata was read in
FORWARD_METADATA = {"14d2ed9f5246"}            # the releases family metadata was read in
GET_WINDOW_INDEX = {"983046406cbe"}            # every release read (docs/reference.md)
MODULE_NAMES = ("is_npu", "permute_inv")


class _Tower:
    """One shape of the tower's forward: ``metadata`` -- it builds the vision attention metadata
    (0.5.16+) and hands it to the blocks."""

    def __init__(self, digests, metadata):
        self.digests, self.metadata = digests, metadata

    def check(self, module, context):
        tower = module_class(module, TOWER)
        expect_body(own_function(tower, "forward"), self.digests, "the %s replacement" % context.patch)
        expect_body(own_function(tower, "get_window_index"), GET_WINDOW_INDEX, "the %s replacement" % context.patch)
        names = MODULE_NAMES + (("prepare_vision_attention_metadata",) if self.metadata else ())
        missing = [name for name in names if not callable(getattr(module, name, None))]
        if missing:
            raise TargetMismatch("%s lacks %s" % (TARGET, ", ".join(missing)))

    def build(self, module, context):
        return {FORWARD: replace_own(module, TOWER, "forward", self.make_forward, context,
                                     "window and image bounds built on the host, the window index "
                                     "copied non-blocking (no read, no blocking copy)")}

    def make_forward(self, module, original, context):
        import torch

        metadata = self.metadata

        def forward(self, x, grid_thw):
            context.count("calls")
            if self.enable_cg or not host_grid_tensor(grid_thw) or not module.is_npu():
                context.count("upstream_calls")
                return original(self, x, grid_thw)
            context.count("upstream_host_copies")    # upstream: 3 reads here
            x = x.to(device=self.device, dtype=self.dtype)
            x = self.patch_embed(x)

            rotary_pos_emb = self.rot_pos_emb(grid_thw)

            window_index, cu_window_seqlens = self.get_window_index(grid_thw)
            # upstream: to the device (a blocking copy), deduplicated there (a read), back to "cpu"
            # on NPU (a read); the same int32 values, deduplicated on the host
            cu_window_seqlens = torch.unique_consecutive(torch.tensor(cu_window_seqlens, dtype=torch.int32))

            window_index = window_index.to(device=x.device, non_blocking=True)
            reverse_indices = module.permute_inv(window_index)

            rotary_pos_emb = rotary_pos_emb.to(device=x.device, dtype=x.dtype)

            seq_len, _ = x.size()

            x = x.reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
            x = x[window_index, :, :]
            x = x.reshape(seq_len, -1)
            rotary_pos_emb = rotary_pos_emb.reshape(seq_len // self.spatial_merge_unit, self.spatial_merge_unit, -1)
            rotary_pos_emb = rotary_pos_emb[window_index, :, :]
            rotary_pos_emb = rotary_pos_emb.reshape(seq_len, -1)
            emb = torch.cat((rotary_pos_emb, rotary_pos_emb), dim=-1)
            position_embeddings = (emb.cos(), emb.sin())
            position_embeddings = (
                position_embeddings[0].to(x.device, x.dtype),
                position_embeddings[1].to(x.device, x.dtype),
            )

            # upstream builds these on the device (two blocking copies) and moves them to "cpu" on
            # NPU (a read): the same values, built on the host
            cu_seqlens = torch.cat([
                torch.tensor([0], dtype=torch.int32),
                (grid_thw[:, 0] * grid_thw[:, 1] * grid_thw[:, 2]).cumsum(dim=0).to(dtype=torch.int32),
            ])
            cu_seqlens = torch.cat([cu_seqlens.new_zeros(1), cu_seqlens])

            if metadata:
                full_metadata = module.prepare_vision_attention_metadata(cu_seqlens, device=x.device)
                window_metadata = module.prepare_vision_attention_metadata(cu_window_seqlens, device=x.device)

            x = x.unsqueeze(1)
            for layer_num, blk in enumerate(self.blocks):
                fullatt_indexes = self.fullatt_block_indexes
                if isinstance(fullatt_indexes, torch.Tensor):
                    fullatt_indexes = fullatt_indexes.tolist()
                if layer_num in fullatt_indexes:
                    cu_seqlens_now = cu_seqlens
                    extra = {"forward_metadata": full_metadata} if metadata else {}
                else:
                    cu_seqlens_now = cu_window_seqlens
                    extra = {"forward_metadata": window_metadata} if metadata else {}
                x = blk(x, cu_seqlens=cu_seqlens_now, position_embeddings=position_embeddings, **extra)

            x = self.merger(x)
            x = x[reverse_indices, :]
            return x

        return forward


BEFORE_METADATA = _Tower(FORWARD_BEFORE_METADATA, metadata=False)
METADATA = _Tower(FORWARD_METADATA, metadata=True)

PATCH = Patch(
    name="sglang.qwen2_5_vl_host_lengths",
    target=TARGET,
    replaces=(FORWARD,),
    requires={"sglang": ">=0.5.11"},
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
)
