"""vllm.radio_host_lengths — RADIO's packed ``cu_seqlens`` keeps the host lengths it was built from.

Why: vLLM's RADIO vision model (``RadioInternVisionModel``, Nemotron Nano VL's vision tower)
  packs the images of a dynamic-resolution batch (more than one image) or the tubelets of a
  video into one sequence. ``_inter_image_mask_metadata_from_seq_lens`` builds its
  ``cu_seqlens`` from the host ``seq_lens`` (the patch counts of the host ``imgs_sizes`` plus
  the prefix tokens, or the tubelet length times the tubelet count):
  ``torch.tensor(list(accumulate(seq_lens, initial=0)), dtype=torch.int32, device=device)``,
  a copy to the device that is not ``MMEncoderAttention.maybe_recompute_cu_seqlens``, so
  ``vllm.mm_encoder_host_lengths`` never sees it (``max_seqlen`` stays on the host).
  vllm-ascend's attention (with ``vllm.mm_encoder_attn``) reads it back: 1 device->host read
  per tower forward (upstream: 1 per layer), of numbers the host built a line above.
How: the method is wrapped; upstream's body runs untouched (its ``torch.tensor`` copy, same op,
  same arguments, and its ``MaskMetadata``). Where every ``seq_lens`` item is a host integer,
  the wrapper builds the same int32 lengths on the host (``accumulate`` behind a 0, the module's
  own ``itertools.accumulate``) and, where length and dtype (int32) match the ``cu_seqlens``
  upstream returned, keeps them on it with
  :func:`npu_shim.patches._shared.host_record.remember_lengths`; the attention's host read
  takes them once instead of reading back. Counted on vLLM's own ``RadioModel``
  (:mod:`npu_shim.testing.census`, 3 layers, called as ``extract_feature_dynamic`` calls it,
  two forwards of 2 and 3 images, both device classes): 3 -> 0 reads per forward, outputs
  ``torch.equal`` to upstream's.
Window: read in the wheels: 0.19.1, 0.20.2, 0.21.0, 0.22.1, 0.23.0, 0.24.0, 0.25.1, 0.26.0,
  0.27.1, 0.28.0, 0.29.0, 0.30.0 and 0.33.0 have the same method (signature ``(self, seq_lens,
  device)``, the same statements; one source digest). 0.18.0 builds the same ``cu_seqlens`` in
  ``inter_image_mask_metadata`` (from ``imgs_sizes``; no ``_from_seq_lens``), 0.14.1 .. 0.17.0
  build a dense boolean mask instead, 0.13.0 no inter-image mask: not in the window. Run in the
  lanes vllm-0.21, vllm-0.22, vllm-0.25, latest-vllm (0.26.0) and vllm-0.30; the other releases
  are decided from reading the wheels.
Upstream fix: none (vllm-ascend reads ``cu_seqlens`` back in every release read).
Remove when: RADIO copies ``cu_seqlens`` through ``maybe_recompute_cu_seqlens``, or vllm-ascend's
  attention takes host lengths from vLLM.
"""
import inspect
import itertools

from npu_shim.patch import Defect, Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared import host_record
from npu_shim.patches._shared.host_data import host_ints
from npu_shim.patches._shared.code import names_in_code, source_text
from npu_shim.patches._shared.structure import own_function

TARGET = "vllm.model_executor.models.radio"
CLASS_NAME = "RadioInternVisionModel"
METHOD = "_inter_image_mask_metadata_from_seq_lens"
PARAMS = ("self", "seq_lens", "device")


def host_lengths(seq_lens):
    """``cu_seqlens`` of ``seq_lens`` built on the host as upstream builds its device tensor
    (int32, ``accumulate`` behind a 0); None unless every item is a host integer."""
    import torch

    if not host_ints(seq_lens):
        return None
    return torch.tensor(list(itertools.accumulate(seq_lens, initial=0)), dtype=torch.int32)


