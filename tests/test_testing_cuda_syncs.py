"""npu_shim.testing.cuda_syncs: the check of the CPU host-sync counter against CUDA's own
sync reports (benchmarks/bench_cuda_syncs.py). On CPU: the emulation's body hook wraps each
op body once, in both spellings, also under the CPU counter, and is put back; sites are named
by the CPU counter's rule; asking for CUDA's count without CUDA says so. With CUDA: scalar
reads are counted where they are made, an emulated op body is silent, and a CUDA tensor handed
to an argument torch_npu reads on the host is one read at the op's caller."""
import contextlib
import sys

import pytest
import torch

from npu_shim import emulation
from npu_shim.emulation import _registry
from npu_shim.testing import count_host_syncs
from npu_shim.testing.cuda_syncs import count_cuda_syncs, site_of

emulation.install()
import torch_npu  # noqa: E402

N, D = 2, 64   # 64: a head dim FIA TND takes (the emulation refuses 16, as CANN does)
DTYPE = torch.bfloat16


def _fia(op, q, lengths=(3, 7)):
    return op(q, q, q, num_heads=N, scale=0.25, input_layout="TND", actual_seq_lengths=list(lengths),
              actual_seq_lengths_kv=list(lengths))


@contextlib.contextmanager
def _recording_hook(seen):
    @contextlib.contextmanager
    def hook(name, args, kwargs):
        seen.append(name)
        yield

    previous = _registry.set_body_hook(hook)
    try:
        yield
    finally:
        assert _registry.set_body_hook(previous) is hook


@pytest.mark.parametrize("spelling", ["torch_npu", "torch.ops.npu"])
def test_body_hook_wraps_each_op_body_once_and_is_put_back(spelling):
    op = torch_npu.npu_fused_infer_attention_score if spelling == "torch_npu" \
        else torch.ops.npu.npu_fused_infer_attention_score
    q = torch.randn(7, N, D, dtype=DTYPE)
    seen = []
    with _recording_hook(seen):
        _fia(op, q)
        with count_host_syncs(device_tensors=[q]):        # a TorchFunctionMode on top: still once
            _fia(op, q)
    assert seen == ["npu_fused_infer_attention_score"] * 2
    assert _registry._body_hook is None
    _fia(op, q)
    assert len(seen) == 2


def test_sites_are_named_like_the_cpu_counters_events():
    cu = torch.tensor([0, 3, 7])
    with count_host_syncs(device_tensors=[cu]) as syncs:
        line = sys._getframe().f_lineno + 1
        cu.tolist()
    here = "tests/test_testing_cuda_syncs.py:%d in test_sites_are_named_like_the_cpu_counters_events" % line
    assert syncs.events[0].location == here
    assert site_of(sys._getframe()) == here.replace(":%d " % line, ":%d " % (sys._getframe().f_lineno,))


def test_asking_for_cudas_count_without_cuda_says_so():
    if torch.cuda.is_available():
        with count_cuda_syncs() as counter:
            pass
        assert counter.count == 0
    else:
        with pytest.raises(RuntimeError, match="needs CUDA"):
            with count_cuda_syncs():
                pass
        assert _registry._body_hook is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_cuda_reads_are_counted_at_their_site_and_op_bodies_are_silent():
    cu = torch.tensor([0, 3, 7], device="cuda")
    q = torch.randn(7, N, D, dtype=DTYPE, device="cuda")
    with count_cuda_syncs() as counter:
        first = sys._getframe().f_lineno + 1
        cu[1].item()
        cu.tolist()
        _fia(torch_npu.npu_fused_infer_attention_score, q)           # host lists: nothing
        op_line = sys._getframe().f_lineno + 1
        torch_npu.npu_fused_infer_attention_score(q, q, q, num_heads=N, scale=0.25, input_layout="TND",
                                                  actual_seq_lengths=cu[1:], actual_seq_lengths_kv=[3, 7])
    sites = [e.location.split(" in ")[0] for e in counter.events]
    assert sites == ["tests/test_testing_cuda_syncs.py:%d" % line for line in (first, first + 1, op_line)]
    assert counter.events[2].host_arg == "actual_seq_lengths of npu_fused_infer_attention_score"
    assert counter.op_events == []
    with count_cuda_syncs(silence_ops=False) as counter:      # the emulation's own syncs, kept apart
        torch_npu._npu_reshape_and_cache(q, q, torch.zeros(4, 4, N, D, dtype=DTYPE, device="cuda"),
                                         torch.zeros(4, 4, N, D, dtype=DTYPE, device="cuda"),
                                         torch.arange(7, dtype=torch.int32, device="cuda"))
    assert counter.events == []
    assert counter.op_events and all(e.op == "_npu_reshape_and_cache" for e in counter.op_events)
