"""One context-parallel prefill of sglang's Ascend FIA path, built from real sglang parts.

The one builder of the sglang CP test case: used by the selftests
(``npu_shim.selftest.sglang_cp_*``, through :func:`ascend_layer_case`), by
tests/lanes/test_sglang_*.py and by the lane tests' helpers and rank workers in
tests/lanes/sglang_support/. Shipped in the package (``npu-shim selftest`` needs
it); sglang is imported only inside the functions that use it. What is real and
what is not:

Real sglang (at the lane's pinned version):
* ``ContextParallelMetadata`` from ``prepare_context_parallel_metadata`` (CPU:
  it takes ``device=``), under a real ``ServerArgs(model_path="dummy",
  device="cpu")`` installed as the global server args (the metadata code reads
  the DSA CP switches from it);
* the rank's token layout from ``cp_split_and_rebuild_data`` (checked against
  :func:`zigzag_layout`, written here from the definition);
* ``RadixAttention`` (the layer: head counts, head dims, scaling);
* ``ForwardBatch`` / ``ForwardMode.EXTEND`` (the batch);
* ``ReqToTokenPool`` and ``AscendAttnBackend.init_forward_metadata`` compute the
  block table (``req_to_token[req_pool_indices, :max_len][:, ::page_size] //
  page_size``) from a shuffled page assignment;
* ``ForwardMetadata`` and ``AscendAttnMaskBuilder.generate_mask_flag(2048)``
  (the compressed FIA mask the backend holds).

Not real, and why:
* the backend instance is made with ``object.__new__(AscendAttnBackend)``:
  ``AscendAttnBackend.__init__`` needs a ``ModelRunner`` and allocates a tensor
  on ``device="npu"``, which does not exist here. :func:`make_backend` sets
  exactly the attributes that ``do_cp_attn_fia`` reads (``page_size``,
  ``forward_metadata.block_tables``, ``fia_mask``) plus those
  ``init_forward_metadata`` reads for a plain (non-MLA, non-SWA, non-speculative)
  extend batch (``req_to_token_pool``, ``device``, ``speculative_step_id``,
  ``speculative_num_draft_tokens``, ``is_hybrid_swa``, ``use_mla``,
  ``use_sliding_window_kv_pool``);
* the KV cache is a plain tensor ``[(pages + 1) * page_size, Nkv, D]`` (the
  element layout of sglang's NPU pool, ``NPUMHATokenToKVPool``), written
  directly at the slots the block table names: the NPU pool's ``set_kv_buffer``
  calls ``npu_scatter_nd_update_`` and has a single head dim (no diff-KV), and
  writing the cache is not what is under test. In a real CP step the cache holds
  the all-gathered full sequences (``_cp_allgather_and_save_kv_npu``); here it is
  written with the full sequences directly. Slots no sequence owns hold large
  garbage so that a read past a sequence's KV length shows in the result.
* torch_npu is npu-shim's emulation (``NPU_SHIM_EMULATE=1``).

The selftests (:func:`ascend_layer_case`) run on an NPU as well as on the
emulation: there the backend is given the block table directly
(:meth:`Batch.block_table`, the pages the batch's slots lie in: what
``init_forward_metadata`` computes from the ``ReqToTokenPool``), and the caches,
the block table and the mask are moved to the device.

Expected values come only from ``npu_shim.testing.attention_f64`` (float64, from
the definition of causal attention over each sequence's cached prefix and new
tokens), mapped to a rank's tokens by :func:`zigzag_layout`.
"""
import dataclasses
import json
import math
import random
import time
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import List

import torch

GARBAGE = 1.0e3  # magnitude of the values in KV slots that belong to no sequence


