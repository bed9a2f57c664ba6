"""Release families of ``vllm.qwen3_omni_vision_host_lengths`` (on ``Qwen3Omni_VisionTransformer``).

``forward(self, x, grid_thw)`` builds ``cu_seqlens`` from ``grid_thw``
(``repeat_interleave(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0])``),
copies it with ``cu_seqlens.to(self.device, non_blocking=True)`` (0.24.0 ..
0.29.0) or ``async_tensor_h2d(cu_seqlens, self.device)`` (0.30.0), hands the
copy to ``self.compute_attn_mask_seqlen``, then rebuilds the same lengths in
NumPy from ``grid_thw.cpu().numpy()``. ``check`` looks for that shape (and
says "not needed" where the copy goes through ``maybe_recompute_cu_seqlens``).
``build`` wraps ``forward`` (notes its ``grid_thw``) and
``compute_attn_mask_seqlen`` (keeps the host lengths of a host grid on the
device tensor it is given).
"""
import inspect
import threading

from npu_shim.patch import NotNeeded, TargetMismatch
from npu_shim.patches._shared import host_record
from npu_shim.patches._shared.host_data import cu_seqlens_of, host_grid_tensor
from npu_shim.patches._shared.code import names_in_code, source_text
from npu_shim.patches._shared.structure import own_function

METHOD = "compute_attn_mask_seqlen"
PARAMS = ("self", "cu_seqlens")
FORWARD_PARAMS = ("self", "x", "grid_thw")
BUILT = "cu_seqlens = torch.repeat_interleave( grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0] )"
CALL = "max_seqlen = self.compute_attn_mask_seqlen(cu_seqlens)"
REBUILT = ("cu_seqlens_np = np.repeat( grid_thw_np[:, 1] * grid_thw_np[:, 2], grid_thw_np[:, 0] )"
           ".cumsum(axis=0, dtype=np.int32)")


def host_lengths(grid_thw):
    """``cu_seqlens`` of a host ``grid_thw`` tensor, as the tower builds it (int32; the same values
    as its ``cu_seqlens_np``); None if the grid is not a 2-D integer host tensor (the tower takes
    no list; a device stand-in's ``cpu:0`` is not the host)."""
    return cu_seqlens_of(grid_thw) if host_grid_tensor(grid_thw) else None


def keep_host(device, grid_thw):
    """Keep the host lengths of ``grid_thw`` on ``device`` (its ``cu_seqlens``) where they match."""
    host_record.remember_lengths(device, lambda: host_lengths(grid_thw))


class _ForwardCopy:
    def __init__(self, copy, op):
        self.copy = copy                            # upstream's copy statement
        self.op = op

    def check(self, cls, context):
        params = tuple(inspect.signature(own_function(cls, METHOD)).parameters)
        if params != PARAMS:
            raise TargetMismatch("%s.%s takes %s; the family knows %s" % (cls.__name__, METHOD, params, PARAMS))
        forward = own_function(cls, "forward")
        params = tuple(inspect.signature(forward).parameters)
        if params != FORWARD_PARAMS:
            raise TargetMismatch("%s.forward takes %s; the family knows %s" % (cls.__name__, params, FORWARD_PARAMS))
        names = names_in_code(forward.__code__, nested=False)
        if "maybe_recompute_cu_seqlens" in names:
            raise NotNeeded("%s.forward copies cu_seqlens through MMEncoderAttention.maybe_recompute_cu_seqlens "
                            "(vllm.mm_encoder_host_lengths)" % cls.__name__)
        if METHOD not in names or self.op not in names:
            raise TargetMismatch("%s.forward does not call %s and %s" % (cls.__name__, METHOD, self.op))
        text = source_text(forward, "%s.forward: no source to find its cu_seqlens copy in" % cls.__name__)
        steps = (BUILT, self.copy, CALL, REBUILT)
        if not all(step in text for step in steps):
            raise TargetMismatch("%s.forward does not %s" % (cls.__name__, " then ".join(
                step for step in steps)))
        places = [text.index(step) for step in steps]
        if places != sorted(places):
            raise TargetMismatch("%s.forward builds, copies and hands over cu_seqlens in another order"
                                 % cls.__name__)

    def build(self, cls, context):
        compute, forward = own_function(cls, METHOD), own_function(cls, "forward")
        local = threading.local()

        def compute_attn_mask_seqlen(self, cu_seqlens):
            grids = getattr(local, "grids", None)
            if grids:
                keep_host(cu_seqlens, grids[-1])
            return compute(self, cu_seqlens)

        def forward_(self, x, grid_thw):
            grids = local.__dict__.setdefault("grids", [])
            grids.append(grid_thw)
            try:
                return forward(self, x, grid_thw)
            finally:
                grids.pop()

        for new, original in ((compute_attn_mask_seqlen, compute), (forward_, forward)):
            context.present(new, original,
                            "upstream's, and the host lengths of a host grid kept on the device cu_seqlens")
        return {METHOD: compute_attn_mask_seqlen, "forward": forward_}


TENSOR_TO = _ForwardCopy("cu_seqlens = cu_seqlens.to(self.device, non_blocking=True)", "to")
ASYNC_H2D = _ForwardCopy("cu_seqlens = async_tensor_h2d(cu_seqlens, self.device)", "async_tensor_h2d")
