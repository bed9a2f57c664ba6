"""sglang.glm4v_host_lengths — sglang's GLM-4V vision embeddings take their lengths from the host (0.5.11 - 0.5.23).

Why: sglang's GLM-4V tower (``Glm4vVisionModel.forward``) computes the per-image lengths
  on the host (``seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()`` of the host
  ``cu_seqlens`` it built from the host ``grid_thw``) and hands them to
  ``Glm4vVisionEmbeddings.forward``, which copies them to the device (``torch.tensor(lengths,
  device=device)``: a blocking copy) and then uses each element as a repeat count
  (``image_shapes[i, 1].repeat(lengths[i])`` and the same for ``w``,
  ``models/glm4v.py:350,353`` in 0.5.23): 2 device->host reads per image, and the repeated
  host sizes are copied back with a blocking ``.to(device=...)``. Measured with sglang's own
  tower on the lanes (``npu_shim.testing.sglang_towers``): 6 reads and 1 blocking copy per
  forward with three images, in every release 0.5.11 - 0.5.23 (the same body in all of them).
How: ``Glm4vVisionEmbeddings.forward`` is, for host lengths, upstream's own forward with six
  expressions edited (:func:`npu_shim.patches._shared.source_edit.edit_function`, compiled at
  upstream's file and lines): the lengths and the image sizes become host tensors
  (``torch.tensor(lengths, ...)`` and ``torch.tensor(image_shapes, ...)`` lose their
  ``device=device``), so upstream's ``image_shapes[i, 1].repeat(lengths[i])`` runs on the host
  with a host count, and the three copies to the device -- the coordinates' ``.to(device)`` and
  the repeated sizes' ``.to(device=device, dtype=torch.float32)`` -- get ``non_blocking=True``.
  The interpolation (the same sampling grid, ``F.grid_sample`` bicubic) and the addition are
  upstream's statements, run as upstream wrote them; nothing of it is written out here. Lengths
  on a device (:func:`npu_shim.patches._shared.host_data.is_host` says which tensors are on the
  host; a list or tuple of ints is host data) go to upstream's forward, unedited (the host has no
  copy). 0 reads and 0 blocking copies per forward.
  ``check`` builds the edited forward: an anchor missing, or found more than once, is a
  TargetMismatch naming it.
Upstream fix: none (0.5.23). (vLLM fixed its own copy of this code in 0.28.0, host
  ``np.repeat`` and ``async_tensor_h2d``; ``vllm.glm4_1v_host_lengths`` serves vLLM before it.)
Remove when: sglang's GLM-4V embeddings take host lengths as host data.
"""

from npu_shim.patch import Defect, Family, Patch, Selftest
from npu_shim.patches._shared.host_data import is_host
from npu_shim.patches._shared.source_edit import ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import Edited, edit_of, module_class, own_function, replace_own

TARGET = "sglang.srt.models.glm4v"
EMBEDDINGS = "Glm4vVisionEmbeddings"
FORWARD = EMBEDDINGS + ".forward"


def _repeated_sizes(column):
    """upstream's repeat of each image's size (``column`` 1: h, 2: w) by its length, copied to the
    device: the anchor, and the same copy made non-blocking."""
    repeated = "torch.cat([image_shapes[i, %d].repeat(lengths[i]) for i in range(len(lengths))])" % column
    return ReplaceExpression(repeated + ".to(device=device, dtype=torch.float32)",
                             repeated + ".to(device=device, dtype=torch.float32, non_blocking=True)")


# upstream's forward, edited: the lengths and sizes stay on the host, the copies do not block
EDITS = (
    ReplaceExpression("h_coords.to(device)", "h_coords.to(device, non_blocking=True)"),
    ReplaceExpression("w_coords.to(device)", "w_coords.to(device, non_blocking=True)"),
    ReplaceExpression("torch.tensor(lengths, device=device, dtype=torch.long)", "torch.tensor(lengths, dtype=torch.long)"),
    ReplaceExpression("torch.tensor(image_shapes, device=device, dtype=torch.long)",
                      "torch.tensor(image_shapes, dtype=torch.long)"),
    _repeated_sizes(1),
    _repeated_sizes(2),
)


def host_lengths(lengths):
    """True where the host holds ``lengths``: a host tensor, or a list or tuple of ints."""
    if isinstance(lengths, (list, tuple)):
        return all(isinstance(n, int) and not isinstance(n, bool) for n in lengths)
    return is_host(lengths)


class _Embeddings:
    def __init__(self):
        self.edits = EDITS

    def edited(self, module):
        """(upstream's forward, the edited one); TargetMismatch where an anchor is not found once."""
        original = own_function(module_class(module, EMBEDDINGS), "forward")
        return original, edit_function(original, self.edits)

    def check(self, module, context):
        return {FORWARD: Edited(*self.edited(module))}

    def build(self, module, context):
        return {FORWARD: replace_own(module, EMBEDDINGS, "forward", self.make_forward, context,
                                     "upstream's forward with host lengths and sizes kept on the host, "
                                     "the copies non-blocking (no read, no blocking copy)")}

    def make_forward(self, module, original, context):
        edited = edit_of(context, FORWARD)

        def forward(self, embeddings, lengths, image_shapes, h_coords, w_coords):
            context.count("calls")
            if not host_lengths(lengths):
                context.count("upstream_calls")
                return original(self, embeddings, lengths, image_shapes, h_coords, w_coords)
            context.count("upstream_host_copies")    # upstream: 2 reads per length here
            return edited(self, embeddings, lengths, image_shapes, h_coords, w_coords)

        return forward


EMBEDDINGS_HOST_LENGTHS = _Embeddings()

PATCH = Patch(
    name="sglang.glm4v_host_lengths",
    target=TARGET,
    replaces=(FORWARD,),
    requires={"sglang": ""},
    outside_window={"sglang": "releases below the window were not read for this patch"},
    needs_npu=True,
    families=(
        Family(__name__ + ":EMBEDDINGS_HOST_LENGTHS",
               fence=">=0.5.11",
               keeps="upstream's embedding ops in upstream's order (repeat, cat, grid_sample bicubic, add)"),
    ),
    summary="GLM-4V's vision embeddings repeat the image sizes by the host lengths on the host and copy "
            "non-blocking: 0 reads and 0 blocking host->device copies per forward (upstream: 2 reads per "
            "image and 1 copy)",
    # 0: what this patch is for; a read is the defect back.
    selftest=Selftest("npu_shim.selftest.sglang_tower:run", host_syncs=0, arguments={"tower": "GLM-4V"}),
    defect=Defect("sglang's GLM-4V vision embeddings read their lengths back from the device", shows="reads"),
)
