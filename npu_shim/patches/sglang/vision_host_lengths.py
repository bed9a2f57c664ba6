"""sglang.vision_host_lengths — sglang's vision towers on Ascend without device->host reads of cu_seqlens (0.5.16+).

Why: from sglang 0.5.16 the vision towers (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, GLM-4V
  and the other models built on ``VisionAttention``) compute their attention
  metadata once per forward with ``prepare_vision_attention_metadata``: it copies
  the tower's ``cu_seqlens`` to the device without blocking and reads
  ``seq_lens.max().item()`` back (1 read per metadata object). Then
  ``VisionAscendAttention.forward`` copies the metadata's lengths back to the host
  in every layer (0.5.16: ``seq_lens.to("cpu")``; 0.5.17+:
  ``forward_metadata.cu_seqlens.to("cpu")``), because FIA takes host lists: 1 read
  per layer. On NPU the towers hand the metadata a *host* ``cu_seqlens`` (they
  move it to ``"cpu"`` on purpose), so every one of those reads fetches numbers
  the host already had. Measured on the real wheels with sglang's own classes
  (CPU, emulated ops): 7 reads over 6 layers sharing one metadata object, packed
  and padded. Separately, 0.5.16 hands FIA (layout TND) the per-image lengths
  where TND wants cumulative ones: two or more images fail ("queryT must be equal
  to the last element of actualSequenceLengthQ"; the emulation refuses the
  decreasing list the same way).
How: ``prepare_vision_attention_metadata`` is replaced by a function that, for a
  ``cu_seqlens`` on the host, keeps its values (a host list) on the metadata it
  returns and takes the maximum from them, so nothing is read back; upstream
  builds the metadata (0.5.17+: upstream's own function, given ``max_seqlen``;
  0.5.16, which has no such parameter: the same three steps, written here). For a
  ``cu_seqlens`` already on the device, upstream's function runs unchanged (its
  read stays: the host has no copy). ``VisionAscendAttention.forward`` is replaced
  by one that takes the cumulative lengths from that host list, where the
  metadata carries one for its own ``cu_seqlens`` (same tensor, same version),
  and otherwise hands the call to upstream's forward (0.5.17+) or reads
  ``cu_seqlens`` back once as 0.5.17 does (0.5.16). The FIA call is upstream's,
  with upstream's arguments; on 0.5.20+ the padded layout (each image padded to
  a common length) keeps upstream's drop-and-restore, with ``valid_indices``
  built from the host lengths and copied to the device without blocking. Calls
  without metadata, or with an additive ``attention_mask`` (upstream's SDPA
  fallback, 0.5.17+), are upstream's.
Upstream fix: 0.5.17 (PR #31867) passes cumulative lengths (0.5.16's multi-image
  crash); none for the reads (the metadata path of 0.5.16 brought the copy back
  that PR #15434 had removed).
Remove when: sglang's vision metadata keeps the host lengths for the NPU backend.

Releases before 0.5.16 (read from the wheels, measured on the lanes with sglang's own towers,
``npu_shim.testing.sglang_towers``): 0.5.11 - 0.5.13 call ``_npu_flash_attention_unpad`` with
``seq_lens`` moved to the host only if they are on the NPU, 0.5.14 - 0.5.15 call FIA with
``cu_seqlens[1:].tolist()``; there is no metadata. Qwen2.5-VL and GLM-4V hand the attention
host lengths (0 reads there); Qwen3-VL hands it a device copy of its host lengths (1 read per
layer): ``sglang.vision_device_lengths`` serves those releases (1 read per forward).

The newest family's fence is open above: it accepts only the ``VisionAscendAttention.forward``
bodies read (``bodies``, by ``body_digest``), since the replacement writes the FIA call out with
upstream's arguments; a newer release with such a body gets it, and its status says the release
was not read yet.

A model module binds ``prepare_vision_attention_metadata`` by name when it
imports; the replacement forwards to whatever the vision module holds now when
it is no longer that (after ``npu_shim.uninstall()``: upstream's).
"""
import inspect

from npu_shim.patch import Defect, Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.structure import expect_body, found, own_function
from npu_shim.patches._shared.code import names_in_code
from npu_shim.patches._shared.host_data import is_host

