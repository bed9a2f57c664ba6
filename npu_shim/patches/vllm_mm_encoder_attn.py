"""vllm.mm_encoder_attn — one host sync per encoder forward, honour ``scale``.

Why: vllm-ascend's ``AscendMMEncoderAttention.forward_oot`` (the attention of
  every ViT tower vLLM builds on ``MMEncoderAttention``: Qwen2.5/3-VL, ...)
  needs the segment lengths on the host. 0.13.0 and 0.14.0rc1 compute
  ``torch.diff(cu_seqlens).to("cpu")`` in every layer: a device->host sync per
  layer (27 per Qwen3-VL vision forward) that leaves the NPU idle in between.
  They also pass ``head_size ** -0.5`` to the kernel, ignoring a ``scale`` the
  model gave. 0.15.0rc1 ships the seed's fix (vllm-ascend PR 6448, seed 001)
  behind ``vllm_version_is("0.15.0")``: with any vLLM other than 0.15.0 (or
  ``VLLM_VERSION`` set to another version) it parses the digits of the layer
  ``prefix`` into a layer index and refreshes a module-global
  ``seq_lens_cpu_cache`` when that index is 0. That raises ``ValueError`` for a
  prefix without digits, never refreshes for a prefix like ``visual2.blocks.0``
  (index 20), lets two encoders in one process read each other's lengths, and
  gives Qwen2.5-VL's full-attention layers (7/15/23/31) the window lengths of
  layer 0.
  With vLLM 0.15.0 it copies per layer like 0.13. 0.16.0rc1 and 0.17.0rc1
  accept a ``sequence_lengths`` argument but ignore it (vLLM 0.16/0.17 do not
  pass it for Ascend) and still copy per layer.
How: ``__init__`` runs the base ``MMEncoderAttention.__init__`` with the same
  arguments (no prefix parsing) and builds one
  :class:`npu_shim.kernels.VarlenAttention` per layer: scale (``self.scale``
  when the model passed one, else ``head_size ** -0.5``), zero-padding of head
  dims 64 < D < 128 to 128 and the NPU path (TND ``npu_fusion_attention`` on
  A2/A3, ``_npu_flash_attention_unpad`` on 310P) are decided there, once.
  ``forward_oot`` takes the host boundaries from
  :func:`npu_shim.kernels.host_cu_seqlens`, cached per ``cu_seqlens`` tensor
  (identity and version counter, weakly): every layer of one forward receives
  the same tensor, so a forward costs at most one sync whatever the depth (one
  per distinct tensor: Qwen2.5-VL's full and windowed layers get two, so 2
  instead of 32), and none when ``cu_seqlens`` is on the host or None (uniform
  lengths are built as host ints). Nothing is keyed on the prefix and nothing is process-global, so
  two encoders alternate safely. K/V are not repeated for GQA (the kernel takes
  ``num_kv_heads``). Output shape and dtype are upstream's: (B, S, N, D) for
  4-D inputs, (B, S, N*D) for 3-D inputs, in the query's dtype.
Upstream fix: vllm-ascend 0.18.0 (with vLLM 0.18) — vLLM calls the class's
  ``maybe_compute_seq_lens`` once per encoder forward on host NumPy data and
  passes ``sequence_lengths`` to every layer (the Qwen2.5-VL / Qwen3-VL /
  Qwen3-Omni towers do; other towers still copy per layer there); the
  structural check skips the patch wherever that hook exists. 0.23.0rc1
  rewrote ``forward_oot`` (fused-infer attention, ``self.scale``) and the check
  refuses that shape. (The ``head_size ** -0.5`` scale stays upstream through
  0.22.1rc1.)
Remove when: the pinned vllm-ascend is 0.18 or later.
"""
import inspect

from npu_shim.patch import NotNeeded, Patch, TargetMismatch

