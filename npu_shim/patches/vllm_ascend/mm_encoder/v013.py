"""Family v013: vllm-ascend 0.13.0 .. 0.17.0rc1 (``_npu_flash_attention_unpad`` everywhere).

Upstream there: ``forward_oot`` copies ``torch.diff(cu_seqlens).to("cpu")`` in
every layer (0.13.0/0.14.0rc1 build the uniform ``cu_seqlens`` on
``query.device`` when none is given: a copy too), repeats K/V to the query
heads with ``repeat_interleave``, zero-pads head dims 64 < D < 128 to 128
(0.13.0/0.14.0rc1 only while ``envs_ascend.USE_OPTIMIZED_MODEL``, default on)
and calls ``torch_npu._npu_flash_attention_unpad`` on every SoC with
``scale_value=head_size ** -0.5``, whatever ``scale`` the model gave.
0.15.0rc1 with a vLLM other than 0.15.0 parses the prefix digits into a layer
index in ``__init__`` and shares a module-global lengths cache between every
encoder in the process; 0.16.0rc1/0.17.0rc1 accept ``sequence_lengths`` and
ignore it.

Replaced: ``__init__`` (the base ``MMEncoderAttention.__init__`` with the same
arguments, no prefix parsing) and ``forward_oot``: the same op call with
upstream's layout and padding rule, lengths from
:func:`~npu_shim.patches.vllm_ascend.mm_encoder.common.host_values` (one copy per
forward), the model's ``scale``. Under GQA the op gets the head count of the
repeated K/V (upstream passes ``num_kv_heads``, which does not match them).
``NPU_SHIM_MM_ENCODER_TND=1`` switches to npu-shim's TND
``npu_fusion_attention`` kernel (``npu_shim.kernels.VarlenAttention``:
unrepeated K/V, ``_npu_flash_attention_unpad`` on 310P); default off, that call
has not run on hardware.
"""
import inspect

import torch

from npu_shim import _config
from npu_shim.patch import TargetMismatch
from npu_shim.patches._shared.host_data import is_host
from npu_shim.patches.vllm_ascend.mm_encoder import common as C

BASE_NAME = "MMEncoderAttention"
FIXED_UPSTREAM_HOOK = "maybe_compute_seq_lens"   # the later families' shape
UPSTREAM_OP = "_npu_flash_attention_unpad"
OPTIMIZED_MODEL_SWITCH = "USE_OPTIMIZED_MODEL"   # the first releases of the family pad only while it is on

FORWARD_PARAMS = ("self", "query", "key", "value", "cu_seqlens", "max_seqlen")
FORWARD_OPTIONAL = ((), ("sequence_lengths",))    # the last releases of the family accept (and ignore) it
INIT_PARAMS = ("self", "num_heads", "head_size", "scale", "num_kv_heads", "prefix")
INIT_OPTIONAL = ((), ("multimodal_config",))      # the first releases of the family


def check(cls, context):
    if FIXED_UPSTREAM_HOOK in vars(cls):
        raise TargetMismatch("%s defines %s (a later family's shape)" % (cls.__name__, FIXED_UPSTREAM_HOOK))
    if not any(base.__name__ == BASE_NAME for base in cls.__mro__[1:]):
        raise TargetMismatch("%s no longer derives from vLLM's %s" % (cls.__name__, BASE_NAME))
    forward = C.own_function(cls, "forward_oot")
    C.check_params(forward, FORWARD_PARAMS, FORWARD_OPTIONAL, cls.__name__ + ".forward_oot")
    C.check_params(C.own_function(cls, "__init__"), INIT_PARAMS, INIT_OPTIONAL, cls.__name__ + ".__init__")
    if not C.calls_name(forward, UPSTREAM_OP) or "torch_npu" not in forward.__globals__:
        raise TargetMismatch("%s.forward_oot no longer calls torch_npu.%s" % (cls.__name__, UPSTREAM_OP))


