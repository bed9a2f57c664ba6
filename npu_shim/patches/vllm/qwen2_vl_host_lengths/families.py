"""Release families of ``vllm.qwen2_vl_host_lengths`` (on ``Qwen2VisionTransformer``).

``prepare_encoder_metadata`` builds the host ``cu_seqlens``, calls
``self.compute_attn_mask_seqlen(cu_seqlens)`` on it, and returns the device
copy under ``"cu_seqlens"``: ``cu_seqlens.to(device=device,
non_blocking=True)`` (0.22.1 .. 0.29.0) or ``async_tensor_h2d(cu_seqlens,
device)`` (0.30.0). ``check`` looks for that shape (and says "not needed"
where the copy goes through ``maybe_recompute_cu_seqlens``). ``build`` wraps
both methods: upstream's bodies run, and the host tensor handed to
``compute_attn_mask_seqlen`` inside a ``prepare_encoder_metadata`` call is
kept on the device tensor that call returns.
"""
import inspect
import threading

import torch

from npu_shim.patch import NotNeeded, TargetMismatch
from npu_shim.patches._shared import host_record
from npu_shim.patches._shared.code import names_in_code, source_text
from npu_shim.patches._shared.host_data import is_host
from npu_shim.patches._shared.structure import own_function

METHOD = "compute_attn_mask_seqlen"
COPIER = "prepare_encoder_metadata"
PARAMS = ("self", "cu_seqlens")
CALL = "max_seqlen = self.compute_attn_mask_seqlen(cu_seqlens)"


def keep_host(metadata, seen):
    """Keep the one host tensor ``seen`` on ``metadata["cu_seqlens"]`` where they match."""
    if len(seen) != 1 or not isinstance(metadata, dict):
        return
    host, device = seen[0], metadata.get("cu_seqlens")
    if not (is_host(host) and isinstance(device, torch.Tensor)):
        return
    if (host.dim() != 1 or device.shape != host.shape
            or device.dtype != host.dtype or host_record.ATTR in device.__dict__):
        return
    host_record.remember(device, host)


class _MetadataCopy:
    def __init__(self, copy, op):
        self.copy = '"cu_seqlens": ' + copy          # the entry of the dict upstream returns
        self.op = op                                # the name the copy calls

    def check(self, cls, context):
        params = tuple(inspect.signature(own_function(cls, METHOD)).parameters)
        if params != PARAMS:
            raise TargetMismatch("%s.%s takes %s; the family knows %s" % (cls.__name__, METHOD, params, PARAMS))
        copier = own_function(cls, COPIER)
        names = names_in_code(copier.__code__, nested=False)
        if "maybe_recompute_cu_seqlens" in names:
            raise NotNeeded("%s.%s copies cu_seqlens through MMEncoderAttention.maybe_recompute_cu_seqlens "
                            "(vllm.mm_encoder_host_lengths)" % (cls.__name__, COPIER))
        if METHOD not in names or self.op not in names:
            raise TargetMismatch("%s.%s does not call %s and %s" % (cls.__name__, COPIER, METHOD, self.op))
        text = source_text(copier, "%s.%s: no source to find its cu_seqlens copy in" % (cls.__name__, COPIER))
        if self.copy not in text:
            raise TargetMismatch("%s.%s does not return %s" % (cls.__name__, COPIER, self.copy))
        if CALL not in text or text.index(CALL) > text.index(self.copy):
            raise TargetMismatch("%s.%s does not call %s on the host cu_seqlens before copying it"
                                 % (cls.__name__, COPIER, METHOD))

    def build(self, cls, context):
        compute, prepare = own_function(cls, METHOD), own_function(cls, COPIER)
        local = threading.local()

        def compute_attn_mask_seqlen(self, cu_seqlens):
            result = compute(self, cu_seqlens)
            frames = getattr(local, "frames", None)
            if frames:
                frames[-1].append(cu_seqlens)
            return result

        def prepare_encoder_metadata(self, *args, **kwargs):
            frames = local.__dict__.setdefault("frames", [])
            frames.append([])
            try:
                metadata = prepare(self, *args, **kwargs)
            finally:
                seen = frames.pop()
            keep_host(metadata, seen)
            return metadata

        for new, original in ((compute_attn_mask_seqlen, compute), (prepare_encoder_metadata, prepare)):
            context.present(new, original, "upstream's, and the host cu_seqlens kept on the device copy")
        return {METHOD: compute_attn_mask_seqlen, COPIER: prepare_encoder_metadata}


TENSOR_TO = _MetadataCopy("cu_seqlens.to(device=device, non_blocking=True)", "to")
ASYNC_H2D = _MetadataCopy("async_tensor_h2d(cu_seqlens, device)", "async_tensor_h2d")
