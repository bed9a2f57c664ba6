"""Release families of ``vllm.glm4_1v_host_lengths`` (on ``vllm.model_executor.models.glm4_1v``).

Each replacement is upstream's own method edited
(:func:`npu_shim.patches._shared.source_edit.edit_function`) where it takes a number from the
device or copies with blocking: the embeddings' forward (every family: :data:`HOST_LENGTHS`), the
tower's forward of the copy-then-tolist shape (:data:`SEQLENS_FROM_HOST`) and
``pos_embeds_interpolate`` of the encoder-metadata shape (:data:`HOST_IMAGE_SHAPE`, installed for
one call). Every other statement is upstream's, compiled at upstream's lines. ``check`` builds the
edits: a method without an anchor (or with one more often than the edit counts) is another shape
(TargetMismatch naming the anchor), and the embeddings that already build the sizes on the host
are "not needed".
"""
import inspect
import types

from npu_shim.patch import NotNeeded, TargetMismatch
from npu_shim.patches.vllm.glm4_1v_host_lengths import EMBEDDINGS, TOWER
from npu_shim.patches._shared import host_record
from npu_shim.patches._shared.code import names_in_code, source_text
from npu_shim.patches._shared.host_data import host_grid, is_host
from npu_shim.patches._shared.host_record import keep_at_next_copy
from npu_shim.patches._shared.source_edit import InsertAfter, InsertBefore, Replace, ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import Edited, own_function

FIXED_UPSTREAM = ("async_tensor_h2d", "np.repeat")   # the embeddings that build the sizes on the host

# Glm4vVisionEmbeddings.forward, handed host lengths: they stay a host list (upstream makes them a
# device tensor and reads each element back as a repeat count); a list of image shapes is made on
# the host, and the shapes and the coordinates reach the device with non-blocking copies.
HOST_LENGTHS = (
    ReplaceExpression("h_coords.to(device)", "h_coords.to(device, non_blocking=True)"),
    ReplaceExpression("w_coords.to(device)", "w_coords.to(device, non_blocking=True)"),
    Replace("lengths = torch.tensor(lengths, device=device, dtype=torch.long)", ""),
    ReplaceExpression("torch.tensor(image_shapes, device=device, dtype=torch.long)",
                      "torch.tensor(image_shapes, dtype=torch.long)"),
    InsertBefore("orig_size_sq = pos_embed_weight.shape[0]",
                 "image_shapes = image_shapes.to(device, non_blocking=True)"),
)

# The tower's forward that copies cu_seqlens to the device and then reads seqlens from the copy:
# seqlens from the host tensor (the same values), which is kept on the copy for the attention.
SEQLENS_FROM_HOST = (
    InsertBefore("cu_seqlens = cu_seqlens.to(self.device, non_blocking=True)", "host_cu_seqlens = cu_seqlens"),
    InsertAfter("cu_seqlens = cu_seqlens.to(self.device, non_blocking=True)",
                "host_record.remember(cu_seqlens, host_cu_seqlens)"),
    ReplaceExpression("(cu_seqlens[1:] - cu_seqlens[:-1]).tolist()",
                      "(host_cu_seqlens[1:] - host_cu_seqlens[:-1]).tolist()"),
)

# pos_embeds_interpolate (encoder-metadata shape): the image shape it hands the embeddings made on
# the host (upstream makes it on the device, a blocking copy); the embeddings edited by
# HOST_LENGTHS copy it, and the coordinates, non-blocking.
HOST_IMAGE_SHAPE = (
    ReplaceExpression("torch.tensor([[t, h, w]], device=device)", "torch.tensor([[t, h, w]])"),
)


def _classes(module):
    embeddings, tower = getattr(module, EMBEDDINGS, None), getattr(module, TOWER, None)
    if not isinstance(embeddings, type) or not isinstance(tower, type):
        raise TargetMismatch("%s has no %s / %s classes" % (module.__name__, EMBEDDINGS, TOWER))
    return embeddings, tower


def host_lengths(lengths):
    """``lengths`` as a list of host ints, or None where they are not host data (a 1-D host
    tensor, or a list or tuple of ints)."""
    import numbers

    if is_host(lengths):
        return lengths.tolist() if lengths.dim() == 1 and not lengths.is_floating_point() else None
    if isinstance(lengths, (list, tuple)) and all(
            isinstance(n, numbers.Integral) and not isinstance(n, bool) for n in lengths):
        return [int(n) for n in lengths]
    return None


def embeddings_forward(checked, context):
    """``Glm4vVisionEmbeddings.forward`` edited by :data:`HOST_LENGTHS` (the check's edit) for host ``lengths``."""
    original, edited = checked

    def forward(self, embeddings, lengths, image_shapes, h_coords, w_coords):
        context.count("calls")
        host = host_lengths(lengths)
        if host is None:
            context.count("upstream_calls")
            return original(self, embeddings, lengths, image_shapes, h_coords, w_coords)
        return edited(self, embeddings, host, image_shapes, h_coords, w_coords)

    return context.present(forward, original, "lengths kept on the host, image shapes and coordinates "
                                              "copied non-blocking")


