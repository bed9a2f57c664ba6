"""Release families of ``vllm.glm_ocr_host_lengths`` (on ``GlmOcrVisionTransformer``).

``forward(self, x, grid_thw[, encoder_metadata])`` turns a list grid into an
int32 host tensor, builds ``cu_seqlens`` from ``grid_thw``
(``repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])
.cumsum(dim=0, dtype=torch.int32)``, a 0 in front with ``torch.cat``), copies
it with ``cu_seqlens.to(self.device, non_blocking=True)`` (0.19.1 .. 0.29.0;
from 0.30.0 the ``cat`` writes into a pinned buffer and ``.to`` follows it),
hands the copy to ``self.compute_attn_mask_seqlen`` (GLM-4.1V's, inherited)
and then to every block. ``check`` looks for that shape (and says "not
needed" where the copy goes through ``maybe_recompute_cu_seqlens``). ``build``
wraps ``forward`` (notes its ``grid_thw``) and ``compute_attn_mask_seqlen``
(keeps the host lengths of a host grid on the device tensor it is given, then
calls the parent class's method, looked up at call time so that a patch of
GLM-4.1V's method, or its revert, is followed).
"""
import inspect
import threading

from npu_shim.patch import NotNeeded, TargetMismatch
from npu_shim.patches._shared import host_record
from npu_shim.patches._shared.host_data import cu_seqlens_of, host_grid
from npu_shim.patches._shared.code import names_in_code, source_text
from npu_shim.patches._shared.structure import own_function

METHOD = "compute_attn_mask_seqlen"
PARAMS = ("self", "cu_seqlens")
FORWARD_PARAMS = (("self", "x", "grid_thw"), ("self", "x", "grid_thw", "encoder_metadata"))
LISTED = "if isinstance(grid_thw, list): grid_thw = torch.tensor(grid_thw, dtype=torch.int32)"
BUILT = ("cu_seqlens = torch.repeat_interleave( grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0] )"
         ".cumsum(dim=0, dtype=torch.int32)")
CALL = "max_seqlen = self.compute_attn_mask_seqlen(cu_seqlens)"
HANDED = "x = blk( x, cu_seqlens=cu_seqlens,"


def host_lengths(grid_thw):
    """``cu_seqlens`` of a host grid (a list of ``[t, h, w]``, which upstream's first line turns
    into an int32 host tensor, or a 2-D integer host tensor), built as the tower builds it (int32);
    None if the host does not hold the grid (a device tensor, a stand-in's ``cpu:0`` included)."""
    grid = host_grid(grid_thw)
    return None if grid is None else cu_seqlens_of(grid)


def keep_host(device, grid_thw):
    """Keep the host lengths of ``grid_thw`` on ``device`` (its ``cu_seqlens``) where they match."""
    host_record.remember_lengths(device, lambda: host_lengths(grid_thw))


def _inherited(cls):
    """GLM-4.1V's ``compute_attn_mask_seqlen`` as the class resolves it (inherited or its own)."""
    function = getattr(cls, METHOD, None)
    if not callable(function):
        raise TargetMismatch("%s has no %s" % (cls.__name__, METHOD))
    return function


class _ForwardCopy:
    def __init__(self, *copy):
        self.copy = copy                            # upstream's copy statement(s), in order

    def check(self, cls, context):
        params = tuple(inspect.signature(_inherited(cls)).parameters)
        if params != PARAMS:
            raise TargetMismatch("%s.%s takes %s; the family knows %s" % (cls.__name__, METHOD, params, PARAMS))
        forward = own_function(cls, "forward")
        params = tuple(inspect.signature(forward).parameters)
        if params not in FORWARD_PARAMS:
            raise TargetMismatch("%s.forward takes %s; the family knows %s" % (
                cls.__name__, params, " or ".join(map(str, FORWARD_PARAMS))))
        names = names_in_code(forward.__code__, nested=False)
        if "maybe_recompute_cu_seqlens" in names:
            raise NotNeeded("%s.forward copies cu_seqlens through MMEncoderAttention.maybe_recompute_cu_seqlens "
                            "(vllm.mm_encoder_host_lengths)" % cls.__name__)
        if METHOD not in names or "to" not in names:
            raise TargetMismatch("%s.forward does not call %s and to" % (cls.__name__, METHOD))
        text = source_text(forward, "%s.forward: no source to find its cu_seqlens copy in" % cls.__name__)
        steps = (LISTED, BUILT) + self.copy + (CALL, HANDED)
        missing = [step for step in steps if step not in text]
        if missing:
            raise TargetMismatch("%s.forward does not %s" % (cls.__name__, "; ".join(missing)))
        places = [text.index(step) for step in steps]
        if places != sorted(places):
            raise TargetMismatch("%s.forward builds, copies and hands over cu_seqlens in another order"
                                 % cls.__name__)
        # nothing rewrites cu_seqlens between the copy and the blocks
        between = text[places[len(steps) - 3]:places[-1]]
        if between.count("cu_seqlens =") != 1:
            raise TargetMismatch("%s.forward assigns cu_seqlens again after its copy" % cls.__name__)

    def build(self, cls, context):
        inherited, forward = _inherited(cls), own_function(cls, "forward")
        local = threading.local()

        def compute_attn_mask_seqlen(self, cu_seqlens):
            grids = getattr(local, "grids", None)
            if grids:
                keep_host(cu_seqlens, grids[-1])
            return super(cls, self).compute_attn_mask_seqlen(cu_seqlens)

        def forward_(self, x, grid_thw, *args, **kwargs):
            grids = local.__dict__.setdefault("grids", [])
            grids.append(grid_thw)
            try:
                return forward(self, x, grid_thw, *args, **kwargs)
            finally:
                grids.pop()

        what = "upstream's, and the host lengths of a host grid kept on the device cu_seqlens"
        # upstream's method, not another patch's wrapper of it (vllm.glm4_1v_host_lengths)
        context.present(compute_attn_mask_seqlen, getattr(inherited, "__wrapped_upstream__", inherited),
                        what)
        compute_attn_mask_seqlen.__qualname__ = "%s.%s" % (cls.__qualname__, METHOD)
        context.present(forward_, forward, what)
        return {METHOD: compute_attn_mask_seqlen, "forward": forward_}


TENSOR_TO = _ForwardCopy("cu_seqlens = torch.cat([cu_seqlens.new_zeros(1), cu_seqlens])",
                         "cu_seqlens = cu_seqlens.to(self.device, non_blocking=True)")
PINNED_CAT = _ForwardCopy("cu_seqlens = torch.cat( [cu_seqlens.new_zeros(1), cu_seqlens], "
                          "out=cu_seqlens.new_empty(cu_seqlens.numel() + 1, pin_memory=PIN_MEMORY), "
                          ").to(self.device, non_blocking=True)")