TARGET = "sglang.srt.layers.attention.vision"
METADATA = "prepare_vision_attention_metadata"
FORWARD = "VisionAscendAttention.forward"
FIELDS = {"cu_seqlens", "seq_lens", "max_seqlen"}
# Where the host values live on a metadata object: (its device cu_seqlens, that tensor's
# version when the metadata was built, the host list of cumulative lengths).
HOST_ATTR = "_npu_shim_host_cu_seqlens"

FIA = "npu_fused_infer_attention_score"
FIA_ARGUMENTS = ("actual_seq_lengths", "actual_seq_lengths_kv", "input_layout", "sparse_mode")


def version_of(tensor):
    """The tensor's version counter; None for a tensor made under ``torch.inference_mode()``,
    which has none (and cannot be modified in place outside it)."""
    try:
        return tensor._version
    except RuntimeError:
        return None


def host_cumulative(metadata):
    """The host list of cumulative lengths (leading 0 included) kept for ``metadata``, or None."""
    kept = getattr(metadata, "__dict__", {}).get(HOST_ATTR)
    if kept is None:
        return None
    device, version, values = kept
    current = metadata.cu_seqlens
    if current is not device or version_of(current) != version:
        return None
    return values


def keep(metadata, values):
    metadata.__dict__[HOST_ATTR] = (metadata.cu_seqlens, version_of(metadata.cu_seqlens), values)
    return metadata


def host_values(cu_seqlens):
    """The host list of a host ``cu_seqlens`` and the largest segment, or None."""
    import torch

    if not is_host(cu_seqlens) or cu_seqlens.dim() != 1:
        return None
    values = [int(x) for x in cu_seqlens.to(torch.int32).tolist()]
    widest = max((b - a for a, b in zip(values, values[1:])), default=None)
    return values, widest


def npu_ops(module):
    # vision.py imports torch_npu only where sglang sees an NPU; upstream's forward uses that name.
    found = module.__dict__.get("torch_npu")
    if found is None:
        import torch_npu as found
    return found


def fia(torch_npu, q, k, v, cumulative, softmax_scale):
    """Upstream's FIA call (0.5.14 - 0.5.23, unchanged), on host cumulative lengths."""
    _, num_heads, head_size = q.shape
    num_kv_heads = k.shape[1]
    scale_value = softmax_scale if softmax_scale is not None else head_size ** -0.5
    return torch_npu.npu_fused_infer_attention_score(
        query=q,
        key=k,
        value=v,
        actual_seq_lengths=cumulative,
        actual_seq_lengths_kv=cumulative,
        scale=scale_value,
        num_heads=num_heads,
        num_key_value_heads=num_kv_heads,
        sparse_mode=0,
        input_layout="TND",
    )[0]


def padded_fia(torch_npu, q, k, v, cumulative, softmax_scale):
    """0.5.20+: upstream's handling of images padded to a common length around the FIA call,
    with the indices of the real rows built on the host and copied once without blocking."""
    import torch

    output = torch.empty_like(q)
    total = cumulative[-1]
    valid = None
    if q.shape[0] != total:
        lengths = [b - a for a, b in zip([0] + cumulative[:-1], cumulative)]
        if len(lengths) == 1:
            q, k, v = q[:total], k[:total], v[:total]
        else:
            padded = q.shape[0] // len(lengths)
            rows = torch.cat([torch.arange(b * padded, b * padded + n, dtype=torch.long)
                              for b, n in enumerate(lengths)])
            valid = rows.to(q.device, non_blocking=True)
            q, k, v = q[valid], k[valid], v[valid]
    attn = fia(torch_npu, q, k, v, cumulative, softmax_scale)
    if valid is not None:
        output.index_copy_(0, valid, attn)
        return output
    if output.shape[0] != total:
        output[:total].copy_(attn)
        return output
    return attn


