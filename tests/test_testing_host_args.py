"""Arguments torch_npu reads on the host are host data: a device tensor (or a CPU
stand-in marked as one) handed there is a device->host read at the op call, counted
once per call and argument, or an error naming the op and the argument in strict
mode; host lists and CPU tensors not marked as device cost nothing.

Why: the emulation runs on CPU and cannot tell a stand-in from host data, and the
counter keeps the op's body opaque, so without this a patch that moved its
``.tolist()`` into the op call would count 0 reads (the gap this closes).
"""
import pytest
import torch

from npu_shim import emulation
from npu_shim.emulation._registry import HOST_ARGS
from npu_shim.testing import HostArgumentError, count_host_syncs

emulation.install()
import torch_npu  # noqa: E402

N, D = 2, 16
DTYPE = torch.bfloat16        # a dtype every op takes on A2 (the emulated SoC here)


def _cu():
    return torch.tensor([0, 3, 7], dtype=torch.int32)


def unpad(op, lengths, arg):
    q = torch.randn(7, N, D, dtype=DTYPE)
    op(q, q, q, lengths, 0.25, N, N, torch.empty_like(q))


def fusion_attention(op, lengths, arg):
    q = torch.randn(7, N, D, dtype=DTYPE)
    host = {"actual_seq_qlen": [3, 7], "actual_seq_kvlen": [3, 7]}
    host[arg] = lengths
    op(q, q, q, N, "TND", scale=0.25, **host)


def fusion_attention_positional(op, lengths, arg):
    # actual_seq_qlen / actual_seq_kvlen are positions 14 / 15 of the documented signature
    q = torch.randn(7, N, D, dtype=DTYPE)
    host = {"actual_seq_qlen": [3, 7], "actual_seq_kvlen": [3, 7]}
    host[arg] = lengths
    op(q, q, q, N, "TND", None, None, None, 0.25, 1.0, 2147483647, 2147483647, 0, None,
       host["actual_seq_qlen"], host["actual_seq_kvlen"])


def fused_infer_attention(op, lengths, arg):
    q = torch.randn(7, N, 64, dtype=DTYPE)    # FIA TND takes head dims 64, 128, 192
    host = {"actual_seq_lengths": [3, 7], "actual_seq_lengths_kv": [3, 7]}
    host[arg] = lengths
    op(q, q, q, num_heads=N, scale=0.25, input_layout="TND", **host)


def prompt_flash_attention(op, lengths, arg):
    q = torch.randn(2, 4, N, D, dtype=DTYPE)
    host = {"actual_seq_lengths": [3, 4], "actual_seq_lengths_kv": [3, 4]}
    host[arg] = lengths
    op(q, q, q, num_heads=N, scale_value=0.25, input_layout="BSND", **host)


def incre_flash_attention(op, lengths, arg):
    q = torch.randn(2, 1, N, D, dtype=DTYPE)
    k = torch.randn(2, 4, N, D, dtype=DTYPE)
    op(q, k, k, num_heads=N, scale_value=0.25, input_layout="BSND", actual_seq_lengths=lengths)


# (op, argument, call, the device tensor's lengths taken from cu = [0, 3, 7])
CASES = [
    ("_npu_flash_attention_unpad", "seq_len", unpad, lambda cu: torch.diff(cu)),
    ("npu_fusion_attention", "actual_seq_qlen", fusion_attention, lambda cu: cu[1:]),
    ("npu_fusion_attention", "actual_seq_kvlen", fusion_attention, lambda cu: cu[1:]),
    ("npu_fusion_attention", "actual_seq_qlen", fusion_attention_positional, lambda cu: cu[1:]),
    ("npu_fusion_attention", "actual_seq_kvlen", fusion_attention_positional, lambda cu: cu[1:]),
    ("npu_fused_infer_attention_score", "actual_seq_lengths", fused_infer_attention,
     lambda cu: cu[1:]),
    ("npu_fused_infer_attention_score", "actual_seq_lengths_kv", fused_infer_attention,
     lambda cu: cu[1:]),
    ("npu_prompt_flash_attention", "actual_seq_lengths", prompt_flash_attention,
     lambda cu: torch.diff(cu)),
    ("npu_prompt_flash_attention", "actual_seq_lengths_kv", prompt_flash_attention,
     lambda cu: torch.diff(cu)),
    ("npu_incre_flash_attention", "actual_seq_lengths", incre_flash_attention,
     lambda cu: torch.diff(cu)),
]
IDS = ["%s-%s-%s" % (op, arg, call.__name__) for op, arg, call, _ in CASES]


@pytest.mark.parametrize("op_name, arg, call, lengths", CASES, ids=IDS)
def test_a_device_tensor_for_a_host_argument_is_one_read_per_call(op_name, arg, call, lengths):
    cu = _cu()
    op = getattr(torch_npu, op_name)
    with count_host_syncs(device_tensors=[cu]) as syncs:
        call(op, lengths(cu), arg)
        call(op, lengths(cu), arg)
    assert [(e.kind, e.detail) for e in syncs.events] == [("host_arg", "%s of %s" % (arg, op_name))] * 2
    assert all("test_testing_host_args.py" in e.location for e in syncs.events), syncs.events
    assert "%s of %s" % (arg, op_name) in str(syncs.events[0])