def build(cls, context):
    original_init = vars(cls)["__init__"]
    original_forward = vars(cls)["forward_oot"]
    upstream_globals = original_forward.__globals__
    init_signature = inspect.signature(original_init)
    takes_sequence_lengths = "sequence_lengths" in inspect.signature(original_forward).parameters
    # The first releases: pad only while envs_ascend.USE_OPTIMIZED_MODEL; read where upstream reads it.
    pads_if_optimized = C.calls_name(original_forward, OPTIMIZED_MODEL_SWITCH)
    upstream_copies_uniform = _builds_uniform_on_query_device(original_forward)
    use_tnd = _config.settings().mm_encoder_tnd

    def make_state(layer):
        pad = C.PAD_MIN < layer.head_size < C.PAD_TO
        if pad and pads_if_optimized:
            pad = bool(getattr(upstream_globals["envs_ascend"], OPTIMIZED_MODEL_SWITCH))
        kernel = None
        if use_tnd:
            from npu_shim.kernels import VarlenAttention

            kernel = VarlenAttention(layer.num_heads, layer.head_size, num_kv_heads=layer.num_kv_heads,
                                     scale=C.default_scale(layer))
        return C.LayerState(C.default_scale(layer), C.PAD_TO if pad else layer.head_size, kernel)

    def __init__(self, *args, **kwargs):
        # Upstream hands every argument to the base class, then (later releases) parses the
        # prefix; here the base gets the same arguments and nothing is parsed.
        bound = init_signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments["self"]
        super(cls, self).__init__(**arguments)
        state = C.layer_state(self, make_state)
        # Upstream's later releases expose these two; keep them, holding what is really used.
        self.scale_value = state.scale
        self.enable_pad = state.pad_to != self.head_size

    def forward(layer, query, key, value, cu_seqlens):
        context.count("calls")
        state = C.layer_state(layer, make_state)
        bsz, q_len = query.shape[:2]
        if cu_seqlens is None:
            # bsz sequences of q_len tokens, as upstream assumes: built on the host, no copy.
            seq_len = torch.full((bsz,), q_len, dtype=torch.int32)
            uniform_copy = upstream_copies_uniform and not is_host(query)
            context.count("upstream_host_copies", int(uniform_copy))
        else:
            if isinstance(cu_seqlens, torch.Tensor) and not is_host(cu_seqlens):
                context.count("upstream_host_copies")
            seq_len = torch.diff(C.host_values(layer, cu_seqlens, context))
        if state.kernel is not None:
            return _tnd_forward(layer, state.kernel, query, key, value, seq_len)
        heads = layer.num_heads
        q, k, v = C.repeat_kv_to_heads(query, key, value, heads, layer.num_kv_heads, layer.head_size)
        q, k, v = (C.pad_head_dim(x, state.pad_to) for x in (q, k, v))
        out = torch.empty_like(q)
        upstream_globals["torch_npu"]._npu_flash_attention_unpad(
            query=q, key=k, value=v, seq_len=seq_len, scale_value=state.scale,
            num_heads=heads, num_kv_heads=k.shape[1], out=out)
        return C.to_upstream_shape(out, query, layer.head_size, heads)

    if takes_sequence_lengths:
        def forward_oot(self, query, key, value, cu_seqlens=None, max_seqlen=None,
                        sequence_lengths=None):
            # Upstream's last releases of the family ignore sequence_lengths too (vLLM does not pass it).
            return forward(self, query, key, value, cu_seqlens)
    else:
        def forward_oot(self, query, key, value, cu_seqlens=None, max_seqlen=None):
            return forward(self, query, key, value, cu_seqlens)

    return {"__init__": context.present(__init__, original_init),
            "forward_oot": context.present(forward_oot, original_forward)}


def _builds_uniform_on_query_device(forward):
    """0.13.0/0.14.0rc1 build the uniform cu_seqlens on query.device (then copy it back)."""
    try:
        return "device=query.device" in inspect.getsource(forward)
    except (OSError, TypeError):
        return True


def _tnd_forward(layer, kernel, query, key, value, seq_len):
    """NPU_SHIM_MM_ENCODER_TND=1: one TND npu_fusion_attention call, K/V not repeated."""
    bsz, q_len = query.shape[:2]
    kv_len = key.shape[1]
    q = query.reshape(bsz * q_len, layer.num_heads, layer.head_size)
    k = key.reshape(bsz * kv_len, layer.num_kv_heads, layer.head_size)
    v = value.reshape(bsz * kv_len, layer.num_kv_heads, layer.head_size)
    cum = [0]
    for length in seq_len.tolist():      # a host tensor: no device transfer
        cum.append(cum[-1] + length)
    return C.to_upstream_shape(kernel(q, k, v, tuple(cum)), query, layer.head_size, layer.num_heads)
