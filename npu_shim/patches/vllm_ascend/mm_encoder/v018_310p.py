"""Family v018_310p: ``AscendMMEncoderAttention310``, vllm-ascend 0.18.0rc1 .. 0.22.1rc1.

Upstream there (``vllm_ascend/_310p/ops/mm_encoder_attention.py``, the same
file in 0.18.0rc1, 0.18.0, 0.19.1rc1, 0.20.2rc1, 0.21.0rc1 and 0.22.1rc1): a
subclass of vLLM's ``MMEncoderAttention`` that vllm-ascend registers as
``"MMEncoderAttention"`` when ``is_310p()``. Its ``forward_oot(query, key,
value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None)`` ignores
``sequence_lengths``, copies ``torch.diff(cu_seqlens).to("cpu")`` in every
layer (27 copies per 27-layer forward; a uniform ``cu_seqlens`` it builds
itself is on the host already), repeats K/V to the query heads with
``repeat_interleave``, zero-pads head dims 64 < D < 128 to 128 and calls
``torch_npu._npu_flash_attention_unpad(query, key, value, seq_len,
scale_value=head_size ** -0.5, num_heads, num_kv_heads, out)`` whatever
``scale`` the model gave. (The module's global ``seq_lens_cpu_cache`` is
declared and never used.)

Replaced: ``forward_oot`` only (upstream's ``__init__`` parses nothing). The
same op call with upstream's layout and padding; ``seq_len`` is the difference
of the host ``cu_seqlens``, in ``cu_seqlens``' dtype as upstream's, read from
the device at most once per encoder forward
(:func:`~npu_shim.patches.vllm_ascend.mm_encoder.common.host_values`); the model's
``scale``. Under GQA the op gets the head count of the repeated K/V (upstream
passes ``num_kv_heads``, which does not match them). ``sequence_lengths`` stays
ignored, as upstream: vLLM asks the registered class's
``maybe_compute_seq_lens``, which the 310P class does not define, and vLLM's
own returns ``None`` on every backend but FlashInfer.

The pieces every 310P family shares (``state_maker``, ``host_seq_len``,
``attend``, ``build_family``) live here; :mod:`.v014_310p` and
:mod:`.v023_310p` use them.
"""
import torch

from npu_shim.patch import TargetMismatch
from npu_shim.patches._shared.code import names_in_code
from npu_shim.patches._shared.host_data import is_host
from npu_shim.patches.vllm_ascend.mm_encoder import common as C

# The 310P layer's state, apart from the main class's: family ascend-subclass-unpad's 310P class derives
# from AscendMMEncoderAttention, which vllm.mm_encoder_attn may have patched too.
STATE_ATTR = "_npu_shim_mm_encoder_310p_state"
BASE_NAME = "MMEncoderAttention"
ASCEND_MAIN_CLASS = "AscendMMEncoderAttention"
UNPAD = "_npu_flash_attention_unpad"
UNPAD_V2 = "_npu_flash_attention_unpad_v2"
FORWARD_PARAMS = ("self", "query", "key", "value", "cu_seqlens", "max_seqlen", "sequence_lengths")


class OpCall:
    """The torch_npu op a layer calls and the extra arguments upstream gives it.

    The op is looked up on upstream's ``torch_npu`` at every call, as upstream's
    own ``torch_npu.<op>(...)`` does.
    """

    __slots__ = ("name", "extra")

    def __init__(self, name, **extra):
        self.name = name
        self.extra = extra

    def __call__(self, torch_npu, **arguments):
        getattr(torch_npu, self.name)(**arguments, **self.extra)

    def __repr__(self):
        return "OpCall(%s%s)" % (self.name, "".join(", %s=%r" % kv for kv in self.extra.items()))


UNPAD_CALL = OpCall(UNPAD)


def state_maker(pads, choose_op=None):
    """``make(layer)`` for :func:`~npu_shim.patches.vllm_ascend.mm_encoder.common.layer_state`.

    ``pads``: the release pads 64 < D < 128 to 128. ``choose_op(layer)``: the
    :class:`OpCall` (default: ``_npu_flash_attention_unpad``).
    """

    def make(layer):
        pad = pads and C.PAD_MIN < layer.head_size < C.PAD_TO
        op = choose_op(layer) if choose_op is not None else UNPAD_CALL
        return C.LayerState(C.default_scale(layer), C.PAD_TO if pad else layer.head_size, op)

    return make


