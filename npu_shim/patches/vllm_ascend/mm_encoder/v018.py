"""Family v018: vllm-ascend 0.18.0 (TND ``npu_fusion_attention``, ``sequence_lengths``).

Upstream there: ``forward_oot`` takes ``sequence_lengths`` when the tower
computed them with the class's ``maybe_compute_seq_lens`` (host, once per
forward: vLLM 0.18's Qwen3-VL does; MoonViT and most other towers pass
nothing) and otherwise copies ``torch.diff(cu_seqlens).to("cpu")`` in every
layer (27 copies per MoonViT forward); a device ``sequence_lengths`` is copied
per layer too. It repeats K/V to the query heads, pads 64 < D < 128 to 128
(``self.enable_pad``) and calls ``torch_npu.npu_fusion_attention`` TND with the
cumulative lengths as a list of 0-d tensors and ``scale=self.scale_value``,
which is ``head_size ** -0.5`` whatever ``scale`` the model gave.

Replaced: ``forward_oot`` only. The same op call and layout; the lengths from
:func:`~npu_shim.patches.vllm_ascend.mm_encoder.common.host_values` (at most one copy per
forward, none for host ``sequence_lengths`` / host ``cu_seqlens``); the
model's ``scale``. ``__init__`` stays upstream's (it parses nothing);
``enable_pad`` / ``scale_value`` are not needed (a layer made with ``__new__``
works).
"""
import torch

from npu_shim.patch import TargetMismatch
from npu_shim.patches._shared.code import names_in_code
from npu_shim.patches._shared.host_data import is_host
from npu_shim.patches.vllm_ascend.mm_encoder import common as C

BASE_NAME = "MMEncoderAttention"
SEQ_LENS_HOOK = "maybe_compute_seq_lens"
UPSTREAM_OP = "npu_fusion_attention"
FORWARD_PARAMS = ("self", "query", "key", "value", "cu_seqlens", "max_seqlen", "sequence_lengths")


def check_family(cls, op_name, op_owner):
    """The 0.18.0 .. 0.21.0rc1 shape: ``sequence_lengths`` taken, ``op_owner.op_name`` called."""
    if not any(base.__name__ == BASE_NAME for base in cls.__mro__[1:]):
        raise TargetMismatch("%s no longer derives from vLLM's %s" % (cls.__name__, BASE_NAME))
    if SEQ_LENS_HOOK not in vars(cls):
        raise TargetMismatch("%s has no %s (this family's shape has)"
                             % (cls.__name__, SEQ_LENS_HOOK))
    forward = C.own_function(cls, "forward_oot")
    C.check_params(forward, FORWARD_PARAMS, ((),), cls.__name__ + ".forward_oot")
    names = names_in_code(forward.__code__, nested=False)
    if op_owner not in forward.__globals__ or op_name not in names or op_owner not in names:
        raise TargetMismatch("%s.forward_oot no longer calls %s.%s" % (cls.__name__, op_owner, op_name))
    if "actual_seq_lengths" in names or "npu_fused_infer_attention_score" in names:
        raise TargetMismatch("%s.forward_oot is the later families' fused-infer shape" % cls.__name__)


def host_seq_lens(layer, query, cu_seqlens, sequence_lengths, context):
    """Per-segment lengths as a host tensor, read at most once per forward."""
    if sequence_lengths is not None:
        values = sequence_lengths
    elif cu_seqlens is not None:
        values = cu_seqlens
    else:
        # Uniform lengths (Hunyuan-OCR passes none): built on the host, as upstream does.
        bsz, q_len = query.shape[:2]
        return torch.full((bsz,), q_len, dtype=torch.int32)
    if isinstance(values, torch.Tensor) and not is_host(values):
        context.count("upstream_host_copies")   # upstream: .to("cpu") in every layer
    host = C.host_values(layer, values, context)
    return host if sequence_lengths is not None else torch.diff(host)


def make_state(layer):
    pad = C.PAD_MIN < layer.head_size < C.PAD_TO
    return C.LayerState(C.default_scale(layer), C.PAD_TO if pad else layer.head_size)


def build_family(cls, attend, context):
    """``forward_oot`` of the 0.18.0 .. 0.21.0rc1 family around ``attend(globals, q, k, v, seq_lens, heads, scale)``."""
    original_forward = vars(cls)["forward_oot"]
    upstream_globals = original_forward.__globals__

    def forward_oot(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        context.count("calls")
        state = C.layer_state(self, make_state)
        seq_lens = host_seq_lens(self, query, cu_seqlens, sequence_lengths, context)
        heads = self.num_heads
        q, k, v = C.repeat_kv_to_heads(query, key, value, heads, self.num_kv_heads, self.head_size)
        q, k, v = (C.pad_head_dim(x, state.pad_to) for x in (q, k, v))
        out = attend(upstream_globals, q, k, v, seq_lens, heads, state.scale)
        return C.to_upstream_shape(out, query, self.head_size, heads)

    return {"forward_oot": context.present(forward_oot, original_forward)}


def attend(upstream_globals, q, k, v, seq_lens, heads, scale):
    cumulative = list(seq_lens.cumsum(0))   # 0-d host tensors, as upstream passes them
    return upstream_globals["torch_npu"].npu_fusion_attention(
        query=q, key=k, value=v, actual_seq_qlen=cumulative, actual_seq_kvlen=cumulative,
        head_num=heads, scale=scale, input_layout="TND")[0]


def check(cls, context):
    check_family(cls, UPSTREAM_OP, "torch_npu")


def build(cls, context):
    return build_family(cls, attend, context)
