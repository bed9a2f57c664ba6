"""One CP prefill rank on sglang 0.5.23, where attention goes through the CP strategy object.

Builds on npu_shim/testing/cp_case.py (same Spec, batch, paged cache with shuffled pages,
RadixAttention, backend made without ``__init__``, float64 reference); what
0.5.23 changes, and what this module does for it, with sglang's own code:

* the CP strategy: ``init_cp_strategy(enable_prefill_cp=True, cp_size, "zigzag")``
  binds sglang's ``ZigzagCPStrategy``; its rank is read from
  ``get_parallel().attn_cp_rank``, set with sglang's own
  ``get_parallel().override(...)`` for the duration of a rank's work;
* the metadata: ``prepare_cp_forward(forward_batch)`` (``build_metadata`` +
  ``pad_logical_token_to_physical``: every rank's local length is padded to a
  multiple of 2 * cp_size, so some ranks carry zero pad rows);
* the rank's queries: ``strategy.shard_hidden_states`` (its zigzag layout, with
  the pad rows).

The two ranks run in turn in one process (``rank_inputs`` for each); what
each rank sees is what it would see in its own process, since the KV cache
already holds the gathered sequences (as after ``_cp_allgather_and_save_kv_npu``).
"""
import contextlib

import torch

from npu_shim.testing import cp_case

STRATEGY = "zigzag"


@contextlib.contextmanager
def zigzag_rank(rank, cp_size):
    """sglang's zigzag strategy bound for ``rank`` of ``cp_size``; unbound afterwards."""
    from sglang.srt.layers.cp import base
    from sglang.srt.runtime_context import get_parallel

    # One attention-CP group of cp_size ranks and nothing else: TP = CP, no DP, no EP
    # (sglang validates that the widths multiply up).
    topology = dict(tp_size=cp_size, tp_rank=rank, attn_tp_size=1, attn_tp_rank=0, attn_dp_size=1,
                    attn_dp_rank=0, attn_cp_size=cp_size, attn_cp_rank=rank, moe_tp_size=cp_size,
                    moe_ep_size=1, moe_dp_size=1)
    with get_parallel().override(enable_prefill_cp=True, cp_strategy=STRATEGY, **topology):
        base.init_cp_strategy(enable_prefill_cp=True, cp_size=cp_size, cp_strategy=STRATEGY)
        try:
            yield base.get_cp_strategy()
        finally:
            base.init_cp_strategy(enable_prefill_cp=False, cp_size=cp_size, cp_strategy=STRATEGY)


def rank_inputs(module, batch, strategy):
    """(backend, layer, forward_batch, local q with pad rows) for the bound rank."""
    from sglang.srt.layers.cp.utils import prepare_cp_forward

    forward_batch = cp_case.make_forward_batch(batch, None)
    prepare_cp_forward(forward_batch)
    local_q = strategy.shard_hidden_states(batch.packed_q(), forward_batch)
    backend = cp_case.make_backend(module, batch, forward_batch)
    backend.attn_cp_size = batch.spec.cp_size
    return backend, cp_case.make_layer(batch.spec), forward_batch, local_q


def logical_rows(forward_batch):
    meta = forward_batch.attn_cp_metadata
    return meta.total_q_prev_tokens + meta.total_q_next_tokens


def device_stand_ins(backend, forward_batch, local_q, batch):
    """The tensors that live on the NPU in production (for count_host_syncs)."""
    meta = forward_batch.attn_cp_metadata
    tensors = [local_q, batch.k_cache, batch.v_cache, backend.forward_metadata.block_tables,
               backend.fia_mask]
    tensors += [value for value in vars(meta).values() if isinstance(value, torch.Tensor)]
    return tensors
