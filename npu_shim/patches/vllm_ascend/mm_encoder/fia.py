"""What the fused-infer families of ``AscendMMEncoderAttention`` share (v022, v023).

From 0.22.1rc1 on, vllm-ascend's ``forward_oot`` reshapes Q/K/V to TND
(K/V repeated to the query heads with ``repeat_interleave``), then either

* eager: builds host ``actual_seq_lengths`` (a device->host copy per layer
  where the lengths live on the device), pads head dims 64 < D < 128 to 128 and
  calls ``torch_npu.npu_fused_infer_attention_score`` TND, or
* ACL-graph capture (``get_encoder_forward_context().capturing``, set by
  ``vllm_ascend.worker.encoder_acl_graph.set_encoder_forward_context`` while
  the encoder graph is captured): records the op inside
  ``graph_task_group_begin/end`` for replay-time length updates.

The families replace ``forward_oot``, and upstream's ``_forward_capture_fia``
and ``_run_vit_fia`` by themselves edited at the K/V head count only. While
capture is active ``forward_oot`` hands the call to upstream's own (counted as
``upstream_calls``; replay rebinds the lengths from vLLM's host buffers
anyway), which reaches the edited capture functions: there too upstream repeats
K/V to ``num_heads`` and passed ``num_kv_heads`` to the workspace query, to the
captured op and (through ``params.attn_params``) to the replay's rebinding of
it; the edit passes the repeated K/V's own head count (``k.shape[1]``,
``key.shape[1]``) in those three places, nothing else. For a tower with as many
K/V heads as query heads that is the same number (the same call); for a grouped
tower (EXAONE 4.5's, 16 heads over 8, a Qwen2.5-VL subclass, so capturable;
in vLLM 0.22.1 .. 0.30.0) upstream's call did not match its K/V. The
eager path never calls ``_run_vit_fia`` (the families' ``forward_oot`` makes its
own call). Otherwise they make upstream's eager op call with upstream's
arguments and module constants, changing:

* where the host lengths come from: :func:`common.host_values`, at most one
  device->host copy per encoder forward (the family's ``host_lengths``);
* the scale where upstream ignores the model's (0.22.1rc1);
* ``num_key_value_heads``: the head count of the K/V tensors handed over.
  Upstream repeats K/V to ``num_heads`` yet passes ``num_kv_heads``, which
  under GQA does not match them (the documented op takes K/V of shape
  (T, num_key_value_heads, D); the emulation rejects upstream's call).

Switch ``NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1`` (default 0, read when the
family is built): the eager path makes family 0.18.0's op call instead
(:func:`.v018.attend`: ``torch_npu.npu_fusion_attention``, ``input_layout="TND"``,
the cumulative lengths as 0-d host tensors for queries and keys, ``head_num``,
``scale``), on the same repeated and padded Q/K/V, with the same host lengths
and scale as the FIA call would get. Why: vllm-ascend #13699 (open) reports the
encoder's FIA call (TND, ``sparse_mode=0``, no mask) returning a uniform
average on some stacks from 0.22.1rc1 on; that 0.18.0 call is the one vllm-ascend
0.18.0 shipped for this layer (and 0.19.1rc1 .. 0.21.0rc1 on A5 through
``DeviceOperator``). What is verified here: with the switch on, the FIA op is
not called, the fusion op is, with 0.18.0's argument layout, and the output
matches the float64 reference, on the emulated ops. What is not: the defect
itself (not reproduced: the emulation computes what the documentation says),
that the fusion op avoids it on an affected stack, and the capture path (while
the encoder ACL graph is captured, upstream's FIA call runs untouched, switch
or not). A call whose query and key lengths differ is refused with a
ValueError under the switch (0.18.0's call takes one list for both).
"""
import torch

from npu_shim import _config
from npu_shim.patch import TargetMismatch
from npu_shim.patches._shared.host_data import is_host
from npu_shim.patches._shared.source_edit import ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import Edited, edit_of
from npu_shim.patches.vllm_ascend.mm_encoder import common as C
from npu_shim.patches.vllm_ascend.mm_encoder import v018