class _Family:
    """One shape of ``VisionAscendAttention.forward`` + ``prepare_vision_attention_metadata``.

    ``metadata_max``  upstream's metadata function takes ``max_seqlen`` (0.5.17+)
    ``fallback``      upstream's forward has an additive-mask SDPA fallback (0.5.17+)
    ``padded``        upstream's forward drops and restores padded rows (0.5.20+)
    ``reads``         what upstream's metadata branch reads back: "seq_lens" (0.5.16,
                      per-image lengths: wrong for FIA TND) or "cu_seqlens"
    """

    def __init__(self, metadata_max, fallback, padded, reads, bodies=None):
        self.metadata_max, self.fallback, self.padded, self.reads = metadata_max, fallback, padded, reads
        # body_digest of the forwards read, for the family whose fence is open above: where no
        # newer release was read, only a forward read proves the FIA call is still upstream's
        self.bodies = bodies

    # -- structure ---------------------------------------------------------------------------
    def check(self, module, context):
        import dataclasses

        cls = getattr(module, "VisionAscendAttention", None)
        meta_cls = getattr(module, "VisionAttentionMetadata", None)
        prepare = getattr(module, METADATA, None)
        if cls is None or meta_cls is None or not inspect.isfunction(prepare):
            raise TargetMismatch("%s lacks VisionAscendAttention, VisionAttentionMetadata or %s"
                                 % (TARGET, METADATA))
        if not dataclasses.is_dataclass(meta_cls) or not FIELDS <= {f.name for f in dataclasses.fields(meta_cls)}:
            raise TargetMismatch("VisionAttentionMetadata is not a dataclass with %s" % ", ".join(sorted(FIELDS)))
        params = inspect.signature(prepare).parameters
        if list(params)[:2] != ["cu_seqlens", "device"]:
            raise TargetMismatch("%s takes %s first; the family knows (cu_seqlens, device)"
                                 % (METADATA, list(params)[:2]))
        if ("max_seqlen" in params) != self.metadata_max:
            raise TargetMismatch("%s %s max_seqlen" % (METADATA, "lacks" if self.metadata_max else "takes"))
        forward = own_function(cls, "forward")
        fparams = inspect.signature(forward).parameters
        if "forward_metadata" not in fparams or ("attention_mask" in fparams) != self.fallback:
            raise TargetMismatch("VisionAscendAttention.forward takes %s" % list(fparams))
        code = forward.__code__
        names = names_in_code(code)
        if FIA not in names or "_npu_flash_attention_unpad" in names:
            raise TargetMismatch("VisionAscendAttention.forward does not call %s alone" % FIA)
        other = ({"seq_lens", "cu_seqlens"} - {self.reads}).pop()
        if self.reads not in names or other in names:
            raise TargetMismatch("VisionAscendAttention.forward does not read forward_metadata.%s alone"
                                 % self.reads)
        if ("valid_indices" in code.co_varnames) != self.padded:
            raise TargetMismatch("VisionAscendAttention.forward %s the padded layout"
                                 % ("lacks" if self.padded else "handles"))
        if self.fallback and "sdpa_fallback" not in names:
            raise TargetMismatch("VisionAscendAttention.forward has attention_mask but no sdpa_fallback")
        if self.bodies is not None:
            expect_body(forward, self.bodies, "the %s replacement" % context.patch)
        return {METADATA: prepare, FORWARD: forward}

    # -- replacements ------------------------------------------------------------------------
    def build(self, module, context):
        upstream_prepare = found(context, METADATA, lambda: getattr(module, METADATA))
        upstream_forward = found(context, FORWARD, lambda: own_function(module.VisionAscendAttention, "forward"))
        prepare = self.make_prepare(module, upstream_prepare, context)
        forward = self.make_forward(module, upstream_forward, context)
        context.present(prepare, upstream_prepare,
                        "a host cu_seqlens keeps its values on the metadata, whose max_seqlen comes from them "
                        "(no .item())")
        context.present(forward, upstream_forward,
                        "cumulative lengths from the metadata's host values (no .to('cpu'))")
        return {METADATA: prepare, FORWARD: forward}

    def make_prepare(self, module, upstream, context):
        metadata_max = self.metadata_max

        def prepare_vision_attention_metadata(cu_seqlens, device, **kwargs):
            current = module.__dict__.get(METADATA)
            if current is not prepare_vision_attention_metadata:
                return current(cu_seqlens, device, **kwargs)     # bound by name before uninstall
            context.count("calls")
            found = host_values(cu_seqlens)
            if found is None:
                context.count("upstream_calls")
                return upstream(cu_seqlens, device, **kwargs)
            values, widest = found
            if metadata_max:
                if kwargs.get("max_seqlen") is None:
                    context.count("upstream_host_copies")
                    kwargs["max_seqlen"] = widest
                return keep(upstream(cu_seqlens, device, **kwargs), values)
            import torch

            context.count("upstream_host_copies")
            on_device = cu_seqlens.to(device=device, dtype=torch.int32, non_blocking=True)
            return keep(module.VisionAttentionMetadata(
                cu_seqlens=on_device, seq_lens=on_device[1:] - on_device[:-1], max_seqlen=widest,
                **kwargs), values)

        return prepare_vision_attention_metadata

    def make_forward(self, module, upstream, context):
        family = self

        def forward(self, q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=None, forward_metadata=None,
                    attention_mask=None, **kwargs):
            context.count("calls")
            if not family.fallback and attention_mask is not None:
                kwargs["attention_mask"], attention_mask = attention_mask, None   # family seq-lens ignores it
            if forward_metadata is None or attention_mask is not None:
                context.count("upstream_calls")
                if family.fallback:
                    kwargs["attention_mask"] = attention_mask
                return upstream(self, q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=softmax_scale,
                                forward_metadata=forward_metadata, **kwargs)
            context.count("upstream_host_copies")
            values = host_cumulative(forward_metadata)
            if values is None:
                if family.fallback:                          # upstream's read, upstream's code
                    context.count("upstream_calls")
                    return upstream(self, q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=softmax_scale,
                                    forward_metadata=forward_metadata, attention_mask=attention_mask,
                                    **kwargs)
                import torch

                # family seq-lens' own branch reads seq_lens back and is wrong for two images or
                # more: read cu_seqlens once instead, as family cu-seqlens does.
                context.count("host_copies")
                values = forward_metadata.cu_seqlens.to("cpu").to(torch.int32).tolist()
            cumulative = values[1:]
            torch_npu = npu_ops(module)
            if family.padded:
                return padded_fia(torch_npu, q, k, v, cumulative, softmax_scale)
            return fia(torch_npu, q, k, v, cumulative, softmax_scale)

        return forward


