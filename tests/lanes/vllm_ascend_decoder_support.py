"""Shared helpers for running vllm-ascend's decoder attention (``AscendAttentionBackendImpl``
of ``vllm_ascend.attention.attention_v1``) on CPU under npu-shim's torch_npu emulation.

Use (in a test of a vllm lane)::

    from vllm_ascend_decoder_support import DecoderCase, import_attention_v1

    attention_v1 = import_attention_v1()          # emulation + torch.npu, upstream's import order
    case = DecoderCase(num_heads=4, num_kv_heads=2, head_size=64, head_size_v=64,
                       block_size=128, num_blocks=4, dtype=torch.bfloat16)
    with case.config():                           # vLLM's VllmConfig current + forward context
        impl = case.impl(sliding_window=None, sinks=None)   # the real class, real __init__
        out = case.prefill(impl, q, k, v, q_lens=[5, 3])    # real forward(), PrefillNoCache
        out = case.decode(impl, q1, k1, v1)                 # real forward(), DecodeOnly, paged
    case.key_cache / case.value_cache             # the emulated KV cache the steps wrote

What is real and what is stand-in:

* the classes and their code: vllm-ascend's ``AscendAttentionBackendImpl`` (its ``__init__``,
  ``forward``, ``reshape_and_cache``, ``_get_fia_params``, ``forward_fused_infer_attention``)
  and vLLM's ``VllmConfig`` / ``set_forward_context``; the torch_npu ops are npu-shim's
  emulation (npu_shim/emulation), which checks dtypes and host arguments;
* built by hand here: the per-step ``AscendMetadata`` (vllm-ascend's own dataclass, filled
  with the fields its forward reads, as its ``AscendAttentionMetadataBuilder.build`` fills
  them from vLLM's ``CommonAttentionMetadata``: cumulative query ends
  ``actual_seq_lengths_q``, per-sequence ``seq_lens`` (a CPU tensor) and ``seq_lens_list``,
  ``block_tables`` int32, ``slot_mapping``, the compressed 2048 x 2048 causal mask), and the
  KV cache: two tensors (num_blocks, block_size, num_kv_heads, head_size[_v]) as the model
  runner allocates per layer (``get_kv_cache_shape``'s leading 2 split in two);
* the layer: a stand-in carrying what ``forward`` reads of it (``_k_scale_float``,
  ``_v_scale_float``, ``layer_name``).

``import_attention_v1`` imports ``vllm_ascend.ops`` first: importing ``attention_v1`` alone
hits upstream's own import cycle (``device.device_op`` -> ``ops`` -> ``ops.fused_moe`` ->
``device.device_op``) on vllm-ascend 0.21.0rc1-0.27.1rc1; a serving process imports
``vllm_ascend.ops`` earlier (the platform's custom-op registration), which this mirrors.
"""
import contextlib
import os

import torch

MASK_SIZE = 2048


def import_attention_v1():
    """``vllm_ascend.attention.attention_v1`` on the emulation (``torch.npu`` registered)."""
    os.environ.setdefault("VLLM_PLUGINS", "")    # never load vllm-ascend's platform plugin
    from npu_shim import emulation

    emulation.register_device_module()
    import vllm_ascend.ops  # noqa: F401  (upstream's import order; see the module docstring)
    import vllm_ascend.attention.attention_v1 as attention_v1

    return attention_v1


def compressed_causal_mask():
    """The 2048 x 2048 mask FIA's sparse_mode 2-4 take: True strictly above the diagonal."""
    return torch.ones(MASK_SIZE, MASK_SIZE, dtype=torch.bool).triu_(1)


def _attention_type_decoder():
    try:                                    # vLLM up to 0.2x
        from vllm.attention.backends.abstract import AttentionType
    except ImportError:                     # later vLLM
        from vllm.v1.attention.backend import AttentionType
    return AttentionType.DECODER


class _Layer:
    def __init__(self, name):
        self.layer_name = name
        self._k_scale_float = 1.0
        self._v_scale_float = 1.0


