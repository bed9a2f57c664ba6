"""NPU_SHIM_EMULATE_DEFECTS: each emulated op behaves as upstream's report says, for the calls the
report names and no other (checked against float64), and the selftest's probe of that call fails
on it, naming the op, the call, the report and what to try; with none on, the probes pass."""
import pytest
import torch

from npu_shim import emulation
from npu_shim.testing import attention_f64, dense_segments

emulation.install()
import torch_npu  # noqa: E402

ENV = "NPU_SHIM_EMULATE_DEFECTS"
F16 = torch.float16
TOL = 2e-3      # float16 against float64 (tests/test_emulation_fusion_attention.py)


def _err(out, ref):
    return (out.double().reshape(ref.shape) - ref).abs().max().item()


# ------------------------------------------------------ fia-tnd-uniform (vllm-ascend #13699)

def _tnd(images=(40, 9, 70), heads=8, kv_heads=2, dim=128, seed=0):
    gen = torch.Generator().manual_seed(seed)
    total = sum(images)
    q = torch.randn(total, heads, dim, generator=gen).to(F16)
    k, v = (torch.randn(total, kv_heads, dim, generator=gen).to(F16) for _ in range(2))
    return q, k, v, dense_segments(images)


def _tnd_call(q, k, v, cum, **extra):
    return torch_npu.npu_fused_infer_attention_score(
        query=q, key=k, value=v, atten_mask=None, block_table=None, input_layout="TND",
        actual_seq_lengths=cum[1:], actual_seq_lengths_kv=cum[1:], num_heads=q.shape[1],
        num_key_value_heads=k.shape[1], scale=0.2, sparse_mode=0, **extra)[0]