SEQ_LENS = _Family(metadata_max=False, fallback=False, padded=False, reads="seq_lens")
CU_SEQLENS = _Family(metadata_max=True, fallback=True, padded=False, reads="cu_seqlens")
CU_SEQLENS_PADDED = _Family(metadata_max=True, fallback=True, padded=True, reads="cu_seqlens",
                            bodies={"6ad79b33dac0"})

KEEPS = "torch_npu.npu_fused_infer_attention_score, input_layout TND, upstream's arguments"

PATCH = Patch(
    name="sglang.vision_host_lengths",
    target=TARGET,
    replaces=(METADATA, FORWARD),
    requires={"sglang": ""},
    outside_window={"sglang": "below the window there is no vision attention metadata: "
                              "sglang.vision_device_lengths serves those releases"},
    needs_npu=True,
    families=(
        Family(__name__ + ":SEQ_LENS", fence=">=0.5.16,<0.5.17",
               keeps=KEEPS + "; cumulative lengths, as family cu-seqlens passes them"),
        Family(__name__ + ":CU_SEQLENS", fence=">=0.5.17,<0.5.20", keeps=KEEPS),
        Family(__name__ + ":CU_SEQLENS_PADDED",
               fence=">=0.5.20", keeps=KEEPS + "; upstream's padded-layout drop and restore"),
    ),
    summary="vision attention metadata keeps the tower's host cu_seqlens; VisionAscendAttention takes them: "
            "0 reads per tower forward; family seq-lens passes FIA cumulative lengths (two or more images work)",
    selftest=Selftest("npu_shim.selftest.sglang_vision_host_lengths", host_syncs=0),
    defect=Defect("sglang's vision attention on Ascend reads cu_seqlens back per layer, or hands FIA's TND call per-image lengths",
                  shows=("reads", "raises"), says="TND actual_seq_lengths must be non-decreasing"),
)
