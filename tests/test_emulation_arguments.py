"""The emulated ops refuse what the real ops cannot take, by name,
and take the documented keywords at their neutral values."""
import numpy as np
import pytest
import torch

from npu_shim import emulation
from npu_shim.testing import reference

emulation.install()
import torch_npu  # noqa: E402  (the emulation)

# The emulation's (and the kernels') arithmetic against float64: float32 inputs, which the
# real ops reject, on purpose (see tests/conftest.py float32_math); the dtype rules are
# tests/test_emulation_dtypes.py's.
pytestmark = pytest.mark.float32_math


def _tnd(t=6, n=2, d=16):
    g = torch.Generator().manual_seed(0)
    return [torch.randn(t, n, d, generator=g) for _ in range(3)]


# ------------------------------------------------------------- 7. integer arguments


@pytest.mark.parametrize("bad", [3.5, 2.0, "2", True, torch.tensor(2.0)])
def test_non_integer_head_counts_are_refused_by_name(bad):
    q, k, v = _tnd()
    with pytest.raises(TypeError, match="head_num must be an integer"):
        torch_npu.npu_fusion_attention(q, k, v, bad, "TND", scale=0.25,
                                       actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6])
    with pytest.raises(TypeError, match="num_heads must be an integer"):
        torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=bad, input_layout="TND",
                                                  actual_seq_lengths=[2, 6],
                                                  actual_seq_lengths_kv=[2, 6])
    with pytest.raises(TypeError, match="num_kv_heads must be an integer"):
        torch_npu._npu_flash_attention_unpad(q, k, v, torch.tensor([2, 4], dtype=torch.int32), 0.25,
                                             2, bad, torch.empty_like(q))


def test_non_integer_lengths_are_refused_by_name():
    q, k, v = _tnd()
    with pytest.raises(TypeError, match="actual_seq_qlen must be an integer, got 3.5"):
        torch_npu.npu_fusion_attention(q, k, v, 2, "TND", actual_seq_qlen=[3.5, 6],
                                       actual_seq_kvlen=[3, 6])
    with pytest.raises(TypeError, match="actual_seq_lengths_kv must be an integer"):
        torch_npu.npu_fused_infer_attention_score(q, k, v, num_heads=2, input_layout="TND",
                                                  actual_seq_lengths=[3, 6],
                                                  actual_seq_lengths_kv=[3.5, 6])
    with pytest.raises(TypeError, match="seq_len must be an integer"):
        torch_npu._npu_flash_attention_unpad(q, k, v, torch.tensor([2.5, 3.5]), 0.25, 2, 2,
                                             torch.empty_like(q))


@pytest.mark.parametrize("heads, lengths", [
    (2, [2, 6]),
    (np.int64(2), np.array([2, 6], dtype=np.int32)),
    (torch.tensor(2), [torch.tensor(2), torch.tensor(6)]),   # vllm-ascend 0.18.0 passes 0-d tensors
])
def test_integer_kinds_stay_accepted_and_agree_with_the_reference(heads, lengths):
    q, k, v = _tnd()
    out = torch_npu.npu_fusion_attention(q, k, v, heads, "TND", scale=0.25,
                                         actual_seq_qlen=lengths, actual_seq_kvlen=lengths)[0]
    want = reference.attention_f64(q, k, v, [0, 2, 6], scale=0.25)
    torch.testing.assert_close(out.double(), want, atol=1e-5, rtol=1e-5)


# ------------------------------------------------------- 8. paged FIA lengths, blocks


def _paged(num_blocks=4, block_size=4, n=2, d=16):
    g = torch.Generator().manual_seed(1)
    q = torch.randn(3, n, d, generator=g)
    k_cache = torch.randn(num_blocks, block_size, n * d, generator=g)
    v_cache = torch.randn(num_blocks, block_size, n * d, generator=g)
    return q, k_cache, v_cache


def _call_paged(q, k_cache, v_cache, block_table, kv_lens):
    return torch_npu.npu_fused_infer_attention_score(
        q, k_cache, v_cache, num_heads=2, input_layout="TND", block_table=block_table,
        block_size=FIA_BLOCK, actual_seq_lengths=[1, 3], actual_seq_lengths_kv=kv_lens, scale=0.25)


