"""What every MMEncoderAttention family (and the 310P patch) shares.

Per-forward host lengths
  The NPU ops take sequence lengths on the host; upstream copies
  ``cu_seqlens`` (or ``sequence_lengths``) device->host in every layer.
  :func:`host_values` reads a tensor from the device at most once per encoder
  forward and never carries it into the next forward.

  What "one encoder forward" is: vLLM opens no context of its own around the
  encoder. In every release this shim serves (vLLM 0.13.0 .. 0.21.0 read in
  the wheels; vllm-ascend's NPUModelRunner inherits ``_execute_mm_encoder``)
  the model runner's ``_execute_mm_encoder`` calls ``model.embed_multimodal``
  outside ``set_forward_context`` (``get_forward_context()`` there raises),
  so the forward context cannot delimit it. What does, in every release and
  for every model: the tower's own forward, which runs each of its blocks --
  and so each attention layer -- exactly once (``for blk in self.blocks``).
  Hence the rule: the host copy of a tensor belongs to the layers that have
  read it; when a layer asks again for a tensor it already read, a new
  forward has begun and the tensor is read again. The copy is stored on the
  tensor object itself (an attribute, so it dies with the tensor and nothing
  is process-global), with the layers that consumed it (weakly) and the
  tensor's storage pointer and version counter (no counter under
  ``torch.inference_mode()``, which is why the layer rule exists: a buffer
  rewritten in place between two forwards is read again by the first layer of
  the second forward).

  Where vLLM made the tensor from host data in this forward
  (``MMEncoderAttention.maybe_recompute_cu_seqlens``), the patch
  ``vllm.mm_encoder_host_lengths`` kept that host array on it: the first
  reading takes it (:func:`vllms_host_copy`) and no device read happens.

  Called outside a tower (a single layer called repeatedly, as unit tests
  do): every call after the first re-reads, so it is correct, at upstream's
  cost of one copy per call. Host tensors and Python/NumPy values cost no
  device transfer at all. Limit (documented, not reachable from vLLM's
  towers): tower B reading, for the first time, a buffer that tower A has
  read and that was rewritten in place since, under inference mode, gets A's
  reading.

Lazy layer state
  :func:`layer_state` builds a layer's kernel state from the layer's own
  attributes (``num_heads``, ``head_size``, ``num_kv_heads``, ``scale``) the
  first time its forward runs, so a layer made with ``__new__``, built before
  the shim was installed or unpickled works. The state is never pickled or
  deep-copied (it comes back as "not built yet").

Counters and replacements
  The families count with ``context.count`` and present their replacements with
  ``context.present`` (:class:`npu_shim.patch.FamilyContext`, handed to their
  ``check`` and ``build``); :func:`host_values` takes that context too.
"""
import inspect
import weakref

import torch

from npu_shim.patch import TargetMismatch
from npu_shim.patches._shared.transient import Transient
from npu_shim.patches._shared.host_data import is_host
from npu_shim.patches._shared.code import names_in_code
from npu_shim.patches._shared.structure import own_function

__all__ = ["LayerState", "host_values", "vllms_host_copy", "layer_state", "own_function", "check_params",
           "pad_head_dim", "repeat_kv_to_heads", "PAD_MIN", "PAD_TO"]

PAD_MIN, PAD_TO = 64, 128      # vllm-ascend pads head dims 64 < D < 128 to 128
HOST_ATTR = "_npu_shim_host_copy"
STATE_ATTR = "_npu_shim_mm_encoder_state"


# ------------------------------------------------------- per-forward host copy

class _HostCopy(Transient):
    __slots__ = ("values", "data_ptr", "version", "readers")

    def __init__(self, values, data_ptr, version):
        self.values = values                 # a CPU tensor
        self.data_ptr = data_ptr
        self.version = version
        self.readers = weakref.WeakSet()     # the layers that used this reading