FUSION_SWITCH = _config.MM_ENCODER_FUSION_SWITCH

BASE_NAME = "MMEncoderAttention"
UPSTREAM_OP = "npu_fused_infer_attention_score"
CAPTURE_CONTEXT = "get_encoder_forward_context"
FORWARD_PARAMS = ("self", "query", "key", "value", "cu_seqlens", "max_seqlen", "sequence_lengths")
# Upstream's module constants the op call uses: passed as upstream has them.
CONSTANTS = ("FIA_BLOCK_SIZE", "SWA_INT_MAX")
# The eager/capture split of forward_oot and the op call in _run_vit_fia.
FORWARD_USES = (CAPTURE_CONTEXT, "capturing", "_forward_capture_fia", "_forward_eager_fia")
# The captured call: upstream's K/V are repeated to the query heads (_reshape_qkv_to_3d) before
# either path, so the head count FIA gets is the repeated K/V's, as in the eager call below:
# _run_vit_fia's op call (its key), _forward_capture_fia's workspace query and the head count it
# packs for the replay's rebinding (update_encoder_graph_params), both of its padded k.
KV_HEADS = "self.num_kv_heads"
CAPTURE_EDITS = {
    "_run_vit_fia": (ReplaceExpression(KV_HEADS, "key.shape[1]"),),
    "_forward_capture_fia": (ReplaceExpression(KV_HEADS, "k.shape[1]", count=2),),
}


def check_family(cls, eager_uses, fia_uses, fia_avoids=()):
    """The 0.22.1rc1+ shape; ``eager_uses``/``fia_uses``: names the family's
    ``_forward_eager_fia`` / ``_run_vit_fia`` must refer to, ``fia_avoids``: names
    ``_run_vit_fia`` must not. Returns :func:`capture_edited` (the family's ``context.found``)."""
    if not any(base.__name__ == BASE_NAME for base in cls.__mro__[1:]):
        raise TargetMismatch("%s no longer derives from vLLM's %s" % (cls.__name__, BASE_NAME))
    forward = C.own_function(cls, "forward_oot")
    C.check_params(forward, FORWARD_PARAMS, ((),), cls.__name__ + ".forward_oot")
    upstream_globals = forward.__globals__
    for name in ("torch_npu", CAPTURE_CONTEXT) + CONSTANTS:
        if name not in upstream_globals:
            raise TargetMismatch("%s has no module-level %s" % (forward.__module__, name))
    _require(cls, forward, FORWARD_USES)
    _require(cls, C.own_function(cls, "_forward_eager_fia"), eager_uses)
    run_fia = C.own_function(cls, "_run_vit_fia")
    _require(cls, run_fia, (UPSTREAM_OP,) + tuple(fia_uses))
    present = [name for name in fia_avoids if C.calls_name(run_fia, name)]
    if present:
        raise TargetMismatch("%s._run_vit_fia refers to %s" % (cls.__name__, ", ".join(present)))
    return capture_edited(cls)


def capture_edited(cls):
    """``{name: Edited(upstream's function, the same edited)}`` for :data:`CAPTURE_EDITS` (a missing
    or repeated anchor: TargetMismatch naming it)."""
    found = {}
    for name, edits in CAPTURE_EDITS.items():
        original = C.own_function(cls, name)
        found[name] = Edited(original, edit_function(original, edits))
    return found


def _require(cls, function, names):
    missing = [name for name in names if not C.calls_name(function, name)]
    if missing:
        raise TargetMismatch("%s.%s no longer refers to %s"
                             % (cls.__name__, function.__name__, ", ".join(missing)))


def make_state(layer):
    pad = C.PAD_MIN < layer.head_size < C.PAD_TO
    return C.LayerState(C.default_scale(layer), C.PAD_TO if pad else layer.head_size)