# FIA: pages of 16 rows (FIA's NO_QUANT block_size alignment), head dim 64 (a TND head dim)
FIA_BLOCK, FIA_D = 16, 64


def test_negative_kv_length_names_actual_seq_lengths_kv():
    q, kc, vc = _paged(block_size=FIA_BLOCK, d=FIA_D)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"actual_seq_lengths_kv\[1\] = -2 is negative"):
        _call_paged(q, kc, vc, table, [5, -2])


def test_block_id_past_the_cache_names_block_table():
    q, kc, vc = _paged(block_size=FIA_BLOCK, d=FIA_D)
    table = torch.tensor([[0, 1], [2, 9]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table\[1, 1\] = 9 is not a block of the cache \(num_blocks = 4\)"):
        _call_paged(q, kc, vc, table, [5, 20])
    table = torch.tensor([[0, -1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_table\[0, 1\] = -1"):
        _call_paged(q, kc, vc, table, [20, 20])


def test_unused_padding_in_the_block_table_is_fine():
    q, kc, vc = _paged(block_size=FIA_BLOCK, d=FIA_D)
    table = torch.tensor([[0, 99], [2, 3]], dtype=torch.int32)   # row 0 reads one block only
    out, _ = _call_paged(q, kc, vc, table, [4, 20])
    assert out.shape == (3, 2, FIA_D) and torch.isfinite(out).all()


def test_fia_block_size_must_be_a_multiple_of_16():
    # sglang issue #25169 quotes the op: "In NO_QUANT situation, block_size should aligned to 16, but got 1"
    q, kc, vc = _paged(num_blocks=8, block_size=8, d=FIA_D)
    table = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"block_size should aligned to 16, but got 8"):
        torch_npu.npu_fused_infer_attention_score(
            q, kc, vc, num_heads=2, input_layout="TND", block_table=table, block_size=8,
            actual_seq_lengths=[1, 3], actual_seq_lengths_kv=[5, 9], scale=0.25)


def test_paged_decode_names_its_own_lengths_argument():
    q, kc, vc = _paged()
    with pytest.raises(ValueError, match=r"actual_seq_lengths\[0\] = -1 is negative"):
        torch_npu.npu_incre_flash_attention(
            q[:2].reshape(2, 1, 32), kc, vc, num_heads=2, input_layout="BSH",
            block_table=torch.tensor([[0, 1], [2, 3]], dtype=torch.int32), block_size=4,
            actual_seq_lengths=[-1, 3])


# ---------------------------------------------- 9. documented keywords, neutral values


def test_documented_neutral_keywords_are_accepted_and_change_nothing():
    q, k, v = _tnd()
    kwargs = dict(scale=0.25, actual_seq_qlen=[2, 6], actual_seq_kvlen=[2, 6])
    plain = torch_npu.npu_fusion_attention(q, k, v, 2, "TND", **kwargs)[0]
    spelled = torch_npu.npu_fusion_attention(q, k, v, 2, "TND", keep_prob=1.0, dropout_mask=None,
                                             seed=0, offset=0, sink=None, **kwargs)[0]
    assert torch.equal(plain, spelled)
    via_ops = torch.ops.npu.npu_fusion_attention(q, k, v, 2, "TND", dropout_mask=None, seed=0,
                                                 offset=0, sink=None, **kwargs)[0]
    assert torch.equal(plain, via_ops)


@pytest.mark.parametrize("name, value", [
    ("seed", 7), ("offset", 3), ("dropout_mask", torch.ones(4, dtype=torch.uint8)),
    ("sink", torch.zeros(2)),
])
def test_non_neutral_dropout_or_sink_is_refused_by_name(name, value):
    q, k, v = _tnd()
    with pytest.raises(NotImplementedError, match="argument %r" % name):
        torch_npu.npu_fusion_attention(q, k, v, 2, "TND", actual_seq_qlen=[2, 6],
                                       actual_seq_kvlen=[2, 6], **{name: value})
