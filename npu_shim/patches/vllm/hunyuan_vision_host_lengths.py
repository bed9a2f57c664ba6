"""vllm.hunyuan_vision_host_lengths — HunYuan-Vision's tower splits its output by the lengths it built on the host.

Why: vLLM's ``HunYuanVisionTransformer.forward`` builds ``cu_seqlens`` on the host
  (``h * w`` per image of the host grid, ``torch.cumsum`` in int32 behind a 0), copies it
  to the device (``cu_seqlens.to(device=self.device, non_blocking=True)``) and, after
  the layers, splits its output with ``(cu_seqlens[1:] - cu_seqlens[:-1]).tolist()`` of
  that copy: 1 device->host read per tower forward, of numbers the host built a few
  lines above (the layers already split by the same host list). The attention runs per
  image without ``cu_seqlens`` and reads nothing, upstream or shim; this read is the
  tower's only one (``docs/towers.md``).
How: ``forward`` becomes upstream's own, edited
  (:func:`npu_shim.patches._shared.source_edit.edit_function`) by two edits: the host
  ``cu_seqlens`` is kept under another name just before upstream copies it to the device
  (``cu_seqlens = cu_seqlens.to(device=self.device, non_blocking=True)``, kept as upstream makes
  it), and the split sizes are the host tensor's differences (the values the device copy holds),
  not the copy's: ``(cu_seqlens[1:] - cu_seqlens[:-1]).tolist()`` reads the host tensor. Every op
  on the data path (embeddings, the per-image layer loop, the ``perceive`` merger) is upstream's
  statement, compiled at upstream's lines: output ``torch.equal`` to upstream's. A grid that is
  not host data (a list of integers or host tensors, or a host tensor,
  :func:`npu_shim.patches._shared.host_data.is_host`: a device stand-in is not host) goes to
  upstream's forward. 1 -> 0 reads per forward (census tower, both device classes). ``check``
  builds the edit: a forward without either anchor, or with one of them more than once, is
  another shape (TargetMismatch naming the anchor).
Window: read in the wheels: 0.13.0 .. 0.28.0 have the same ``forward`` body;
  0.29.0, 0.30.0 and 0.33.0 have no ``hunyuan_vision`` module. Run in every vllm lane from
  vllm-0.14 to vllm-0.28 (transformers 5.5 - 5.13 gate ``AutoImageProcessor`` on torchvision,
  with which vLLM 0.19 - 0.25's HunYuan processor module registers at import: the census
  stands in an import-only registry there, ``npu_shim.testing.towers``). 0.13.0 is not
  claimed: the census cannot build its towers (``outside_window``).
Upstream fix: none.
Remove when: the pinned vLLM is 0.29.0 or later (no ``hunyuan_vision`` module), or the tower
  splits by its host lengths.
"""

from npu_shim.patch import Defect, Family, Patch, Selftest
from npu_shim.patches._shared.host_data import is_host
from npu_shim.patches._shared.source_edit import InsertBefore, ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import Edited, edit_of, module_class, own_function, replace_own

TARGET = "vllm.model_executor.models.hunyuan_vision"
TOWER = "HunYuanVisionTransformer"
FORWARD = TOWER + ".forward"


# The fix: the split sizes from the host cu_seqlens, not from its device copy.
HOST_SPLIT_SIZES = (
    InsertBefore("cu_seqlens = cu_seqlens.to(device=self.device, non_blocking=True)",
                 "host_cu_seqlens = cu_seqlens"),
    ReplaceExpression("(cu_seqlens[1:] - cu_seqlens[:-1]).tolist()",
                      "(host_cu_seqlens[1:] - host_cu_seqlens[:-1]).tolist()"),
)


def host_grid(grid_thw):
    """Whether the tower can read ``grid_thw``'s sizes without a device read: a list (what
    vLLM's model hands it) of integers or host tensors, or a host tensor."""
    import torch

    if isinstance(grid_thw, (list, tuple)):
        return all(not isinstance(size, torch.Tensor) or is_host(size) for item in grid_thw for size in item)
    return is_host(grid_thw)


class _Tower:
    def check(self, module, context):
        original = own_function(module_class(module, TOWER), "forward")
        return {FORWARD: Edited(original, edit_function(original, HOST_SPLIT_SIZES))}

    def build(self, module, context):
        return {FORWARD: replace_own(module, TOWER, "forward", self.make_forward, context,
                                     "the output split by the host cu_seqlens the tower built (no read back)")}

    def make_forward(self, module, original, context):
        edited = edit_of(context, FORWARD)

        def forward(self, x, grid_thw):
            context.count("calls")
            if not host_grid(grid_thw):
                context.count("upstream_calls")
                return original(self, x, grid_thw)
            return edited(self, x, grid_thw)

        return forward


HOST_SPLIT = _Tower()

PATCH = Patch(
    name="vllm.hunyuan_vision_host_lengths",
    target=TARGET,
    replaces=(FORWARD,),
    requires={"vllm": ""},
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
    defect=Defect("HunYuan-Vision's tower splits its output by lengths read back from the device",
                  shows="reads"),
)
