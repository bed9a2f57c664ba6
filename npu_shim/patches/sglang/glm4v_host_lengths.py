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
How: ``Glm4vVisionEmbeddings.forward`` is replaced by upstream's body with host lengths kept
  on the host: the target sizes are repeated there from the host counts and copied with
  ``non_blocking=True``, the coordinates copied with ``non_blocking=True``; the
  interpolation (``F.grid_sample`` over the same sampling grid) and the addition are
  upstream's ops in upstream's order. Lengths that are a device tensor go to upstream's
  forward (the host has no copy). 0 reads and 0 blocking copies per forward.
  ``check`` accepts only the body the replacement was written from (source parsed, docstring
  and comments left out, hashed).
Upstream fix: none (0.5.23). (vLLM fixed its own copy of this code in 0.28.0, host
  ``np.repeat`` and ``async_tensor_h2d``; ``vllm.glm4_1v_host_lengths`` serves vLLM before it.)
Remove when: sglang's GLM-4V embeddings take host lengths as host data.
"""

from npu_shim.patch import Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.structure import expect_body, module_class, own_function, replace_own

TARGET = "sglang.srt.models.glm4v"
EMBEDDINGS = "Glm4vVisionEmbeddings"
FORWARD = EMBEDDINGS + ".forward"

# body_digest of the upstream body the replacement was written from
EMBEDDINGS_FORWARD = {"b370302e4638"}     # every release read (docs/reference.md)


def host_lengths(lengths):
    """``lengths`` as a list of host ints, or None where they are not host data."""
    import torch

    if isinstance(lengths, torch.Tensor):
        device = lengths.device
        if device.type == "cpu" and device.index is None and lengths.dim() == 1:
            return [int(n) for n in lengths.tolist()]
        return None
    if isinstance(lengths, (list, tuple)) and all(isinstance(n, int) for n in lengths):
        return list(lengths)
    return None


class _Embeddings:
    def check(self, module, context):
        expect_body(own_function(module_class(module, EMBEDDINGS), "forward"), EMBEDDINGS_FORWARD,
                    "the %s replacement" % context.patch)
        if not hasattr(getattr(module, "F", None), "grid_sample"):
            raise TargetMismatch("%s has no F.grid_sample" % TARGET)

    def build(self, module, context):
        return {FORWARD: replace_own(module, EMBEDDINGS, "forward", self.make_forward, context,
                                     "host lengths repeated on the host, copies non-blocking "
                                     "(no read, no blocking copy)")}

    def make_forward(self, module, original, context):
        import torch

        def forward(self, embeddings, lengths, image_shapes, h_coords, w_coords):
            context.count("calls")
            counts = host_lengths(lengths)
            if counts is None:
                context.count("upstream_calls")
                return original(self, embeddings, lengths, image_shapes, h_coords, w_coords)
            F = module.F
            pos_embed_weight = self.position_embedding.weight
            hidden_size = pos_embed_weight.shape[1]
            total_seq = h_coords.shape[0]
            device = pos_embed_weight.device

            h_coords = h_coords.to(device, non_blocking=True)
            w_coords = w_coords.to(device, non_blocking=True)

            if total_seq == 0:
                adapted_pos_embed = torch.empty(0, hidden_size, device=device, dtype=pos_embed_weight.dtype)
            else:
                context.count("upstream_host_copies")    # upstream: 2 reads per length here
                if not isinstance(image_shapes, torch.Tensor):
                    # upstream makes this a device tensor (a blocking copy) only to index it per length
                    image_shapes = torch.tensor(image_shapes, dtype=torch.long)

                orig_size_sq = pos_embed_weight.shape[0]
                orig_size = int(orig_size_sq**0.5)
                pos_embed_2d = (
                    pos_embed_weight.view(orig_size, orig_size, hidden_size)
                    .permute(2, 0, 1)
                    .unsqueeze(0)
                    .to(device=device, dtype=torch.float32)
                )

                # upstream's repeat of each image's size by its length, with the host count
                target_h = torch.cat([image_shapes[i, 1].repeat(n) for i, n in enumerate(counts)]).to(
                    device=device, dtype=torch.float32, non_blocking=True)
                target_w = torch.cat([image_shapes[i, 2].repeat(n) for i, n in enumerate(counts)]).to(
                    device=device, dtype=torch.float32, non_blocking=True)

                h_coords = h_coords.to(device=device, dtype=torch.float32)
                w_coords = w_coords.to(device=device, dtype=torch.float32)
                norm_w = ((w_coords + 0.5) / target_w) * 2 - 1
                norm_h = ((h_coords + 0.5) / target_h) * 2 - 1

                grid = torch.stack((norm_w, norm_h), dim=-1).unsqueeze(0).unsqueeze(2)
                interpolated_embed_fp32 = F.grid_sample(
                    pos_embed_2d, grid, mode="bicubic", align_corners=False, padding_mode="border")
                adapted_pos_embed_fp32 = interpolated_embed_fp32.squeeze(0).squeeze(-1).permute(1, 0)
                adapted_pos_embed = adapted_pos_embed_fp32.to(pos_embed_weight.dtype).to(embeddings.device)

            embeddings = embeddings + adapted_pos_embed
            return embeddings

        return forward


EMBEDDINGS_HOST_LENGTHS = _Embeddings()

PATCH = Patch(
    name="sglang.glm4v_host_lengths",
    target=TARGET,
    replaces=(FORWARD,),
    requires={"sglang": ">=0.5.11"},
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
)