def _segment_means_f64(v, cum, heads):
    """The plain average of V over each segment, per query head (float64, by hand)."""
    v = v.double()
    groups = heads // v.shape[1]
    rows = []
    for s, e in zip(cum[:-1], cum[1:]):
        mean = v[s:e].sum(dim=0) / (e - s)                                     # (Nkv, Dv)
        rows.append(torch.stack([mean[h // groups] for h in range(heads)]).expand(e - s, heads, -1))
    return torch.cat(rows)


def test_fia_tnd_uniform_returns_each_segments_mean_of_v(monkeypatch):
    q, k, v, cum = _tnd()
    ref = attention_f64(q, k, v, cum, scale=0.2)
    assert _err(_tnd_call(q, k, v, cum), ref) < TOL                           # none on: the documented op
    monkeypatch.setenv(ENV, "fia-tnd-uniform")
    out = _tnd_call(q, k, v, cum)
    assert _err(out, _segment_means_f64(v, cum, q.shape[1])) < TOL           # every image of the pack
    assert _err(out, ref) > 0.3                                              # and far from attention


def test_fia_tnd_uniform_leaves_the_calls_the_report_does_not_name(monkeypatch):
    """A mask (sparse_mode 3, the LLM path) or another layout: the documented op, defect on."""
    monkeypatch.setenv(ENV, "fia-tnd-uniform")
    q, k, v, cum = _tnd()
    mask = torch.ones(2048, 2048, dtype=torch.bool).triu(1)
    out = torch_npu.npu_fused_infer_attention_score(
        q, k, v, atten_mask=mask, input_layout="TND", actual_seq_lengths=cum[1:],
        actual_seq_lengths_kv=cum[1:], num_heads=8, num_key_value_heads=2, scale=0.2, sparse_mode=3)[0]
    assert _err(out, attention_f64(q, k, v, cum, scale=0.2, causal=True)) < TOL
    bsnd = torch.randn(1, 30, 8, 64).to(F16)
    out = torch_npu.npu_fused_infer_attention_score(bsnd, bsnd, bsnd, input_layout="BSND", num_heads=8,
                                                    scale=0.2)[0]
    flat = bsnd.reshape(30, 8, 64)
    assert _err(out, attention_f64(flat, flat, flat, [0, 30], scale=0.2)) < TOL


# --------------------------------------------------------- fia-mask-512 (vllm-ascend #15503)

HEADS, DIM, BLOCK, CAPACITY = 4, 64, 128, 1024


def _paged(seed=1):
    gen = torch.Generator().manual_seed(seed)
    blocks = CAPACITY // BLOCK
    k_cache, v_cache = (torch.randn(blocks, BLOCK, HEADS * DIM, generator=gen).to(F16) for _ in range(2))
    table = torch.arange(blocks, dtype=torch.int32).flip(0).reshape(1, blocks)
    rows = table[0].long()[torch.arange(CAPACITY) // BLOCK] * BLOCK + torch.arange(CAPACITY) % BLOCK
    k_rows, v_rows = (c.reshape(-1, HEADS, DIM)[rows] for c in (k_cache, v_cache))
    q = torch.randn(1, 1, HEADS * DIM, generator=gen).to(F16)
    return q, k_cache, v_cache, table, k_rows, v_rows


def _decode(q, k_cache, v_cache, table, mask):
    return torch_npu.npu_fused_infer_attention_score(
        q, k_cache, v_cache, atten_mask=mask, block_table=table, actual_seq_lengths_kv=[CAPACITY],
        num_heads=HEADS, num_key_value_heads=HEADS, input_layout="BSH", scale=DIM ** -0.5,
        block_size=BLOCK, sparse_mode=0)[0]


def _valid(length, shape=(1, 1, 1, CAPACITY), dtype=torch.bool):
    mask = torch.zeros(shape, dtype=dtype)
    mask[..., length:] = 1
    return mask


@pytest.mark.parametrize("length", [300, 512, 513, 700, 1000])
def test_fia_mask_512_drops_the_keys_past_512(monkeypatch, length):
    q, k_cache, v_cache, table, k_rows, v_rows = _paged()
    q3 = q.reshape(1, HEADS, DIM)

    def ref(n):
        return attention_f64(q3, k_rows[:n], v_rows[:n], [0, 1], [0, n], scale=DIM ** -0.5)

    assert _err(_decode(q, k_cache, v_cache, table, _valid(length)), ref(length)) < TOL   # none on
    monkeypatch.setenv(ENV, "fia-mask-512")
    out = _decode(q, k_cache, v_cache, table, _valid(length))
    assert _err(out, ref(min(length, 512))) < TOL                 # the keys from 512 on are left out
    if length > 512:
        assert _err(out, ref(length)) > (1e-2 if length >= 700 else 1e-4)   # wrong from 513, growing with L


def test_fia_mask_512_leaves_the_masks_the_report_does_not_name(monkeypatch):
    """Other mask shapes and a non-bool mask: the documented op, defect on."""
    monkeypatch.setenv(ENV, "fia-mask-512")
    q, k_cache, v_cache, table, k_rows, v_rows = _paged()
    ref = attention_f64(q.reshape(1, HEADS, DIM), k_rows[:900], v_rows[:900], [0, 1], [0, 900],
                        scale=DIM ** -0.5)
    for mask in (_valid(900, (1, 1, CAPACITY)), _valid(900, (1, CAPACITY)), _valid(900, dtype=torch.int8)):
        assert _err(_decode(q, k_cache, v_cache, table, mask), ref) < TOL, mask.shape


# ----------------------------------------------------------------------- the switch itself

def test_an_unknown_defect_is_refused_naming_the_variable(monkeypatch):
    from npu_shim._config import ConfigError, Settings
    from npu_shim.emulation import defects

    monkeypatch.setenv(ENV, "fia-tnd-uniform,fia-mask-513")
    q, k, v, cum = _tnd()
    with pytest.raises(ValueError, match="NPU_SHIM_EMULATE_DEFECTS=.*'fia-mask-513'.*fia-tnd-uniform, fia-mask-512"):
        _tnd_call(q, k, v, cum)
    with pytest.raises(ConfigError, match="'fia-mask-513'"):
        Settings({"NPU_SHIM_EMULATE": "1", ENV: "fia-mask-513"})
    assert Settings({ENV: "fia-mask-513"}).enabled                # not checked unless emulating
    assert [d.name for d in defects.active({ENV: " fia-mask-512 , fia-tnd-uniform"})] == \
        ["fia-mask-512", "fia-tnd-uniform"]


# --------------------------------------- the selftest's probes: fail on each defect, pass without

@pytest.mark.parametrize("defect, key, words", [
    ("fia-tnd-uniform", "vllm-ascend#13699",
     ["npu_fused_infer_attention_score(input_layout='TND', sparse_mode=0, atten_mask=None, several images",
      "vllm-ascend #13699", "try NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1"]),
    ("fia-mask-512", "vllm-ascend#15503",
     ["npu_fused_infer_attention_score(sparse_mode=0, bool atten_mask [1, 1, 1, S], KV length > 512)",
      "vllm-ascend #15503", "try the valid KV length as actual_seq_lengths_kv"]),
])
def test_each_probe_fails_on_its_defect_only(monkeypatch, defect, key, words):
    from npu_shim.emulation import defects
    from npu_shim.selftest import op_reports

    reports = {r.key: r for r in op_reports.REPORTS}
    assert defects.DEFECTS[defect].issue == reports[key].issue        # one report, one emulated defect
    for report in reports.values():
        assert op_reports.run(report)["ok"], report.key              # none on
    monkeypatch.setenv(ENV, defect)
    for report in reports.values():
        result = op_reports.run(report)
        if report.key != key:
            assert result["ok"], (report.key, result["verdict"])
            continue
        assert not result["ok"] and result["max_abs_err"] > 10 * result["tolerance"], result
        for word in words:
            assert word in result["verdict"], (word, result["verdict"])
