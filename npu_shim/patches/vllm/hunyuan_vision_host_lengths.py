"""vllm.hunyuan_vision_host_lengths — HunYuan-Vision's tower splits its output by the lengths it built on the host.

Why: vLLM's ``HunYuanVisionTransformer.forward`` builds ``cu_seqlens`` on the host
  (``h * w`` per image of the host grid, ``torch.cumsum`` in int32 behind a 0), copies it
  to the device (``cu_seqlens.to(device=self.device, non_blocking=True)``) and, after
  the layers, splits its output with ``(cu_seqlens[1:] - cu_seqlens[:-1]).tolist()`` of
  that copy: 1 device->host read per tower forward, of numbers the host built a few
  lines above (the layers already split by the same host list). The attention runs per
  image without ``cu_seqlens`` and reads nothing, upstream or shim; this read is the
  tower's only one (``docs/towers.md``).
How: ``forward`` is replaced, when the grid is on the host (the model hands the tower
  ``image_grid_thw.tolist()``: a list), by upstream's body with the output split by the
  host ``cu_seqlens``' differences (the values the device copy holds) instead of the
  copy's. Every op on the data path (embeddings, the per-image layer loop, the
  ``perceive`` merger) is upstream's, in upstream's order, with the same arguments; the
  copy to the device is kept as upstream makes it (same op, same arguments; its result
  is no longer read). A grid on the device goes to upstream's forward. 1 -> 0 reads per
  forward (vLLM 0.26.0, census tower, both device classes), output ``torch.equal`` to
  upstream's. ``check`` accepts only the body the replacement was written from (source
  parsed, docstring and comments left out, hashed).
Window: read in the wheels: 0.13.0 .. 0.28.0 have the same ``forward`` body (one digest);
  0.29.0, 0.30.0 and 0.33.0 have no ``hunyuan_vision`` module. Run in every vllm lane from
  vllm-0.14 to vllm-0.28 (transformers 5.5 - 5.13 gate ``AutoImageProcessor`` on torchvision,
  with which vLLM 0.19 - 0.25's HunYuan processor module registers at import: the census
  stands in an import-only registry there, ``npu_shim.testing.towers``). 0.13.0 is not
  claimed: the census cannot build its towers (``outside_window``).
Upstream fix: none.
Remove when: the pinned vLLM is 0.29.0 or later (no ``hunyuan_vision`` module), or the tower
  splits by its host lengths.
"""

from npu_shim.patch import Family, Patch, Selftest
from npu_shim.patches._shared.structure import expect_body, module_class, own_function, replace_own

TARGET = "vllm.model_executor.models.hunyuan_vision"
TOWER = "HunYuanVisionTransformer"
FORWARD = TOWER + ".forward"


def host_grid(grid_thw):
    """Whether the tower can read ``grid_thw``'s sizes without a device read: a list (what
    vLLM's model hands it) or a CPU tensor."""
    import torch

    if isinstance(grid_thw, (list, tuple)):
        return all(not isinstance(size, torch.Tensor) or size.device.type == "cpu"
                   for item in grid_thw for size in item)
    return isinstance(grid_thw, torch.Tensor) and grid_thw.device.type == "cpu"


class _Tower:
    def __init__(self, digests):
        self.digests = digests

    def check(self, module, context):
        expect_body(own_function(module_class(module, TOWER), "forward"), self.digests,
                    "the %s replacement" % context.patch)

    def build(self, module, context):
        return {FORWARD: replace_own(module, TOWER, "forward", self.make_forward, context,
                                     "the output split by the host cu_seqlens the tower built (no read back)")}

    def make_forward(self, module, original, context):
        import torch

        def forward(self, x, grid_thw):
            context.count("calls")
            if not host_grid(grid_thw):
                context.count("upstream_calls")
                return original(self, x, grid_thw)
            seq_len = x.size(0)
            hidden_states = self.embeddings(x.to(device=self.device, dtype=self.dtype), grid_thw)

            sizes = [0] + [int(h) * int(w) for _, h, w in grid_thw]
            cu_seqlens = torch.cumsum(torch.tensor(sizes, dtype=torch.int32), dim=0, dtype=torch.int32)
            # upstream's copy, as upstream makes it; upstream reads its split sizes back from it
            cu_seqlens.to(device=self.device, non_blocking=True)

            hidden_states = hidden_states.reshape(seq_len, -1).unsqueeze(0)
            image_lengths = sizes[1:]
            for layer in self.layers:
                parts = hidden_states.split(image_lengths, dim=1)
                hidden_states = torch.cat([layer(part) for part in parts], dim=1)

            split_lengths = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()    # the host tensor's
            items = hidden_states.split(split_lengths, dim=1)
            return [self.perceive(item.contiguous(), size=grid[1:]).squeeze(0)
                    for grid, item in zip(grid_thw, items)]

        return forward


# body_digest of the upstream body the replacement was written from (every release read)
FORWARD_0_13 = {"20663de2126c"}

HOST_SPLIT = _Tower(FORWARD_0_13)

PATCH = Patch(
    name="vllm.hunyuan_vision_host_lengths",
    target=TARGET,
    replaces=(FORWARD,),
    requires={"vllm": ">=0.14.0,<0.29.0"},
    outside_window={"vllm": "the release below the window has the same forward, but its towers cannot be built here (its "
                            "MMEncoderAttention lives in vllm.attention.layers, which the census harness does "
                            "not route): not run, not claimed; earlier releases were not read for this patch; "
                            "above the window vLLM has no hunyuan_vision module (as far as read)"},
    needs_npu=True,
    families=(
        Family(__name__ + ":HOST_SPLIT", fence=">=0.14.0,<0.29.0",
               keeps="upstream's tower ops in upstream's order; cu_seqlens.to(device=self.device, non_blocking=True)"),
    ),
    summary="HunYuan-Vision's tower splits its output by the host cu_seqlens it built instead of reading its "
            "device copy back: 0 reads per forward (upstream: 1)",
    # 0: what this patch is for; a read is the defect back.
    selftest=Selftest("npu_shim.selftest.vllm_census_tower:run", host_syncs=0,
                      arguments={"tower": "HunYuan-Vision"}),
)