def host_seq_len(layer, query, cu_seqlens, context):
    """Per-segment lengths on the host in ``cu_seqlens``' dtype, read once per forward."""
    if cu_seqlens is None:
        # bsz sequences of q_len tokens, as upstream's host arange (int32) gives them.
        bsz, q_len = query.shape[:2]
        return torch.full((bsz,), q_len, dtype=torch.int32)
    if isinstance(cu_seqlens, torch.Tensor) and not is_host(cu_seqlens):
        context.count("upstream_host_copies")   # upstream: .to("cpu") in every layer
    return torch.diff(C.host_values(layer, cu_seqlens, context))


def attend(layer, state, torch_npu, query, key, value, seq_len):
    """Upstream's 310P op call: K/V repeated to the query heads, head dim padded by the
    release's rule, ``out=``; returns (B, S, N, D) for 4-D queries, (B, S, N*D) for 3-D."""
    heads = layer.num_heads
    q, k, v = C.repeat_kv_to_heads(query, key, value, heads, layer.num_kv_heads, layer.head_size)
    q, k, v = (C.pad_head_dim(x, state.pad_to) for x in (q, k, v))
    out = torch.empty_like(q)
    state.kernel(torch_npu, query=q, key=k, value=v, seq_len=seq_len, scale_value=state.scale,
                 num_heads=heads, num_kv_heads=k.shape[1], out=out)
    return C.to_upstream_shape(out, query, layer.head_size, heads)


def check_family(cls, op_names, absent_names=()):
    """The 0.18.0rc1+ shape: a direct MMEncoderAttention subclass whose forward_oot takes
    ``sequence_lengths``, reads ``torch.diff(cu_seqlens)`` and calls ``torch_npu.<op_names>``."""
    bases = [base.__name__ for base in cls.__mro__[1:]]
    if BASE_NAME not in bases:
        raise TargetMismatch("%s no longer derives from vLLM's %s" % (cls.__name__, BASE_NAME))
    if ASCEND_MAIN_CLASS in bases:
        raise TargetMismatch("%s derives from %s (family ascend-subclass-unpad's shape)" % (cls.__name__, ASCEND_MAIN_CLASS))
    forward = C.own_function(cls, "forward_oot")
    C.check_params(forward, FORWARD_PARAMS, ((),), cls.__name__ + ".forward_oot")
    names = names_in_code(forward.__code__, nested=False)
    if "torch_npu" not in forward.__globals__ or not all(op in names for op in op_names):
        raise TargetMismatch("%s.forward_oot no longer calls torch_npu.%s"
                             % (cls.__name__, " / ".join(op_names)))
    if "diff" not in names:
        raise TargetMismatch("%s.forward_oot no longer takes the lengths from torch.diff(cu_seqlens)"
                             % cls.__name__)
    present = [name for name in absent_names if name in names]
    if present:
        raise TargetMismatch("%s.forward_oot uses %s (a later release's shape)"
                             % (cls.__name__, ", ".join(present)))


def build_family(cls, make_state, context):
    """``forward_oot`` of the 0.18.0rc1+ 310P shape: upstream's op call (the layer's
    :class:`OpCall`) with host lengths read once per forward and the model's scale."""
    original_forward = vars(cls)["forward_oot"]
    upstream_globals = original_forward.__globals__

    def forward_oot(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        context.count("calls")
        state = C.layer_state(self, make_state, STATE_ATTR)
        seq_len = host_seq_len(self, query, cu_seqlens, context)
        return attend(self, state, upstream_globals["torch_npu"], query, key, value, seq_len)

    return {"forward_oot": context.present(forward_oot, original_forward)}


def check(cls, context):
    check_family(cls, (UNPAD,), absent_names=(UNPAD_V2,))


def build(cls, context):
    return build_family(cls, state_maker(pads=True), context)
