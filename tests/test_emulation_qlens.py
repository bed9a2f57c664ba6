"""The emulated ``torch_npu._npu_flash_attention_qlens`` (npu_shim/emulation/prefix_attention.py: sglang's
Ascend prefill without FIA) against the float64 reference: new tokens after a cached prefix, read through a
shuffled block table of 128-slot blocks, causal aligned to the end, GQA, both spellings; and its refusals."""
import pytest
import torch

from npu_shim import emulation
from npu_shim.emulation import dtypes
from npu_shim.testing import attention_f64, dense_segments
from npu_shim.testing.errors import Tolerance
from npu_shim.testing.paged_kv import paged_kv

emulation.install()
import torch_npu  # noqa: E402

BLOCK = 128
MASK = torch.ones(128, 128).triu(1)   # sglang's compressed mask for a float32/bfloat16 model (1 above the diagonal)
# max |out - float64| (|ref| <= ~3): float32 ~1e-6, bfloat16 ~1e-2
TOL = {torch.float32: Tolerance("qlens vs float64", 1e-5, "float32"),
       torch.bfloat16: Tolerance("qlens vs float64", 3e-2, "bfloat16")}


def paged(kv_lens, nkv, d, dtype, seed=0):
    """Per-sequence K/V and caches (num_blocks, 128, Nkv, D) through a shuffled int32 block table (the other
    blocks hold garbage): the decoder tests' builder at the op's one block size."""
    return paged_kv(kv_lens, nkv, d, d, BLOCK, dtype, seed)


def _call(op, q_lens, kv_lens, dtype, n=4, nkv=2, d=16, flat=True, seed=0):
    k, v, kc, vc, table = paged(kv_lens, nkv, d, dtype, seed)
    g = torch.Generator().manual_seed(seed + 1)
    q = torch.randn(sum(q_lens), n, d, generator=g).to(dtype)
    query = q.reshape(q.shape[0], n * d) if flat else q
    cache_k = kc.reshape(kc.shape[0], BLOCK, nkv * d) if flat else kc
    cache_v = vc.reshape(vc.shape[0], BLOCK, nkv * d) if flat else vc
    out = torch.full_like(query, float("nan"))
    op(query=query, key_cache=cache_k, value_cache=cache_v, block_table=table, mask=MASK.to(dtype),
       seq_len=torch.tensor(q_lens, dtype=torch.int32), context_lens=torch.tensor(kv_lens, dtype=torch.int32),
       num_kv_heads=nkv, num_heads=n, scale_value=0.25, out=out)
    want = attention_f64(q, torch.cat(k), torch.cat(v), dense_segments(q_lens), dense_segments(kv_lens),
                         scale=0.25, causal=True)
    return out.reshape(q.shape), want


# (new tokens, keys): no prefix, a prefix of one and two blocks, a block edge crossed, one new token
CASES = [([3, 9, 41], [3, 9, 41]), ([5, 130], [133, 258]), ([1, 200, 128], [129, 200, 256])]


@pytest.mark.parametrize("q_lens, kv_lens", CASES)
@pytest.mark.parametrize("op", [lambda **a: torch_npu._npu_flash_attention_qlens(**a),
                                lambda **a: torch.ops.npu._npu_flash_attention_qlens(**a)], ids=["torch_npu", "ops"])
def test_prefill_after_a_cached_prefix_is_the_float64_attention(op, q_lens, kv_lens):
    with dtypes.float32_not_on_hardware():
        got, want = _call(op, q_lens, kv_lens, torch.float32)
    assert (got.double() - want).abs().max().item() < TOL[torch.float32]


def test_bfloat16_and_the_split_head_layout():
    got, want = _call(torch_npu._npu_flash_attention_qlens, [5, 130], [133, 258], torch.bfloat16, flat=False)
    assert (got.double() - want).abs().max().item() < TOL[torch.bfloat16]


def _args(**change):
    k, v, kc, vc, table = paged([133], 2, 16, torch.bfloat16)
    args = dict(query=torch.randn(5, 64).bfloat16(), key_cache=kc, value_cache=vc, block_table=table,
                mask=MASK.bfloat16(), seq_len=torch.tensor([5], dtype=torch.int32),
                context_lens=torch.tensor([133], dtype=torch.int32), num_kv_heads=2, num_heads=4,
                scale_value=0.25, out=torch.empty(5, 64).bfloat16())
    args.update(change)
    return args


@pytest.mark.parametrize("change, error, message", [
    (dict(query=torch.randn(5, 64)), ValueError, "float32 is for math checks only"),
    (dict(key_cache=torch.zeros(4, 64, 2, 16).bfloat16(), value_cache=torch.zeros(4, 64, 2, 16).bfloat16()),
     ValueError, "blockSize=128"),
    (dict(seq_len=torch.tensor([5], dtype=torch.int32), context_lens=torch.tensor([70], dtype=torch.int32)),
     ValueError, "multiple of 128"),
    (dict(context_lens=torch.tensor([133], dtype=torch.int32).view(1, 1)), ValueError, "int32 host tensor"),
    (dict(mask=torch.ones(128, 128).tril().bfloat16()), ValueError, "strictly above the diagonal"),
    (dict(mask=torch.ones(2048, 2048).triu(1).bfloat16()), ValueError, r"\[128, 128\]"),
    (dict(out=torch.empty(5, 32).bfloat16()), ValueError, "out must be"),
    (dict(seq_len=torch.tensor([6], dtype=torch.int32)), ValueError, "prefix"),
    (dict(value_cache=torch.zeros(4, 128, 2, 8).bfloat16()), ValueError, "one shape"),
])
def test_refusals_name_the_rule(change, error, message):
    with pytest.raises(error, match=message):
        torch_npu._npu_flash_attention_qlens(**_args(**change))