def build_forward(cls, host_lengths, context):
    """``{"forward_oot": f}`` around ``host_lengths(layer, upstream_globals, query,
    tokens_q, tokens_kv, cu_seqlens, sequence_lengths, context) -> (lengths_q, lengths_kv)``, and
    the edited capture functions ``check_family`` found (``context.found``)."""
    original_forward = vars(cls)["forward_oot"]
    upstream_globals = original_forward.__globals__
    block_size, no_band = (upstream_globals[name] for name in CONSTANTS)
    # Later releases of the family hand K/V over with .contiguous(), the first ones as they are.
    contiguous_kv = C.calls_name(vars(cls)["_run_vit_fia"], "contiguous")
    fusion = _config.settings().mm_encoder_fusion_attention

    def forward_oot(self, query, key, value, cu_seqlens=None, max_seqlen=None, sequence_lengths=None):
        # Looked up per call, as upstream's forward_oot does (tests may replace it).
        if upstream_globals[CAPTURE_CONTEXT]().capturing:
            context.count("upstream_calls")
            return original_forward(self, query, key, value, cu_seqlens=cu_seqlens,
                                    max_seqlen=max_seqlen, sequence_lengths=sequence_lengths)
        context.count("calls")
        state = C.layer_state(self, make_state)
        heads = self.num_heads
        q, k, v = C.repeat_kv_to_heads(query, key, value, heads, self.num_kv_heads, self.head_size)
        lengths_q, lengths_kv = host_lengths(self, upstream_globals, query, q.shape[0], k.shape[0],
                                             cu_seqlens, sequence_lengths, context)
        q, k, v = (C.pad_head_dim(x, state.pad_to) for x in (q, k, v))
        if fusion:
            out = fusion_attention(upstream_globals, q, k, v, lengths_q, lengths_kv, heads, state.scale)
            return C.to_upstream_shape(out, query, self.head_size, heads)
        if contiguous_kv:
            k, v = k.contiguous(), v.contiguous()
        out, _ = upstream_globals["torch_npu"].npu_fused_infer_attention_score(
            query=q, key=k, value=v, atten_mask=None, block_table=None, input_layout="TND",
            block_size=block_size, actual_seq_lengths=lengths_q, actual_seq_lengths_kv=lengths_kv,
            num_key_value_heads=k.shape[1], num_heads=heads, scale=state.scale, sparse_mode=0,
            pre_tokens=no_band, next_tokens=no_band)
        return C.to_upstream_shape(out, query, self.head_size, heads)

    replacements = {"forward_oot": context.present(forward_oot, original_forward)}
    for name in CAPTURE_EDITS:
        replacements[name] = context.present(
            edit_of(context, name), context.found[name].original,
            "the captured FIA call gets the repeated K/V's head count, not num_kv_heads")
    return replacements


def fusion_attention(upstream_globals, q, k, v, lengths_q, lengths_kv, heads, scale):
    """Family 0.18.0's op call (:func:`.v018.attend`) for cumulative host lengths ``lengths_q``
    (``NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1``)."""
    lengths_q, lengths_kv = [int(n) for n in lengths_q], [int(n) for n in lengths_kv]
    if lengths_q != lengths_kv:
        raise ValueError("%s=1 makes family fusion-attention-tnd's npu_fusion_attention call, which takes one list of "
                         "lengths for queries and keys; this call has query lengths %s and key lengths %s "
                         "(unset the switch for it)" % (FUSION_SWITCH, lengths_q, lengths_kv))
    seq_lens = torch.diff(torch.tensor([0] + lengths_q, dtype=torch.int32))    # per segment, as that family's
    return v018.attend(upstream_globals, q, k, v, seq_lens, heads, scale)


def host_tensor(layer, values, context):
    """``values`` on the host, read at most once per encoder forward; counts the copy
    upstream would have made in this layer."""
    if not is_host(values):
        context.count("upstream_host_copies")
    return C.host_values(layer, values, context)


def uniform_lengths(query):
    """Cumulative lengths of ``bsz`` sequences of ``q_len`` tokens (models that pass no
    ``cu_seqlens``): upstream builds them with ``torch.arange`` on the host; plain ints here."""
    bsz, q_len = query.shape[:2]
    return list(range(q_len, (bsz + 1) * q_len, q_len))
