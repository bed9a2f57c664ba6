"""Release families of ``vllm.qwen2_5_vl_host_lengths`` (on ``Qwen2_5_VisionTransformer``).

The tower calls ``self.compute_attn_mask_seqlen(t)`` on the host
``cu_seqlens`` and ``cu_window_seqlens`` and then copies each with
``t.to(device=..., non_blocking=True)``: in ``forward`` with
``device=self.device`` (0.18.0 .. 0.20.2), in ``prepare_encoder_metadata``
with ``device=device`` (0.21.0). ``check`` looks for that shape in the
family's method (and says "not needed" where ``forward`` copies through
``MMEncoderAttention.maybe_recompute_cu_seqlens``). ``build`` wraps
``compute_attn_mask_seqlen``: upstream's method runs, then the host tensor's
next ``.to`` keeps its values on the tensor the copy returns.
"""
import inspect

from npu_shim.patch import NotNeeded, TargetMismatch
from npu_shim.patches._shared.code import names_in_code, source_text
from npu_shim.patches._shared.host_record import keep_at_next_copy

METHOD = "compute_attn_mask_seqlen"
PARAMS = ("self", "cu_seqlens")
COPY = "{0} = {0}.to(device={1}, non_blocking=True)"


class _TowerCopy:
    def __init__(self, copier, device):
        self.copier = copier                      # the method that copies cu_seqlens
        self.copies = tuple(COPY.format(name, device) for name in ("cu_seqlens", "cu_window_seqlens"))

    def _function(self, cls):
        function = vars(cls).get(METHOD)
        if not inspect.isfunction(function):
            raise TargetMismatch("%s.%s is not a method defined by the class" % (cls.__name__, METHOD))
        return function

    def check(self, cls, context):
        function = self._function(cls)
        params = tuple(inspect.signature(function).parameters)
        if params != PARAMS:
            raise TargetMismatch("%s.%s takes %s; the family knows %s" % (cls.__name__, METHOD, params, PARAMS))
        forward = vars(cls).get("forward")
        if inspect.isfunction(forward) and "maybe_recompute_cu_seqlens" in names_in_code(forward.__code__, False):
            raise NotNeeded("%s.forward copies cu_seqlens through MMEncoderAttention.maybe_recompute_cu_seqlens "
                            "(vllm.mm_encoder_host_lengths)" % cls.__name__)
        copier = vars(cls).get(self.copier)
        if not inspect.isfunction(copier):
            raise TargetMismatch("%s.%s is not a function defined by the class" % (cls.__name__, self.copier))
        names = names_in_code(copier.__code__, nested=False)
        if "maybe_recompute_cu_seqlens" in names:
            raise NotNeeded("%s.%s copies cu_seqlens through MMEncoderAttention.maybe_recompute_cu_seqlens "
                            "(vllm.mm_encoder_host_lengths)" % (cls.__name__, self.copier))
        if METHOD not in names:
            raise TargetMismatch("%s.%s does not call %s" % (cls.__name__, self.copier, METHOD))
        text = source_text(copier, "%s.%s: no source to find its cu_seqlens copies in" % (cls.__name__, self.copier))
        for name, copy in zip(("cu_seqlens", "cu_window_seqlens"), self.copies):
            call = "self.%s(%s)" % (METHOD, name)
            if copy not in text:
                raise TargetMismatch("%s.%s does not copy with %s" % (cls.__name__, self.copier, copy))
            if call not in text or text.index(call) > text.index(copy):
                raise TargetMismatch("%s.%s does not call %s on the host %s before copying it"
                                     % (cls.__name__, self.copier, METHOD, name))

    def build(self, cls, context):
        original = self._function(cls)

        def compute_attn_mask_seqlen(self, cu_seqlens):
            result = original(self, cu_seqlens)
            if keep_at_next_copy(cu_seqlens):
                context.count("calls")      # a host tensor whose next copy keeps its values
            return result

        context.present(compute_attn_mask_seqlen, original,
                        "upstream's, then the host tensor's next copy keeps its values")
        return {METHOD: compute_attn_mask_seqlen}


FORWARD_COPY = _TowerCopy("forward", "self.device")
METADATA_COPY = _TowerCopy("prepare_encoder_metadata", "device")