@dataclass(frozen=True)
class Spec:
    """One batch: new-token counts, cached prefix lengths, heads and page size."""

    extend_lens: tuple
    page_size: int = 16
    num_heads: int = 4
    num_kv_heads: int = 4
    # FIA's TND takes head dims 64/128/192 (or 192 / 128) from CANN 8.3; the smallest by default
    qk_head_dim: int = 64
    v_head_dim: int = 64
    prefix_lens: tuple = ()
    cp_size: int = 2
    dtype: torch.dtype = torch.bfloat16     # A2's (FIA is not documented for 310P); no float32 there
    seed: int = 0

    @property
    def bs(self):
        return len(self.extend_lens)

    @property
    def prefixes(self):
        return tuple(self.prefix_lens) or (0,) * self.bs

    @property
    def seq_lens(self):
        return tuple(p + n for p, n in zip(self.prefixes, self.extend_lens))

    def to_json(self):
        fields = dict(self.__dict__)
        fields["dtype"] = str(self.dtype).replace("torch.", "")
        return json.dumps(fields)

    @classmethod
    def from_json(cls, text):
        fields = json.loads(text)
        fields["dtype"] = getattr(torch, fields["dtype"])
        for name in ("extend_lens", "prefix_lens"):
            fields[name] = tuple(fields[name])
        return cls(**fields)

    def label(self):
        kind = "MHA" if self.num_heads == self.num_kv_heads else "GQA%d:%d" % (self.num_heads, self.num_kv_heads)
        dims = "d%d" % self.qk_head_dim if self.qk_head_dim == self.v_head_dim else "dqk%d-dv%d" % (
            self.qk_head_dim, self.v_head_dim)
        pre = "-prefix" if any(self.prefixes) else ""
        return "bs%d-page%d-%s-%s%s-%s" % (self.bs, self.page_size, kind, dims, pre,
                                           str(self.dtype).replace("torch.", ""))