CLASS_NAME = "AscendMMEncoderAttention"
BASE_NAME = "MMEncoderAttention"
FIXED_UPSTREAM_HOOK = "maybe_compute_seq_lens"   # vllm-ascend 0.18.0+
UPSTREAM_KERNEL = "_npu_flash_attention_unpad"    # what 0.13.0 .. 0.17.0rc1 call

FORWARD_PARAMS = ("self", "query", "key", "value", "cu_seqlens", "max_seqlen")
FORWARD_OPTIONAL = ((), ("sequence_lengths",))    # 0.16.0rc1 / 0.17.0rc1 accept (and ignore) it
INIT_PARAMS = ("self", "num_heads", "head_size", "scale", "num_kv_heads", "prefix")
INIT_OPTIONAL = ((), ("multimodal_config",))      # 0.13.0 / 0.14.0rc1

# The attribute under which the patched __init__ attaches each layer's kernel handle.
KERNEL_ATTR = "npu_shim_kernel"


def _own_function(cls, name):
    function = vars(cls).get(name)
    if not inspect.isfunction(function):
        raise TargetMismatch("%s.%s is not a function defined by the class" % (cls.__name__, name))
    return function


def _check_params(function, required, optional_tails, what):
    params = tuple(inspect.signature(function).parameters)
    if params[: len(required)] != required or params[len(required):] not in optional_tails:
        raise TargetMismatch(
            "%s takes %s; the patch knows %s" % (
                what, params, " or ".join(str(required + tail) for tail in optional_tails)))


def check(module):
    """Apply only to the shape this patch was written for (0.13.0 .. 0.17.0rc1)."""
    cls = getattr(module, CLASS_NAME)
    if FIXED_UPSTREAM_HOOK in vars(cls):
        raise NotNeeded(
            "fixed upstream: vLLM precomputes host sequence_lengths once per encoder forward "
            "through %s.%s (vllm-ascend 0.18.0-0.22.1rc1; used by the models that pass "
            "sequence_lengths)" % (CLASS_NAME, FIXED_UPSTREAM_HOOK))
    if not any(base.__name__ == BASE_NAME for base in cls.__mro__[1:]):
        raise TargetMismatch("%s no longer derives from vLLM's %s" % (CLASS_NAME, BASE_NAME))
    forward = _own_function(cls, "forward_oot")
    _check_params(forward, FORWARD_PARAMS, FORWARD_OPTIONAL, CLASS_NAME + ".forward_oot")
    _check_params(_own_function(cls, "__init__"), INIT_PARAMS, INIT_OPTIONAL, CLASS_NAME + ".__init__")
    if UPSTREAM_KERNEL not in forward.__code__.co_names:
        raise TargetMismatch(
            "%s.forward_oot no longer calls torch_npu.%s; its host-side handling of "
            "cu_seqlens is unknown to this patch" % (CLASS_NAME, UPSTREAM_KERNEL))


def build(module):
    cls = getattr(module, CLASS_NAME)
    original_init = vars(cls)["__init__"]
    original_forward = vars(cls)["forward_oot"]
    init_signature = inspect.signature(original_init)
    takes_sequence_lengths = "sequence_lengths" in inspect.signature(original_forward).parameters

    def __init__(self, *args, **kwargs):
        # Upstream's __init__ hands every argument to the base class, then (0.15.0rc1)
        # parses the prefix; here the base gets the same arguments and nothing is parsed.
        bound = init_signature.bind(self, *args, **kwargs)
        bound.apply_defaults()
        arguments = dict(bound.arguments)
        del arguments["self"]
        super(cls, self).__init__(**arguments)
        _attach_kernel(self)

    if takes_sequence_lengths:
        def forward_oot(self, query, key, value, cu_seqlens=None, max_seqlen=None,
                        sequence_lengths=None):
            # Upstream 0.16.0rc1/0.17.0rc1 ignore sequence_lengths too (vLLM does not pass it).
            return _forward(self, query, key, value, cu_seqlens)
    else:
        def forward_oot(self, query, key, value, cu_seqlens=None, max_seqlen=None):
            return _forward(self, query, key, value, cu_seqlens)

    for replacement, original in ((__init__, original_init), (forward_oot, original_forward)):
        replacement.__name__ = original.__name__
        replacement.__qualname__ = original.__qualname__
        replacement.__doc__ = (
            "npu-shim (vllm.mm_encoder_attn) replacement of %s.%s; see %s."
            % (original.__module__, original.__qualname__, __name__))
    __init__.__signature__ = init_signature
    forward_oot.__signature__ = inspect.signature(original_forward)
    return {CLASS_NAME + ".__init__": __init__, CLASS_NAME + ".forward_oot": forward_oot}