@pytest.mark.parametrize("op_name, arg, call, lengths", CASES, ids=IDS)
def test_host_lists_and_unmarked_cpu_tensors_are_free(op_name, arg, call, lengths):
    cu = _cu()
    op = getattr(torch_npu, op_name)
    with count_host_syncs(device_tensors=[torch.randn(3)]) as syncs:
        call(op, lengths(cu), arg)                # a CPU tensor nobody marked: host data
        call(op, lengths(cu).tolist(), arg)       # a host list
    assert syncs.count == 0, [str(e) for e in syncs.events]


@pytest.mark.parametrize("op_name, arg, call, lengths", CASES, ids=IDS)
def test_strict_mode_names_the_op_and_the_argument(op_name, arg, call, lengths):
    cu = _cu()
    op = getattr(torch_npu, op_name)
    host = lengths(cu).tolist()
    with count_host_syncs(device_tensors=[cu], strict=True) as syncs:
        call(op, host, arg)                       # host data: no error
        with pytest.raises(HostArgumentError, match=r"^%s: %s is a device tensor" % (op_name, arg)):
            call(op, lengths(cu), arg)
    assert syncs.count == 0


def test_the_torch_ops_spelling_counts_too():
    cu = _cu()
    q = torch.randn(7, N, D, dtype=DTYPE)
    out = torch.zeros_like(q)
    with count_host_syncs(device_tensors=[cu]) as syncs:
        torch.ops.npu._npu_flash_attention_unpad(q, q, q, torch.diff(cu), 0.25, N, N, out)
        torch.ops.npu._npu_flash_attention_unpad.default(q, q, q, torch.diff(cu), 0.25, N, N, out)
    assert [e.detail for e in syncs.events] == ["seq_len of _npu_flash_attention_unpad"] * 2
    with count_host_syncs(device_tensors=[cu], strict=True):
        with pytest.raises(HostArgumentError, match="_npu_flash_attention_unpad: seq_len"):
            torch.ops.npu._npu_flash_attention_unpad(q, q, q, torch.diff(cu), 0.25, N, N,
                                                     torch.zeros_like(q))


def test_strict_mode_raises_before_the_op_runs():
    cu = _cu()
    q = torch.randn(7, N, D, dtype=DTYPE)
    out = torch.zeros_like(q)
    with count_host_syncs(device_tensors=[cu], strict=True):
        with pytest.raises(HostArgumentError):
            torch_npu._npu_flash_attention_unpad(q, q, q, torch.diff(cu), 0.25, N, N, out)
    assert not out.any()


def test_device_scalars_in_a_list_are_one_read_each():
    # the op's argument parser reads each element: torch.ops takes 0-d tensors in an int[]
    cu = _cu().long()
    q = torch.randn(7, N, D, dtype=DTYPE)
    with count_host_syncs(device_tensors=[cu]) as syncs:
        torch.ops.npu.npu_fusion_attention(q, q, q, N, "TND", scale=0.25,
                                           actual_seq_qlen=[cu[1], cu[2]], actual_seq_kvlen=[3, 7])
    assert syncs.kinds() == {"host_arg": 2}


def test_every_way_of_reading_a_device_tensor_counts_one_read():
    """With cu a device tensor, each of these is one read, as cu.tolist() is."""
    cu = _cu()
    q = torch.randn(7, N, D, dtype=DTYPE)
    counts = []
    for step in (
        lambda: torch_npu._npu_flash_attention_unpad(q, q, q, torch.diff(cu), 0.25, N, N,
                                                     torch.empty_like(q)),
        lambda: torch_npu.npu_fusion_attention(q, q, q, N, "TND", actual_seq_qlen=cu[1:],
                                               actual_seq_kvlen=[3, 7]),
        lambda: cu.tolist(),
    ):
        with count_host_syncs(device_tensors=[cu]) as syncs:
            step()
        counts.append(syncs.count)
    assert counts == [1, 1, 1]


def test_the_table_names_the_documented_host_arguments():
    assert {op: sorted(args) for op, args in HOST_ARGS.items()} == {
        "_npu_flash_attention_unpad": ["seq_len"],
        "_npu_flash_attention": ["seq_len"],
        "npu_fusion_attention": ["actual_seq_kvlen", "actual_seq_qlen"],
        "npu_fused_infer_attention_score": ["actual_seq_lengths", "actual_seq_lengths_kv"],
        "npu_prompt_flash_attention": ["actual_seq_lengths", "actual_seq_lengths_kv"],
        "npu_incre_flash_attention": ["actual_seq_lengths"],
        "_npu_paged_attention": ["context_lens"],
        "_npu_flash_attention_qlens": ["context_lens", "seq_len"],
        "npu_fused_infer_attention_score_v2": ["actual_seq_kvlen", "actual_seq_qlen"],
    }
    assert HOST_ARGS["_npu_flash_attention_unpad"] == {"seq_len": 3}
    assert HOST_ARGS["npu_fusion_attention"] == {"actual_seq_qlen": 14, "actual_seq_kvlen": 15}