def zigzag_block_sizes(length, cp_size):
    """The ``2 * cp_size`` zigzag blocks of a sequence of ``length`` new tokens: the first
    ``length % (2 * cp_size)`` one token longer."""
    segments = 2 * cp_size
    return [length // segments + (1 if i < length % segments else 0) for i in range(segments)]


def zigzag_layout(extend_lens, cp_size, rank):
    """(sequence, index among its new tokens) of each local token of ``rank``.

    From the definition: every sequence's new tokens are cut into 2 * cp_size
    blocks (:func:`zigzag_block_sizes`); rank r owns block r and block
    2 * cp_size - 1 - r of every sequence, laid out as all sequences' block r,
    then all sequences' block 2 * cp_size - 1 - r.
    """
    layout = []
    for block in (rank, 2 * cp_size - 1 - rank):
        for s, n in enumerate(extend_lens):
            sizes = zigzag_block_sizes(n, cp_size)
            start = sum(sizes[:block])
            layout.extend((s, start + i) for i in range(sizes[block]))
    return layout


@dataclass
class Batch:
    """Full-sequence tensors of a batch and what the backend needs to run on it."""

    spec: Spec
    q: List[torch.Tensor]          # per sequence: (L_s, N, Dqk) new-token queries
    k: List[torch.Tensor]          # per sequence: (P_s + L_s, Nkv, Dqk)
    v: List[torch.Tensor]          # per sequence: (P_s + L_s, Nkv, Dv)
    k_cache: torch.Tensor
    v_cache: torch.Tensor
    req_to_token_pool: object
    req_pool_indices: torch.Tensor
    slots: List[torch.Tensor] = field(default_factory=list)

    def packed_q(self):
        """All new-token queries in sequence order, (sum L, N * Dqk) as sglang sees them."""
        return torch.cat(self.q, dim=0).reshape(sum(self.spec.extend_lens), -1)

    def packed_new_kv(self):
        """The new tokens' K and V in sequence order: (sum L, Nkv, Dqk), (sum L, Nkv, Dv)."""
        prefixes = self.spec.prefixes
        return (torch.cat([k[p:] for k, p in zip(self.k, prefixes)]),
                torch.cat([v[p:] for v, p in zip(self.v, prefixes)]))

    def new_token_slots(self):
        return torch.cat([s[p:] for s, p in zip(self.slots, self.spec.prefixes)])

    def block_table(self):
        """(bs, max pages) int32: the page of each sequence's every ``page_size``-th slot,
        0 past its last page (what ``init_forward_metadata`` reads off the pool)."""
        ps = self.spec.page_size
        pages = [(slots[::ps] // ps).to(torch.int32) for slots in self.slots]
        table = torch.zeros(len(pages), max(p.shape[0] for p in pages), dtype=torch.int32)
        for s, row in enumerate(pages):
            table[s, :row.shape[0]] = row
        return table

    def reference(self):
        """float64 causal attention for every new token, per sequence: list of (L_s, N, Dv)."""
        from npu_shim.testing import attention_f64

        scale = self.spec.qk_head_dim ** -0.5
        return [
            attention_f64(q, k, v, [0, q.shape[0]], [0, k.shape[0]], scale=scale, causal=True)
            for q, k, v in zip(self.q, self.k, self.v)
        ]


def simulated_rank(**topology):
    """``get_parallel().override(**topology)`` for one rank of a topology simulated in this
    process, with the process groups the override's widths would be checked against stated as
    absent (``None``) where the release lets an override name them: a process group built here
    earlier (the one-rank group of the tower tests and selftests) is not this topology's, and
    sglang refuses an override whose widths contradict a built group's."""
    from sglang.srt.runtime_context import get_parallel

    try:
        from sglang.srt.runtime_context import _parallel_fields
        fields = _parallel_fields()
    except ImportError:      # a release whose overrides do not check groups
        fields = ()
    groups = {name: None for name in ("tp_group", "attn_tp_group", "attn_cp_group", "moe_ep_group")
              if name in fields and name not in topology}
    return get_parallel().override(**topology, **groups)


def set_cpu_server_args():
    """Install a real ServerArgs for a CPU process as sglang's global server args."""
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    args = ServerArgs(model_path="dummy", device="cpu")
    set_global_server_args_for_scheduler(args)
    return args


def make_batch(spec: Spec, write_new_tokens=True) -> Batch:
    """Random sequences, a shuffled page assignment and the paged KV cache holding them.

    ``write_new_tokens=False`` writes only the cached prefixes: the new tokens'
    K/V are then for the caller to gather and write (the two-process test)."""
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool

    gen = torch.Generator().manual_seed(spec.seed)
    rng = random.Random(spec.seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, dtype=torch.float32).to(spec.dtype)

    seq_lens = spec.seq_lens
    q = [randn(n, spec.num_heads, spec.qk_head_dim) for n in spec.extend_lens]
    k = [randn(n, spec.num_kv_heads, spec.qk_head_dim) for n in seq_lens]
    v = [randn(n, spec.num_kv_heads, spec.v_head_dim) for n in seq_lens]

    ps = spec.page_size
    pages_per_seq = [math.ceil(n / ps) for n in seq_lens]
    num_pages = sum(pages_per_seq) + 3                  # a few pages nobody owns
    free_pages = list(range(1, num_pages + 1))          # page 0 stays unused, as in sglang
    rng.shuffle(free_pages)

    max_context = max(pages_per_seq) * ps + ps
    pool = ReqToTokenPool(size=spec.bs + 2, max_context_len=max_context, device="cpu",
                          enable_memory_saver=False)
    rows = list(range(1, spec.bs + 3))
    rng.shuffle(rows)
    req_pool_indices = torch.tensor(rows[:spec.bs], dtype=torch.int64)

    slots_total = (num_pages + 1) * ps
    k_cache = (GARBAGE * torch.randn(slots_total, spec.num_kv_heads, spec.qk_head_dim,
                                     generator=gen)).to(spec.dtype)
    v_cache = (GARBAGE * torch.randn(slots_total, spec.num_kv_heads, spec.v_head_dim,
                                     generator=gen)).to(spec.dtype)
    slots = []
    for s, n in enumerate(seq_lens):
        pages = [free_pages.pop() for _ in range(pages_per_seq[s])]
        positions = torch.arange(n)
        seq_slots = torch.tensor(pages, dtype=torch.int64)[positions // ps] * ps + positions % ps
        pool.req_to_token[req_pool_indices[s], :n] = seq_slots.to(torch.int32)
        stored = n if write_new_tokens else spec.prefixes[s]
        k_cache[seq_slots[:stored]] = k[s][:stored]
        v_cache[seq_slots[:stored]] = v[s][:stored]
        slots.append(seq_slots)
    return Batch(spec, q, k, v, k_cache, v_cache, pool, req_pool_indices, slots)


def make_layer(spec: Spec):
    from sglang.srt.layers.radix_attention import RadixAttention

    return RadixAttention(num_heads=spec.num_heads, head_dim=spec.qk_head_dim,
                          scaling=spec.qk_head_dim ** -0.5, num_kv_heads=spec.num_kv_heads,
                          layer_id=0, v_head_dim=spec.v_head_dim)


def make_metadata(spec: Spec, rank: int):
    """sglang's own CP metadata for this rank (prepare_context_parallel_metadata on CPU)."""
    from sglang.srt.layers.utils.cp_utils import prepare_context_parallel_metadata

    return prepare_context_parallel_metadata(
        sum(spec.extend_lens), rank, spec.cp_size, list(spec.seq_lens),
        extend_seqs_len=list(spec.extend_lens), device="cpu")


def make_forward_batch(batch: Batch, metadata):
    """A real ForwardBatch for a plain extend step carrying this rank's CP metadata."""
    from sglang.srt.model_executor.forward_batch_info import ForwardBatch, ForwardMode

    spec = batch.spec
    total = sum(spec.extend_lens)
    new_slots = batch.new_token_slots()
    extra = {}
    if "req_to_token_pool" in {f.name for f in dataclasses.fields(ForwardBatch)}:
        extra["req_to_token_pool"] = batch.req_to_token_pool   # where <= 0.5.12 reads it
    return ForwardBatch(
        forward_mode=ForwardMode.EXTEND,
        batch_size=spec.bs,
        input_ids=torch.zeros(total, dtype=torch.int64),
        req_pool_indices=batch.req_pool_indices,
        seq_lens=torch.tensor(spec.seq_lens, dtype=torch.int64),
        out_cache_loc=new_slots,
        seq_lens_sum=sum(spec.seq_lens),
        seq_lens_cpu=torch.tensor(spec.seq_lens, dtype=torch.int64),
        extend_num_tokens=total,
        extend_seq_lens=torch.tensor(spec.extend_lens, dtype=torch.int64),
        extend_prefix_lens=torch.tensor(spec.prefixes, dtype=torch.int64),
        extend_seq_lens_cpu=list(spec.extend_lens),
        extend_prefix_lens_cpu=list(spec.prefixes),
        attn_cp_metadata=metadata,
        **extra,
    )


def make_backend(module, batch: Batch, forward_batch, **attrs):
    """An AscendAttnBackend without __init__ (see the module docstring), with its
    forward metadata computed by the real ``init_forward_metadata``; ``attrs`` are set
    before that (e.g. the hybrid SWA pool's ``is_hybrid_swa`` and index mapping)."""
    backend = object.__new__(module.AscendAttnBackend)
    backend.page_size = batch.spec.page_size
    backend.device = "cpu"
    backend.req_to_token_pool = batch.req_to_token_pool
    backend.speculative_step_id = 0
    backend.speculative_num_draft_tokens = None
    backend.is_hybrid_swa = False
    backend.use_mla = False
    backend.use_sliding_window_kv_pool = False
    backend.fia_mask = module.AscendAttnMaskBuilder.generate_mask_flag(2048)
    for name, value in attrs.items():
        setattr(backend, name, value)
    module.AscendAttnBackend.init_forward_metadata(backend, forward_batch)
    return backend


def rank_inputs(module, batch: Batch, rank: int):
    """(backend, layer, forward_batch, local q) for one CP rank, as sglang prepares them."""
    from sglang.srt.layers.utils.cp_utils import cp_split_and_rebuild_data

    metadata = make_metadata(batch.spec, rank)
    forward_batch = make_forward_batch(batch, metadata)
    local_q = cp_split_and_rebuild_data(forward_batch, batch.packed_q())
    return make_backend(module, batch, forward_batch), make_layer(batch.spec), forward_batch, local_q


def rank_expected(batch: Batch, reference, rank: int):
    """The float64 reference rows of ``rank``'s tokens, (T_rank, N * Dv)."""
    layout = zigzag_layout(batch.spec.extend_lens, batch.spec.cp_size, rank)
    rows = [reference[s][i] for s, i in layout]
    return torch.stack(rows).reshape(len(rows), -1)


def run_rank(method, module, batch: Batch, rank: int):
    """Call ``method`` (an unbound do_cp_attn_fia) as the backend would for ``rank``."""
    backend, layer, forward_batch, local_q = rank_inputs(module, batch, rank)
    return method(backend, local_q, batch.k_cache, batch.v_cache, layer, forward_batch)


def max_abs_err(out, expected):
    from npu_shim.testing.errors import within

    err = (out.detach().to(torch.float64) - expected).abs().max().item()
    within("sglang CP/small-page FIA vs float64", err, tolerance(out.dtype), out.dtype)
    return err


def tolerance(dtype):
    """Max abs error allowed against the float64 reference (inputs are N(0, 1))."""
    return {torch.float32: 2e-5, torch.float16: 4e-3, torch.bfloat16: 3e-2}[dtype]


# -- the selftests' case: one layer on a device, the backend given its block table -------

def ascend_layer_case(module, spec: Spec, device="cpu"):
    """The batch of ``spec`` (:func:`make_batch`) for one attention layer on sglang's
    ``AscendAttnBackend`` of ``module`` on ``device``: ``batch``, the ``layer``, the
    ``backend``, ``k_cache`` / ``v_cache`` / ``block_table`` on the device and the float64
    causal ``reference`` of each sequence's new tokens.

    The backend is made with ``object.__new__`` and given what the CP FIA methods read
    (``page_size``, ``device``, ``forward_metadata.block_tables``, ``fia_mask``): its
    ``__init__`` needs a whole ``ModelRunner``.
    """
    batch = make_batch(spec)
    block_table = batch.block_table().to(device)
    backend = object.__new__(module.AscendAttnBackend)
    backend.page_size, backend.device = spec.page_size, device
    backend.forward_metadata = module.ForwardMetadata(block_tables=block_table)
    backend.fia_mask = module.AscendAttnMaskBuilder.generate_mask_flag(2048).to(device)
    return SimpleNamespace(
        spec=spec, device=device, batch=batch, layer=make_layer(spec), backend=backend,
        k_cache=batch.k_cache.to(device), v_cache=batch.v_cache.to(device), block_table=block_table,
        reference=batch.reference())


def run_cp_fia(module, case, local_q, forward_batch, more_device_tensors=()):
    """One ``AscendAttnBackend.do_cp_attn_fia`` call on ``case``: ``(out, host syncs, seconds)``.

    The syncs are counted with q, the caches, the block table, the mask and
    ``more_device_tensors`` treated as device tensors."""
    from npu_shim.testing import count_host_syncs

    device_tensors = [local_q, case.k_cache, case.v_cache, case.block_table, case.backend.fia_mask]
    started = time.perf_counter()
    with count_host_syncs(device_tensors=device_tensors + list(more_device_tensors)) as counter:
        out = module.AscendAttnBackend.do_cp_attn_fia(case.backend, local_q, case.k_cache, case.v_cache,
                                                      case.layer, forward_batch)
    if case.device != "cpu":
        torch.npu.synchronize()
    return out, counter.count, time.perf_counter() - started