def host_values(layer, values, context):
    """``values`` (1-D: ``cu_seqlens`` or ``sequence_lengths``) as a CPU tensor.

    A tensor is read (``.cpu()``) once per encoder forward, see the module
    docstring: a device tensor costs one device->host copy per forward
    (counted as ``host_copies`` of ``context``'s patch), a CPU tensor none
    (``.cpu()`` returns it). A list/tuple/NumPy array becomes a CPU tensor.
    """
    if not isinstance(values, torch.Tensor):
        return torch.as_tensor(values)
    copy = values.__dict__.get(HOST_ATTR)
    version = None if values.is_inference() else values._version
    if (copy is None or layer in copy.readers or copy.data_ptr != values.data_ptr()
            or copy.version != version):
        host = vllms_host_copy(values) if copy is None else None
        if host is None:
            host = values.cpu()                                     # the one read per forward
            if not is_host(values):
                context.count("host_copies")
        copy = _HostCopy(host, values.data_ptr(), version)
        setattr(values, HOST_ATTR, copy)
    copy.readers.add(layer)
    return copy.values


def vllms_host_copy(values):
    """The host array vLLM copied into ``values`` (kept by ``vllm.mm_encoder_host_lengths``
    at the copy), taken once: the first reading of a tensor vLLM made in this forward
    costs no device read. None where there is none (another tower, that patch off)."""
    from npu_shim.patches._shared import host_record

    return host_record.take(values)


# ---------------------------------------------------------------- layer state

class LayerState(Transient):
    """What a layer's forward needs, derived once from the layer's own attributes
    (rebuilt from the layer after unpickling)."""

    __slots__ = ("scale", "pad_to", "kernel")

    def __init__(self, scale, pad_to, kernel=None):
        self.scale = scale        # the softmax scale to pass (the model's, else head_size ** -0.5)
        self.pad_to = pad_to      # head dim handed to the op (128 where upstream pads)
        self.kernel = kernel      # an optional prepared kernel (e.g. the TND switch)

    def __repr__(self):
        return "LayerState(scale=%g, pad_to=%d, kernel=%r)" % (self.scale, self.pad_to, self.kernel)


def default_scale(layer):
    scale = getattr(layer, "scale", None)
    return float(scale) if scale is not None else layer.head_size ** -0.5


def layer_state(layer, make, attr=STATE_ATTR):
    """The layer's :class:`LayerState`, built by ``make(layer)`` on first use.

    ``attr``: where it is kept on the layer; a patch whose class derives from
    another patched class (0.14.0rc1's 310P class) keeps its own."""
    state = layer.__dict__.get(attr)
    if state is None:
        state = make(layer)
        layer.__dict__[attr] = state
    return state


# ------------------------------------------------------------- tensor helpers

def repeat_kv_to_heads(query, key, value, num_heads, num_kv_heads, head_size):
    """(T, N, D) q and K/V repeated to N heads with ``repeat_interleave``, as vllm-ascend does."""
    bsz, q_len = query.shape[:2]
    kv_len = key.shape[1]
    q = query.view(bsz * q_len, num_heads, head_size)
    k = key.view(bsz * kv_len, num_kv_heads, head_size)
    v = value.view(bsz * kv_len, num_kv_heads, head_size)
    repeat = num_heads // num_kv_heads
    if repeat > 1:
        k = torch.repeat_interleave(k, repeat, dim=1)
        v = torch.repeat_interleave(v, repeat, dim=1)
    return q, k, v


def pad_head_dim(x, width):
    return x if x.shape[-1] == width else torch.nn.functional.pad(x, (0, width - x.shape[-1]))


def to_upstream_shape(out, query, head_size, num_heads):
    """(B, S, N, D) for 4-D queries, (B, S, N*D) for 3-D ones; contiguous, as upstream."""
    out = out[..., :head_size]
    bsz, q_len = query.shape[:2]
    if query.dim() == 4:
        return out.reshape(bsz, q_len, num_heads, head_size).contiguous()
    return out.reshape(bsz, q_len, num_heads * head_size).contiguous()


# ---------------------------------------------------------------- structure

def check_params(function, required, optional_tails, what):
    params = tuple(inspect.signature(function).parameters)
    if params[: len(required)] != required or params[len(required):] not in optional_tails:
        raise TargetMismatch("%s takes %s; the family knows %s" % (
            what, params, " or ".join(str(required + tail) for tail in optional_tails)))


def calls_name(function, name):
    """Whether ``function``'s own code refers to global/attribute ``name``."""
    return name in names_in_code(function.__code__, nested=False)