class _Accumulate:
    def __init__(self, *steps):
        self.steps = steps                          # upstream's statements, in order

    def check(self, cls, context):
        method = own_function(cls, METHOD)
        params = tuple(inspect.signature(method).parameters)
        if params != PARAMS:
            raise TargetMismatch("%s.%s takes %s; the family knows %s" % (cls.__name__, METHOD, params, PARAMS))
        names = names_in_code(method.__code__, nested=False)
        needed = {"torch", "tensor", "accumulate", "int32", "MaskMetadata"}
        if not needed <= names:
            raise TargetMismatch("%s.%s does not use %s" % (cls.__name__, METHOD, ", ".join(sorted(needed - names))))
        # the host lengths are built with the accumulate upstream's body calls
        if method.__globals__.get("accumulate") is not itertools.accumulate:
            raise TargetMismatch("%s.%s: accumulate is not itertools.accumulate" % (cls.__name__, METHOD))
        text = source_text(method, "%s.%s: no source to find its cu_seqlens copy in" % (cls.__name__, METHOD))
        missing = [step for step in self.steps if step not in text]
        if missing:
            raise TargetMismatch("%s.%s does not %s" % (cls.__name__, METHOD, "; ".join(missing)))
        places = [text.index(step) for step in self.steps]
        if places != sorted(places):
            raise TargetMismatch("%s.%s builds and returns cu_seqlens in another order" % (cls.__name__, METHOD))
        if text.count("cu_seqlens =") != 1:
            raise TargetMismatch("%s.%s assigns cu_seqlens more than once" % (cls.__name__, METHOD))

    def build(self, cls, context):
        upstream = own_function(cls, METHOD)

        def _inter_image_mask_metadata_from_seq_lens(self, seq_lens, device):
            context.count("calls")
            metadata = upstream(self, seq_lens, device=device)
            host_record.remember_lengths(getattr(metadata, "cu_seqlens", None), lambda: host_lengths(seq_lens))
            return metadata

        context.present(_inter_image_mask_metadata_from_seq_lens, upstream,
                        "upstream's, and the host lengths it was built from kept on the device cu_seqlens")
        return {METHOD: _inter_image_mask_metadata_from_seq_lens}


# upstream's statements (white space folded), in every release read
TENSOR_ACCUMULATE = _Accumulate(
    "cu_seqlens = torch.tensor( list(accumulate(seq_lens, initial=0)), dtype=torch.int32, device=device )",
    "max_seqlen = torch.tensor(max(seq_lens), dtype=torch.int32)",
    "return MaskMetadata(cu_seqlens=cu_seqlens, max_seqlen=max_seqlen)")

PATCH = Patch(
    name="vllm.radio_host_lengths",
    target=TARGET,
    subject=CLASS_NAME,
    replaces=(CLASS_NAME + "." + METHOD,),
    requires={"vllm": ""},
    outside_window={"vllm": "below the window, the releases read build cu_seqlens in inter_image_mask_metadata "
                            "(no _from_seq_lens; not patched), or a dense boolean mask, or no inter-image mask"},
    needs_npu=True,
    families=(
        Family(__name__ + ":TENSOR_ACCUMULATE", fence=">=0.19.0",
               keeps="torch.tensor(list(accumulate(seq_lens, initial=0)), dtype=torch.int32, device=device)"),
    ),
    summary="RADIO's packed cu_seqlens keeps the host lengths it was built from; vllm.mm_encoder_attn takes "
            "them instead of reading back: 0 reads per forward (without it: 1; vllm-ascend alone: 1 per layer)",
    # 0: what this patch is for; a read is the defect back.
    selftest=Selftest("npu_shim.selftest.vllm_census_tower:run", host_syncs=0, arguments={"tower": "RADIO"}),
    defect=Defect("RADIO's packed cu_seqlens is read back from the device", shows="reads"),
)