class KernelHandle:
    """A layer's :class:`~npu_shim.kernels.VarlenAttention`, safe to copy with the layer.

    The kernel holds the torch_npu module, which cannot be pickled, so a layer
    holding it directly would break ``copy.deepcopy`` and pickling of the model
    (upstream layers support both). The kernel is configuration only, never
    changed after construction: deep copies share it, and unpickling rebuilds it
    from its arguments, choosing the NPU path for the machine that loads it.
    """

    __slots__ = ("varlen",)

    def __init__(self, varlen):
        self.varlen = varlen

    def __deepcopy__(self, memo):
        return self

    def __reduce__(self):
        v = self.varlen
        return (_rebuild_handle, (v.num_heads, v.head_dim, v.num_kv_heads, v.scale, v.v_head_dim,
                                  None))

    def __repr__(self):
        return "KernelHandle(%r)" % (self.varlen,)


def _rebuild_handle(num_heads, head_dim, num_kv_heads, scale, v_head_dim, backend):
    from npu_shim.kernels import VarlenAttention

    return KernelHandle(VarlenAttention(num_heads, head_dim, num_kv_heads=num_kv_heads, scale=scale,
                                        v_head_dim=v_head_dim, backend=backend))


def _attach_kernel(layer):
    """Decide scale, padding and NPU path once per layer."""
    scale = layer.scale if layer.scale is not None else layer.head_size ** -0.5
    handle = _rebuild_handle(layer.num_heads, layer.head_size, layer.num_kv_heads, scale,
                             layer.head_size, None)
    setattr(layer, KERNEL_ATTR, handle)
    # Upstream 0.15.0rc1+ expose these two; keep them, holding what is really used.
    layer.scale_value = handle.varlen.scale
    layer.enable_pad = handle.varlen.qk_pad_dim != layer.head_size


def _forward(layer, query, key, value, cu_seqlens):
    bsz, q_len = query.shape[:2]
    kv_len = key.shape[1]
    heads, kv_heads, head_size = layer.num_heads, layer.num_kv_heads, layer.head_size
    q = query.view(bsz * q_len, heads, head_size)
    k = key.view(bsz * kv_len, kv_heads, head_size)
    v = value.view(bsz * kv_len, kv_heads, head_size)
    if cu_seqlens is None:
        # bsz sequences of q_len tokens each, as upstream assumes: host ints, no tensor, no sync.
        cu_seqlens = tuple(range(0, (bsz + 1) * q_len, q_len))
    out = getattr(layer, KERNEL_ATTR).varlen(q, k, v, cu_seqlens)
    if query.dim() == 4:
        return out.reshape(bsz, q_len, heads, head_size).contiguous()
    return out.reshape(bsz, q_len, heads * head_size).contiguous()


PATCH = Patch(
    name="vllm.mm_encoder_attn",
    target="vllm_ascend.ops.mm_encoder_attention",
    replaces=(CLASS_NAME + ".__init__", CLASS_NAME + ".forward_oot"),
    requires={"vllm-ascend": ">=0.13,<0.18"},
    outside_window={"vllm-ascend": "0.18.0+ take host sequence lengths from vLLM (Qwen-VL encoders); 0.23.0rc1+ rewrote forward_oot"},
    needs_npu=True,
    check=check,
    build=build,
    summary="host seq lens once per cu_seqlens tensor (no prefix cache, no global), honour scale",
)