def tower_forward_seqlens_from_host(checked, context):
    """The copy-then-tolist tower forward edited by :data:`SEQLENS_FROM_HOST` (the check's edit) for a host grid."""
    original, edited = checked

    def forward(self, x, grid_thw):
        context.count("calls")
        if host_grid(grid_thw) is None:
            context.count("upstream_calls")
            return original(self, x, grid_thw)
        return edited(self, x, grid_thw)

    return context.present(forward, original, "seqlens from the host cu_seqlens, the host array kept on its copy")


def tower_forward_with_host_shapes(original, pos_embeds_interpolate, context):
    """The encoder-metadata tower forward: for the call that builds its own metadata,
    ``pos_embeds_interpolate`` is upstream's edited by :data:`HOST_IMAGE_SHAPE` (the check's
    :class:`Edited`)."""
    edited = pos_embeds_interpolate.edited

    def forward(self, x, grid_thw, *args, **kwargs):
        own = vars(self)
        if args or kwargs.get("encoder_metadata") is not None or "pos_embeds_interpolate" in own:
            return original(self, x, grid_thw, *args, **kwargs)
        # an instance entry for this call only: the encoder-graph path calls
        # prepare_encoder_metadata itself and keeps upstream's
        own["pos_embeds_interpolate"] = types.MethodType(edited, self)
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
    return {EMBEDDINGS + ".forward": Edited(forward, edit_function(forward, HOST_LENGTHS))}


def _in_order(function, statements):
    """TargetMismatch unless ``function``'s source holds ``statements`` (white space folded), in that order."""
    text = source_text(function)
    at = [text.find(statement) for statement in statements]
    if -1 in at or at != sorted(at):
        raise TargetMismatch("%s does not %s, in that order" % (function.__qualname__, "; ".join(statements)))


class _CopyThenTolist:
    """The tower copies ``cu_seqlens`` to the device, then reads ``seqlens`` from the copy."""

    ORDER = ("cu_seqlens = cu_seqlens.to(self.device, non_blocking=True)",
             "seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()")

    def check(self, module, context):
        embeddings, tower = _classes(module)
        found = _check_embeddings(embeddings)
        forward = own_function(tower, "forward")
        _in_order(forward, self.ORDER)          # the other order reads the host tensor already
        found[TOWER + ".forward"] = Edited(forward, edit_function(forward, SEQLENS_FROM_HOST,
                                                                  names={"host_record": host_record}))
        return found

    def build(self, module, context):
        return {EMBEDDINGS + ".forward": embeddings_forward(context.found[EMBEDDINGS + ".forward"], context),
                TOWER + ".forward": tower_forward_seqlens_from_host(context.found[TOWER + ".forward"], context)}


class _TowerCopy:
    """0.19.1 .. 0.23.0: ``seqlens`` from the host tensor, then the tower's own non-blocking copy."""

    ORDER = ("max_seqlen = self.compute_attn_mask_seqlen(cu_seqlens)",
             "seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()",
             "cu_seqlens = cu_seqlens.to(self.device, non_blocking=True)",
             "x = self.embeddings( x, seqlens, grid_thw, image_type_ids[:, 0], image_type_ids[:, 1] )")

    def check(self, module, context):
        embeddings, tower = _classes(module)
        found = _check_embeddings(embeddings)
        forward = own_function(tower, "forward")
        names = names_in_code(forward.__code__, nested=False)
        if "maybe_recompute_cu_seqlens" in names or "prepare_encoder_metadata" in names:
            raise TargetMismatch("%s.forward builds its metadata elsewhere" % TOWER)
        _in_order(forward, self.ORDER)
        params = tuple(inspect.signature(own_function(tower, "compute_attn_mask_seqlen")).parameters)
        if params != ("self", "cu_seqlens"):
            raise TargetMismatch("%s.compute_attn_mask_seqlen takes %s" % (TOWER, params))
        return found

    def build(self, module, context):
        embeddings, tower = _classes(module)
        return {EMBEDDINGS + ".forward": embeddings_forward(context.found[EMBEDDINGS + ".forward"], context),
                TOWER + ".compute_attn_mask_seqlen": attn_mask_seqlen_keeping_host(
                    own_function(tower, "compute_attn_mask_seqlen"), context)}


class _EncoderMetadata:
    """0.26.0 .. 0.27.1: the eager forward builds its metadata with ``prepare_encoder_metadata``,
    whose ``cu_seqlens`` goes through ``maybe_recompute_cu_seqlens``."""

    def check(self, module, context):
        embeddings, tower = _classes(module)
        found = _check_embeddings(embeddings)
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
        interpolate = own_function(tower, "pos_embeds_interpolate")
        found[TOWER + ".pos_embeds_interpolate"] = Edited(interpolate, edit_function(interpolate, HOST_IMAGE_SHAPE))
        return found

    def build(self, module, context):
        embeddings, tower = _classes(module)
        return {EMBEDDINGS + ".forward": embeddings_forward(context.found[EMBEDDINGS + ".forward"], context),
                TOWER + ".forward": tower_forward_with_host_shapes(
                    own_function(tower, "forward"), context.found[TOWER + ".pos_embeds_interpolate"], context)}


COPY_THEN_TOLIST = _CopyThenTolist()
TOWER_COPY = _TowerCopy()
ENCODER_METADATA = _EncoderMetadata()
