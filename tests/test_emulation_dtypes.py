"""The emulated ops take the dtypes the vendor documents (npu_shim/emulation/dtypes.py), per
device class, and float32 for the attention ops only inside float32_not_on_hardware()."""
import pytest
import torch

from npu_shim import emulation
from npu_shim.emulation import dtypes

emulation.install()
import torch_npu  # noqa: E402  (the emulation)

F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32


def unpad(dtype):
    q = torch.randn(6, 2, 16).to(dtype)
    out = torch.empty_like(q)
    torch_npu._npu_flash_attention_unpad(q, q, q, torch.tensor([2, 4], dtype=torch.int32), 0.25, 2, 2, out)
    return out


def pfa(dtype):
    q = torch.randn(1, 4, 2, 16).to(dtype)
    return torch_npu.npu_prompt_flash_attention(q, q, q, num_heads=2, input_layout="BSND", scale_value=0.25)


def ifa(dtype):
    q, kv = torch.randn(1, 1, 32).to(dtype), torch.randn(1, 4, 32).to(dtype)
    return torch_npu.npu_incre_flash_attention(q, kv, kv, num_heads=2, scale_value=0.25)


def fa(dtype):
    q = torch.randn(6, 2, 16).to(dtype)
    return torch_npu.npu_fusion_attention(q, q, q, 2, "TND", scale=0.25, actual_seq_qlen=[2, 6],
                                          actual_seq_kvlen=[2, 6])[0]


def fia(dtype):
    q = torch.randn(6, 2, 64).to(dtype)     # FIA TND takes head dims 64, 128, 192
    return torch_npu.npu_fused_infer_attention_score(q, q, q, num_heads=2, input_layout="TND", scale=0.25,
                                                     actual_seq_lengths=[2, 6],
                                                     actual_seq_lengths_kv=[2, 6])[0]


OPS = {"_npu_flash_attention_unpad": unpad, "npu_prompt_flash_attention": pfa,
       "npu_incre_flash_attention": ifa, "npu_fusion_attention": fa, "npu_fused_infer_attention_score": fia}
A2_TAKES = {op: (F16, BF16) for op in OPS}
P310_TAKES = {"_npu_flash_attention_unpad": (F16,), "npu_prompt_flash_attention": (F16,),
              "npu_incre_flash_attention": (F16,), "npu_fusion_attention": (), "npu_fused_infer_attention_score": ()}


@pytest.fixture(params=["A2", "310P"])
def device_class(request, monkeypatch):
    if request.param == "310P":
        monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", "Ascend310P3")
    else:
        monkeypatch.delenv("NPU_SHIM_EMULATE_SOC", raising=False)
    return request.param


@pytest.mark.parametrize("op", sorted(OPS))
@pytest.mark.parametrize("dtype", [F16, BF16, F32])
def test_attention_ops_take_the_documented_dtypes(device_class, op, dtype):
    takes = (A2_TAKES if device_class == "A2" else P310_TAKES)[op]
    assert dtypes.supported(op) == takes
    if dtype in takes:
        assert OPS[op](dtype).dtype == dtype
        return
    name = str(dtype).replace("torch.", "")
    if not takes:
        with pytest.raises(ValueError, match=r"%s: not documented for Ascend310P3 \(310P\)" % op):
            OPS[op](dtype)
        return
    with pytest.raises(ValueError, match=r"%s: query has dtype %s, which the op does not take on .* "
                                         r"\(%s\); supported: %s" % (op, name, device_class,
                                                                     ", ".join(str(d)[6:] for d in takes))):
        OPS[op](dtype)


@pytest.mark.parametrize("op", ["_npu_flash_attention_unpad", "npu_prompt_flash_attention",
                                "npu_incre_flash_attention"])
def test_float32_only_inside_the_math_check_opt_in(device_class, op):
    with pytest.raises(ValueError, match="float32 is for math checks only"):
        OPS[op](F32)
    with dtypes.float32_not_on_hardware():
        with dtypes.float32_not_on_hardware():
            assert OPS[op](F32).dtype == F32
        assert OPS[op](F32).dtype == F32
    with pytest.raises(ValueError):
        OPS[op](F32)


def test_reshape_and_cache_dtypes_must_match_and_be_documented(device_class):
    key = torch.randn(2, 1, 16, dtype=F16)
    cache = torch.zeros(2, 4, 1, 16, dtype=F16)
    slots = torch.tensor([0, 5], dtype=torch.int32)
    torch_npu._npu_reshape_and_cache(key, key, cache, cache.clone(), slots)
    with pytest.raises(ValueError, match="must share one dtype"):
        torch_npu._npu_reshape_and_cache(key, key, cache.to(torch.int8), cache.to(torch.int8), slots)
    with pytest.raises(ValueError, match="key has dtype float32"):
        torch_npu._npu_reshape_and_cache(key.float(), key.float(), cache.float(), cache.float(), slots)


def test_scatter_takes_float32_as_documented_and_bfloat16_on_a2_only(device_class):
    idx = torch.tensor([[1]], dtype=torch.int64)
    torch_npu.npu_scatter_nd_update_(torch.zeros(3, 4), idx, torch.ones(1, 4))
    if device_class == "A2":
        torch_npu.npu_scatter_nd_update_(torch.zeros(3, 4, dtype=BF16), idx, torch.ones(1, 4, dtype=BF16))
    else:
        with pytest.raises(ValueError, match="input has dtype bfloat16"):
            torch_npu.npu_scatter_nd_update_(torch.zeros(3, 4, dtype=BF16), idx, torch.ones(1, 4, dtype=BF16))
    with pytest.raises(ValueError, match="they must match"):
        torch_npu.npu_scatter_nd_update_(torch.zeros(3, 4), idx, torch.ones(1, 4, dtype=F16))
