"""Release families of ``vllm.glm4_1v_host_lengths`` (on ``vllm.model_executor.models.glm4_1v``).

Two replacements are written out in full (the embeddings' forward, every
family; 0.18.0's tower forward) and one more is installed for one call
(0.26.0's ``pos_embeds_interpolate``). Each runs upstream's ops in upstream's
order and differs only in where a number comes from (host, not device) and in
``non_blocking=True`` on the copies; so ``check`` accepts only the very
bodies they were written from: the method's source, docstring and comments
left out, must hash to a body read in the releases the family names. Any other
body is another shape (TargetMismatch), and the embeddings of vLLM 0.28.0 and
later, which already build the sizes on the host, are "not needed".
"""
import inspect
import types

import torch

from npu_shim.patch import NotNeeded, TargetMismatch
from npu_shim.patches.vllm.glm4_1v_host_lengths import EMBEDDINGS, TOWER
from npu_shim.patches._shared import host_record
from npu_shim.patches._shared.code import names_in_code, source_text
from npu_shim.patches._shared.host_record import keep_at_next_copy
from npu_shim.patches._shared.structure import expect_body, own_function

HOST = torch.device("cpu")

# Digests (npu_shim.patches._shared.structure.body_digest) of the upstream bodies the replacements were written from.
EMBEDDINGS_FORWARD = {"090f8cdf22f6"}            # every release read (docs/reference.md)
TOWER_FORWARD_0_18 = {"531813d30257"}            # family copy-then-tolist
POS_EMBEDS_INTERPOLATE = {"fa612a8b4f47"}        # the releases family encoder-metadata was read in
FIXED_UPSTREAM = ("async_tensor_h2d", "np.repeat")   # the host-side sizes of the releases above the window


def _classes(module):
    embeddings, tower = getattr(module, EMBEDDINGS, None), getattr(module, TOWER, None)
    if not isinstance(embeddings, type) or not isinstance(tower, type):
        raise TargetMismatch("%s has no %s / %s classes" % (module.__name__, EMBEDDINGS, TOWER))
    return embeddings, tower


def _host_list(lengths):
    """``lengths`` as a list of host ints, or None where they are not on the host."""
    if isinstance(lengths, torch.Tensor):
        return lengths.tolist() if lengths.device == HOST and lengths.dim() == 1 else None
    if isinstance(lengths, (list, tuple)) and not any(isinstance(n, torch.Tensor) for n in lengths):
        return [int(n) for n in lengths]
    return None