class DecoderCase:
    """One attention layer's shapes, its emulated KV cache and the step metadata."""

    def __init__(self, *, num_heads, num_kv_heads, head_size, head_size_v=None, block_size=128,
                 num_blocks=4, dtype=torch.bfloat16, layer_name="model.layers.0.self_attn.attn"):
        self.num_heads, self.num_kv_heads = num_heads, num_kv_heads
        self.head_size = head_size
        self.head_size_v = head_size if head_size_v is None else head_size_v
        self.block_size, self.num_blocks, self.dtype = block_size, num_blocks, dtype
        self.layer = _Layer(layer_name)
        self.key_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_size, dtype=dtype)
        self.value_cache = torch.zeros(num_blocks, block_size, num_kv_heads, self.head_size_v,
                                       dtype=dtype)
        self.block_tables = None
        self.seq_lens = []
        self.attention_v1 = import_attention_v1()
        self.vllm_config = None

    # ------------------------------------------------------------------ set-up
    @contextlib.contextmanager
    def config(self):
        """vLLM's default ``VllmConfig`` (device "cpu") made current (the impl reads it in ``__init__``) and
        vLLM's forward context set around the steps (0.14.0rc1 reads it in forward)."""
        from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

        self.vllm_config = VllmConfig(device_config=DeviceConfig(device="cpu"))
        with set_current_vllm_config(self.vllm_config):
            yield self

    def impl(self, *, sliding_window=None, sinks=None, scale=None):
        """vllm-ascend's ``AscendAttentionBackendImpl`` for a decoder layer."""
        kwargs = {}
        if sinks is not None:
            kwargs["sinks"] = sinks
        return self.attention_v1.AscendAttentionBackendImpl(
            num_heads=self.num_heads, head_size=self.head_size,
            scale=self.head_size ** -0.5 if scale is None else scale,
            num_kv_heads=self.num_kv_heads, alibi_slopes=None, sliding_window=sliding_window,
            kv_cache_dtype="auto", logits_soft_cap=None, attn_type=_attention_type_decoder(),
            kv_sharing_target_layer_name=None, **kwargs)

    def assign_blocks(self, seq_lens_max):
        """A block table (int32) giving sequence i the blocks it needs, in a shuffled order."""
        need = [-(-n // self.block_size) for n in seq_lens_max]
        if sum(need) > self.num_blocks:
            raise ValueError("the case has %d blocks; the sequences need %d" % (self.num_blocks, sum(need)))
        order = torch.randperm(self.num_blocks, generator=torch.Generator().manual_seed(7))
        table = torch.zeros(len(need), max(need), dtype=torch.int32)
        used = 0
        for i, k in enumerate(need):
            table[i, :k] = order[used:used + k].to(torch.int32)
            used += k
        self.block_tables = table

    def slots(self, seq, positions):
        bt = self.block_tables[seq]
        return [int(bt[p // self.block_size]) * self.block_size + p % self.block_size for p in positions]

    # ------------------------------------------------------------------ steps
    def _metadata(self, state, q_lens, seq_lens, slot_mapping):
        AscendMetadata = self.attention_v1.AscendMetadata
        cum, total = [], 0
        for n in q_lens:
            total += n
            cum.append(total)
        fields = dict(
            attn_mask=compressed_causal_mask(), attn_state=state,
            num_actual_tokens=total, seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
            seq_lens_list=list(seq_lens), actual_seq_lengths_q=cum,
            query_start_loc=torch.tensor([0] + cum, dtype=torch.int32), max_query_len=max(q_lens),
            block_tables=self.block_tables, slot_mapping=torch.tensor(slot_mapping, dtype=torch.int32),
            causal=True, model_runner_type="generate")
        known = AscendMetadata.__dataclass_fields__
        for name, value in (("num_prefills", sum(1 for n in q_lens if n > 1)),
                            ("num_decodes", sum(1 for n in q_lens if n == 1)),
                            ("num_decode_tokens", sum(1 for n in q_lens if n == 1))):
            if name in known:
                fields[name] = value
        return AscendMetadata(**{k: v for k, v in fields.items() if k in known})

    def _run(self, impl, q, k, v, metadata):
        from vllm.forward_context import set_forward_context

        out = torch.empty(q.shape[0], self.num_heads, self.head_size_v, dtype=q.dtype)
        with set_forward_context(None, self.vllm_config):
            result = impl.forward(self.layer, q, k, v, (self.key_cache, self.value_cache), metadata,
                                  output=out)
        return result

    def prefill(self, impl, q, k, v, q_lens):
        """One prefill step of new sequences (PrefillNoCache): tokens packed (T, N, D)."""
        self.seq_lens = list(q_lens)
        if self.block_tables is None:
            self.assign_blocks([n + 4 for n in q_lens])
        slots = [s for i, n in enumerate(q_lens) for s in self.slots(i, range(n))]
        state = self.attention_v1.AscendAttentionState.PrefillNoCache
        return self._run(impl, q, k, v, self._metadata(state, q_lens, q_lens, slots))

    def decode(self, impl, q, k, v):
        """One decode step (DecodeOnly): one new token per sequence, attending the paged cache."""
        positions = list(self.seq_lens)
        self.seq_lens = [n + 1 for n in self.seq_lens]
        slots = [self.slots(i, [p])[0] for i, p in enumerate(positions)]
        state = self.attention_v1.AscendAttentionState.DecodeOnly
        return self._run(impl, q, k, v, self._metadata(state, [1] * len(positions), self.seq_lens,
                                                       slots))
