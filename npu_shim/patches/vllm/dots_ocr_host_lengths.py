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
How: ``forward`` is replaced, for a host grid, by upstream's body with the numbers taken from the
  host: the rotary ids copied to the table's device with ``non_blocking=True`` before upstream's
  indexing (``get_pos_ids_by_grid``, ``rotary_pos_emb``, ``flatten(1)``: upstream's
  ``rot_pos_emb`` otherwise); the grid tensor built on the host and copied with
  ``non_blocking=True`` for ``patch_embed``; ``cu_seqlens`` built on the host by the same ops
  (``repeat_interleave``, ``cumsum`` to int32, a leading 0), copied with ``non_blocking=True``,
  and the host tensor kept on the copy (:func:`npu_shim.patches._shared.host_record.remember`),
  which the attention takes instead of reading back. ``compute_attn_mask_seqlen``, the blocks,
  ``post_trunk_norm`` and the merger are upstream's, in upstream's order, on the same values: the
  output is ``torch.equal`` to upstream's. A grid that is not host data, and a traced call, go to
  upstream's forward. ``check`` accepts only the bodies the replacement was written from
  (``forward`` and ``rot_pos_emb``; source parsed, docstring and comments left out, hashed).
Window: read in the wheels: 0.14.1, 0.15.0, 0.16.0, 0.17.0, 0.18.0, 0.19.1, 0.20.2, 0.21.0, 0.22.1,
  0.23.0, 0.24.0, 0.25.1, 0.26.0 and 0.27.1 (one forward body, the device grid named
  ``grid_thw``) and 0.28.0, 0.29.0, 0.30.0 and 0.33.0 (the same statements, the device grid named
  ``grid_thw_tensor``); ``rot_pos_emb`` has one body in all of them. Run in the lanes of those
  releases. 0.13.0 has the same forward, but its towers cannot be built here (its
  ``MMEncoderAttention`` lives in ``vllm.attention.layers``): not claimed.
Upstream fix: none (0.33.0).
Remove when: dots.ocr's tower builds ``cu_seqlens`` on the host and copies it through
  ``maybe_recompute_cu_seqlens``, or vllm-ascend's attention takes host lengths from vLLM.
"""

from npu_shim.patch import Family, Patch, Selftest
from npu_shim.patches._shared import host_record
from npu_shim.patches._shared.structure import expect_body, module_class, own_function, replace_own

TARGET = "vllm.model_executor.models.dots_ocr"
TOWER = "DotsVisionTransformer"
FORWARD = TOWER + ".forward"

# body_digest of the upstream bodies the replacement was written from
FORWARD_GRID_THW = {"99e6b1fe9ad2"}            # the releases family grid-thw was read in
FORWARD_GRID_THW_TENSOR = {"c026f89413d6"}     # the releases family grid-thw-tensor was read in
ROT_POS_EMB = {"f5cadd726f51"}                 # every release read


def host_grid(grid_thw):
    """True for what the model hands the tower: a list of ``[t, h, w]`` host integers."""
    import numbers

    return isinstance(grid_thw, (list, tuple)) and len(grid_thw) > 0 and all(
        isinstance(item, (list, tuple)) and len(item) == 3
        and all(isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in item)
        for item in grid_thw)


class _Tower:
    def __init__(self, digests):
        self.digests = digests

    def check(self, module, context):
        tower = module_class(module, TOWER)
        what = "the %s replacement" % context.patch
        expect_body(own_function(tower, "forward"), self.digests, what)
        expect_body(own_function(tower, "rot_pos_emb"), ROT_POS_EMB, what)

    def build(self, module, context):
        return {FORWARD: replace_own(module, TOWER, "forward", self.make_forward, context,
                                     "lengths and rotary ids from the host grid, copies non-blocking "
                                     "(no read, no blocking copy)")}

    def make_forward(self, module, original, context):
        import torch

        def forward(self, hidden_states, grid_thw):
            context.count("calls")
            if not host_grid(grid_thw) or torch.jit.is_tracing():
                context.count("upstream_calls")
                return original(self, hidden_states, grid_thw)
            # upstream's rot_pos_emb, the host ids copied before the indexing instead of by it
            pos_ids = torch.cat(self.get_pos_ids_by_grid(grid_thw), dim=0)
            max_grid_size = max(max(h, w) for _, h, w in grid_thw)
            rotary_pos_emb_full = self.rotary_pos_emb(max_grid_size)
            pos_ids = pos_ids.to(device=rotary_pos_emb_full.device, non_blocking=True)
            rotary_pos_emb = rotary_pos_emb_full[pos_ids].flatten(1)

            grid_host = torch.tensor(grid_thw, dtype=torch.long)
            grid_thw_tensor = grid_host.to(device=hidden_states.device, non_blocking=True)
            hidden_states = hidden_states.to(self.dtype)
            hidden_states = self.patch_embed(hidden_states, grid_thw_tensor)

            # upstream builds these on the device from the device grid; the same ops on the host
            cu_host = torch.repeat_interleave(grid_host[:, 1] * grid_host[:, 2], grid_host[:, 0]).cumsum(
                dim=0, dtype=torch.int32)
            cu_host = torch.cat([cu_host.new_zeros(1), cu_host])
            cu_seqlens = cu_host.to(device=hidden_states.device, non_blocking=True)
            host_record.remember(cu_seqlens, cu_host)

            max_seqlen = self.compute_attn_mask_seqlen(cu_seqlens)
            for blk in self.blocks:
                hidden_states = blk(hidden_states, cu_seqlens=cu_seqlens, rotary_pos_emb=rotary_pos_emb,
                                    max_seqlen=max_seqlen)

            if self.post_trunk_norm is not None:
                hidden_states = self.post_trunk_norm(hidden_states)

            return self.merger(hidden_states)

        return forward


GRID_THW = _Tower(FORWARD_GRID_THW)
GRID_THW_TENSOR = _Tower(FORWARD_GRID_THW_TENSOR)

PATCH = Patch(
    name="vllm.dots_ocr_host_lengths",
    target=TARGET,
    replaces=(FORWARD,),
    requires={"vllm": ">=0.14.0"},
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
)