def embeddings_forward(original, context):
    """``Glm4vVisionEmbeddings.forward`` with host ``lengths`` and ``image_shapes``."""
    import torch.nn.functional as F

    def forward(self, embeddings, lengths, image_shapes, h_coords, w_coords):
        host_lengths = _host_list(lengths)
        if host_lengths is None:
            return original(self, embeddings, lengths, image_shapes, h_coords, w_coords)
        pos_embed_weight = self.position_embedding.weight
        hidden_size = pos_embed_weight.shape[1]
        total_seq = h_coords.shape[0]
        device = pos_embed_weight.device

        h_coords = h_coords.to(device, non_blocking=True)
        w_coords = w_coords.to(device, non_blocking=True)

        if total_seq == 0:
            adapted_pos_embed = torch.empty(0, hidden_size, device=device, dtype=pos_embed_weight.dtype)
        else:
            if not isinstance(image_shapes, torch.Tensor):
                # upstream makes this a device tensor (a blocking copy) only to index it on the host's behalf
                image_shapes = torch.tensor(image_shapes, dtype=torch.long)

            orig_size_sq = pos_embed_weight.shape[0]
            orig_size = int(orig_size_sq**0.5)
            pos_embed_2d = (
                pos_embed_weight.view(orig_size, orig_size, hidden_size)
                .permute(2, 0, 1)
                .unsqueeze(0)
                .to(device=device, dtype=torch.float32)
            )

            # upstream's two branches: shapes cycled when there are more lengths (frames) than shapes
            shapes = image_shapes.shape[0]
            rows = [i % shapes if len(host_lengths) > shapes else i for i in range(len(host_lengths))]
            target_h = torch.cat([image_shapes[row, 1].repeat(n) for row, n in zip(rows, host_lengths)]).to(
                device=device, dtype=torch.float32, non_blocking=True)
            target_w = torch.cat([image_shapes[row, 2].repeat(n) for row, n in zip(rows, host_lengths)]).to(
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

        return embeddings + adapted_pos_embed

    return context.present(forward, original, "lengths and image shapes from the host, copies non-blocking")


def tower_forward_0_18(original, context):
    """Family copy-then-tolist's ``Glm4vVisionTransformer.forward`` with ``seqlens`` from the host ``cu_seqlens``."""

    def forward(self, x, grid_thw):
        if isinstance(grid_thw, list):
            grid_thw = torch.tensor(grid_thw, dtype=torch.int32)
        if not isinstance(grid_thw, torch.Tensor) or grid_thw.device != HOST:
            return original(self, x, grid_thw)

        x = x.to(device=self.device, dtype=self.dtype)
        x = self.patch_embed(x)
        x = self.post_conv_layernorm(x)

        rotary_pos_emb_cos, rotary_pos_emb_sin, image_type_ids = self.rot_pos_emb(grid_thw)
        host_cu_seqlens = torch.repeat_interleave(
            grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(dim=0, dtype=torch.int32)
        host_cu_seqlens = torch.cat([host_cu_seqlens.new_zeros(1), host_cu_seqlens])
        # upstream takes .tolist() of the device copy (a read); the host tensor has the same values
        seqlens = (host_cu_seqlens[1:] - host_cu_seqlens[:-1]).tolist()
        cu_seqlens = host_cu_seqlens.to(self.device, non_blocking=True)
        host_record.remember(cu_seqlens, host_cu_seqlens)

        max_seqlen = self.compute_attn_mask_seqlen(cu_seqlens)
        x = self.embeddings(x, seqlens, grid_thw, image_type_ids[:, 0], image_type_ids[:, 1])

        x = x.unsqueeze(1)
        for blk in self.blocks:
            x = blk(
                x,
                cu_seqlens=cu_seqlens,
                rotary_pos_emb_cos=rotary_pos_emb_cos,
                rotary_pos_emb_sin=rotary_pos_emb_sin,
                max_seqlen=max_seqlen,
            )

        x = self.post_layernorm(x)
        x = x.view(-1, self.spatial_merge_size, self.spatial_merge_size, x.shape[-1])
        x = x.permute(0, 3, 1, 2)
        x = self.downsample(x).view(-1, self.out_hidden_size)
        x = self.merger(x)
        return x

    return context.present(forward, original, "seqlens from the host cu_seqlens, the host array kept on its copy")


def host_pos_embeds_interpolate(self, grid_thw):
    """Family encoder-metadata's ``pos_embeds_interpolate`` with the image shape on the host and the
    coordinates copied non-blocking (upstream: ``torch.tensor(..., device=device)`` and
    the embeddings' blocking ``.to(device)``)."""
    device = self.embeddings.position_embedding.weight.device
    dtype = self.dtype
    all_embeds = []
    merge = self.spatial_merge_size
    for t, h, w in grid_thw:
        h_coords = torch.arange(h).unsqueeze(1).expand(-1, w)
        w_coords = torch.arange(w).unsqueeze(0).expand(h, -1)
        h_coords = h_coords.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten()
        w_coords = w_coords.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten()

        lengths = [h * w] * t
        image_shapes = torch.tensor([[t, h, w]])

        h_coords_repeated = h_coords.repeat(t).to(device, non_blocking=True)
        w_coords_repeated = w_coords.repeat(t).to(device, non_blocking=True)

        embeds = self.embeddings(
            embeddings=torch.zeros(h * w * t, self.hidden_size, device=device, dtype=dtype),
            lengths=lengths,
            image_shapes=image_shapes,
            h_coords=h_coords_repeated,
            w_coords=w_coords_repeated,
        )
        all_embeds.append(embeds)
    return torch.cat(all_embeds, dim=0).to(dtype)


def tower_forward_with_host_shapes(original, context):
    """Family encoder-metadata's ``Glm4vVisionTransformer.forward``: for the call that builds its own metadata,
    ``pos_embeds_interpolate`` is :func:`host_pos_embeds_interpolate`."""

    def forward(self, x, grid_thw, *args, **kwargs):
        own = vars(self)
        if args or kwargs.get("encoder_metadata") is not None or "pos_embeds_interpolate" in own:
            return original(self, x, grid_thw, *args, **kwargs)
        # an instance entry for this call only: the encoder-graph path calls
        # prepare_encoder_metadata itself and keeps upstream's
        own["pos_embeds_interpolate"] = types.MethodType(host_pos_embeds_interpolate, self)
        try:
            return original(self, x, grid_thw, *args, **kwargs)
        finally:
            own.pop("pos_embeds_interpolate", None)

    return context.present(forward, original, "the image shapes of its own metadata kept on the host")


def attn_mask_seqlen_keeping_host(original, context):
    def compute_attn_mask_seqlen(self, cu_seqlens):
        result = original(self, cu_seqlens)
        keep_at_next_copy(cu_seqlens)
        return result

    return context.present(compute_attn_mask_seqlen, original, "upstream's, then the host tensor's next copy keeps its values")


def _check_embeddings(embeddings):
    forward = own_function(embeddings, "forward")
    source = source_text(forward)
    if all(name in source for name in FIXED_UPSTREAM):
        raise NotNeeded("%s.forward builds the target sizes on the host (np.repeat) and copies them with "
                        "async_tensor_h2d" % EMBEDDINGS)
    expect_body(forward, EMBEDDINGS_FORWARD, "the embeddings replacement")
    return forward


class _CopyThenTolist:
    """0.18.0: the tower copies ``cu_seqlens`` to the device, then reads ``seqlens`` from the copy."""

    def check(self, module, context):
        embeddings, tower = _classes(module)
        _check_embeddings(embeddings)
        expect_body(own_function(tower, "forward"), TOWER_FORWARD_0_18, "family copy-then-tolist's tower forward")

    def build(self, module, context):
        embeddings, tower = _classes(module)
        return {EMBEDDINGS + ".forward": embeddings_forward(own_function(embeddings, "forward"), context),
                TOWER + ".forward": tower_forward_0_18(own_function(tower, "forward"), context)}


class _TowerCopy:
    """0.19.1 .. 0.23.0: ``seqlens`` from the host tensor, then the tower's own non-blocking copy."""

    ORDER = ("max_seqlen = self.compute_attn_mask_seqlen(cu_seqlens)",
             "seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()",
             "cu_seqlens = cu_seqlens.to(self.device, non_blocking=True)",
             "x = self.embeddings( x, seqlens, grid_thw, image_type_ids[:, 0], image_type_ids[:, 1] )")

    def check(self, module, context):
        embeddings, tower = _classes(module)
        _check_embeddings(embeddings)
        forward = own_function(tower, "forward")
        names = names_in_code(forward.__code__, nested=False)
        if "maybe_recompute_cu_seqlens" in names or "prepare_encoder_metadata" in names:
            raise TargetMismatch("%s.forward builds its metadata elsewhere" % TOWER)
        text = source_text(forward)
        at = [text.find(line) for line in self.ORDER]
        if -1 in at or at != sorted(at):
            raise TargetMismatch("%s.forward does not %s, in that order" % (TOWER, "; ".join(self.ORDER)))
        params = tuple(inspect.signature(own_function(tower, "compute_attn_mask_seqlen")).parameters)
        if params != ("self", "cu_seqlens"):
            raise TargetMismatch("%s.compute_attn_mask_seqlen takes %s" % (TOWER, params))

    def build(self, module, context):
        embeddings, tower = _classes(module)
        return {EMBEDDINGS + ".forward": embeddings_forward(own_function(embeddings, "forward"), context),
                TOWER + ".compute_attn_mask_seqlen": attn_mask_seqlen_keeping_host(
                    own_function(tower, "compute_attn_mask_seqlen"), context)}


class _EncoderMetadata:
    """0.26.0 .. 0.27.1: the eager forward builds its metadata with ``prepare_encoder_metadata``,
    whose ``cu_seqlens`` goes through ``maybe_recompute_cu_seqlens``."""

    def check(self, module, context):
        embeddings, tower = _classes(module)
        _check_embeddings(embeddings)
        forward = own_function(tower, "forward")
        if "encoder_metadata" not in inspect.signature(forward).parameters:
            raise TargetMismatch("%s.forward takes no encoder_metadata" % TOWER)
        if "prepare_encoder_metadata" not in names_in_code(forward.__code__, nested=False):
            raise TargetMismatch("%s.forward does not call prepare_encoder_metadata" % TOWER)
        prepare = own_function(tower, "prepare_encoder_metadata")
        names = names_in_code(prepare.__code__, nested=False)
        if "pos_embeds_interpolate" not in names or "maybe_recompute_cu_seqlens" not in names:
            raise TargetMismatch("%s.prepare_encoder_metadata does not call pos_embeds_interpolate and "
                                 "maybe_recompute_cu_seqlens" % TOWER)
        expect_body(own_function(tower, "pos_embeds_interpolate"), POS_EMBEDS_INTERPOLATE,
                "the pos_embeds_interpolate replacement")

    def build(self, module, context):
        embeddings, tower = _classes(module)
        return {EMBEDDINGS + ".forward": embeddings_forward(own_function(embeddings, "forward"), context),
                TOWER + ".forward": tower_forward_with_host_shapes(own_function(tower, "forward"), context)}


COPY_THEN_TOLIST = _CopyThenTolist()
TOWER_COPY = _TowerCopy()
ENCODER_METADATA = _EncoderMetadata()
