"""sglang 0.5.12's own do_cp_attn_fia is right for one sequence (lane sglang-0.5.12).

Why the patch stays off on 0.5.11-0.5.12: their CP metadata carries scalar
lengths for a single sequence and their ``can_cp_split`` admits only batch size
1 (``seq_lens_cpu.shape[0] == 1``), and for one sequence ``torch.chunk(q, 2)``
splits exactly at the zigzag boundary (the prev block is never shorter than the
next one, and at most one token longer). This test runs 0.5.12's real method
for both ranks of cp_size 2, with and without a cached prefix, against the
float64 reference.

The metadata is 0.5.12's real ``ContextParallelMetadata`` filled from the zigzag
definition: 0.5.12's ``prepare_context_parallel_metadata`` allocates its tensors
on ``device="cuda"`` unconditionally and cannot run on this CPU-only machine;
the method reads only the scalar fields set here, and sglang's own
``cp_split_and_rebuild_data`` reads ``split_list`` / ``zigzag_index``.
"""
import pytest
from npu_shim.testing import cp_case
from sglang_support import shim  # (tests/lanes/conftest.py)

# the newest release with the single-sequence method (the subject)
pytestmark = [pytest.mark.claimed("sglang.cp_fia", window=True, pinned={"sglang": ("0.5.12",)}),
              pytest.mark.patch("sglang.cp_fia")]

TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"


@pytest.fixture(scope="module")
def module():
    return shim.install(TARGET)[0]


def single_sequence_metadata(spec, rank):
    from sglang.srt.layers.utils.cp_utils import ContextParallelMetadata

    (length,), (prefix,) = spec.extend_lens, spec.prefixes
    segments = 2 * spec.cp_size
    sizes = [length // segments + (1 if i < length % segments else 0) for i in range(segments)]
    prev, nxt = rank, segments - 1 - rank
    return ContextParallelMetadata(
        split_list=sizes, zigzag_index=[prev, nxt],
        kv_len_prev=prefix + sum(sizes[:prev + 1]), kv_len_next=prefix + sum(sizes[:nxt + 1]),
        actual_seq_q_prev=sizes[prev], actual_seq_q_next=sizes[nxt])


@pytest.mark.parametrize("spec", [
    cp_case.Spec(extend_lens=(45,), page_size=16, seed=1),
    cp_case.Spec(extend_lens=(130,), prefix_lens=(37,), page_size=128, num_heads=8, num_kv_heads=2,
                 qk_head_dim=192, v_head_dim=128, seed=2),
], ids=lambda s: s.label())
def test_upstream_single_sequence_method_is_correct_for_one_sequence(module, spec):
    from sglang.srt.layers.utils.cp_utils import cp_split_and_rebuild_data

    method = module.AscendAttnBackend.__dict__["do_cp_attn_fia"]
    assert not hasattr(method, "__npu_shim_patch__")
    batch = cp_case.make_batch(spec)
    reference = batch.reference()
    for rank in range(spec.cp_size):
        forward_batch = cp_case.make_forward_batch(batch, single_sequence_metadata(spec, rank))
        local_q = cp_split_and_rebuild_data(forward_batch, batch.packed_q())
        backend = cp_case.make_backend(module, batch, forward_batch)
        out = method(backend, local_q, batch.k_cache, batch.v_cache, cp_case.make_layer(spec), forward_batch)
        err = cp_case.max_abs_err(out, cp_case.rank_expected(batch, reference, rank))
        assert err <= cp_case.tolerance(spec.dtype), (rank, err)
