"""The op calls upstream has reported silently wrong, probed on this box by ``npu-shim selftest``.

The shim keeps upstream's op calls; where upstream has reported one of them returning wrong
numbers with no error on some stacks, the selftest makes that call with shapes that reach the
reported trigger and compares it with the float64 reference. A failing row names the op and
the arguments of the call, the upstream report, and what to try instead. Each probe here has
an emulated counterpart (``NPU_SHIM_EMULATE_DEFECTS``, :mod:`npu_shim.emulation.defects`),
so the lanes see each probe fail on the defect it exists for, and pass without it.

* vllm-ascend #13699: ``npu_fused_infer_attention_score``, ``input_layout="TND"``,
  ``sparse_mode=0``, no mask (vllm-ascend's encoder call from 0.22.1rc1 on, 0.30.0rc2
  included; sglang's ``VisionAscendAttention`` makes the same call) returns the plain average
  of V. Probed with three images of 64, 16 and 100 tokens packed, 16 heads x 128, float16.
* vllm-ascend #15503: ``npu_fused_infer_attention_score``, ``sparse_mode=0``, bool
  ``atten_mask`` ``[1, 1, 1, S]`` (paged decode, BSH, one query token) is wrong from KV length
  513. Probed at valid lengths 137, 600 and 1500 of a 2048-slot paged cache (block size 128),
  12 heads x 64, float16, the slots past the valid length masked.

Not probed: sglang #38196 / PR #39905 (``_npu_flash_attention_qlens`` prefill wrong at page
sizes 16, 32, 64): the op's newer documentation refuses block sizes other than 128, and so
does its emulation, so no probe of it could be seen to fail here; ``sglang.small_page_fia`` keeps those page sizes off it (its
selftest sweeps page sizes 16, 32 and 64 through sglang's ``forward_extend``).
"""
import time

FIA = "npu_fused_infer_attention_score"


class OpReport:
    """One reported call: ``key`` (the row's name), the op, the call, the report, what to try,
    and the probe (``probe(device) -> (max_abs_err, tolerance, detail)``)."""

    __slots__ = ("key", "op", "call", "issue", "reported", "try_instead", "probe")

    def __init__(self, key, op, call, issue, reported, try_instead, probe):
        self.key, self.op, self.call, self.issue = key, op, call, issue
        self.reported, self.try_instead, self.probe = reported, try_instead, probe

    def failure(self):
        """What a failing row says besides its error: the call, the report, what to try."""
        return "%s(%s) is wrong here as %s reports (%s); try %s" % (
            self.op, self.call, self.issue, self.reported, self.try_instead)


# --------------------------------------------------------------- vllm-ascend #13699
TND_IMAGES = (64, 16, 100)
TND_HEADS, TND_HEAD_DIM, TND_SCALE = 16, 128, 0.1
F16_TOLERANCE = 5e-3        # as the encoder selftests (float16)


def probe_tnd_no_mask(device):
    import torch
    import torch_npu

    from npu_shim.testing import attention_f64, dense_segments

    gen = torch.Generator().manual_seed(13699)
    total = sum(TND_IMAGES)
    q, k, v = (torch.randn(total, TND_HEADS, TND_HEAD_DIM, generator=gen).to(device, torch.float16)
               for _ in range(3))
    cum = dense_segments(TND_IMAGES)
    out, _ = torch_npu.npu_fused_infer_attention_score(
        query=q, key=k, value=v, atten_mask=None, block_table=None, input_layout="TND",
        actual_seq_lengths=cum[1:], actual_seq_lengths_kv=cum[1:], num_key_value_heads=TND_HEADS,
        num_heads=TND_HEADS, scale=TND_SCALE, sparse_mode=0)
    ref = attention_f64(q, k, v, cum, scale=TND_SCALE)
    err = (out.detach().to("cpu", torch.float64) - ref).abs().max().item()
    return err, F16_TOLERANCE, "%s TND, sparse_mode=0, no mask: images of %s tokens packed, %d heads x %d, " \
        "float16 on %s" % (FIA, "/".join(map(str, TND_IMAGES)), TND_HEADS, TND_HEAD_DIM, device)


# --------------------------------------------------------------- vllm-ascend #15503
MASK_HEADS, MASK_HEAD_DIM, MASK_BLOCK, MASK_CAPACITY = 12, 64, 128, 2048
MASK_LENGTHS = (137, 600, 1500)     # below and past the reported 512
MASK_TOLERANCE = 4e-3               # the report's tolerance against fp32 (bf16)


def probe_mask_1x1x1xs(device):
    import torch
    import torch_npu

    from npu_shim.testing import attention_f64

    gen = torch.Generator().manual_seed(15503)
    blocks = MASK_CAPACITY // MASK_BLOCK
    hidden = MASK_HEADS * MASK_HEAD_DIM
    k_cache, v_cache = (torch.randn(blocks, MASK_BLOCK, hidden, generator=gen).to(device, torch.float16)
                        for _ in range(2))
    order = torch.randperm(blocks, generator=gen)
    block_table = order.to(torch.int32).reshape(1, blocks).to(device)
    rows = order[torch.arange(MASK_CAPACITY) // MASK_BLOCK] * MASK_BLOCK + torch.arange(MASK_CAPACITY) % MASK_BLOCK
    k_rows = k_cache.reshape(-1, MASK_HEADS, MASK_HEAD_DIM)[rows.to(k_cache.device)]
    v_rows = v_cache.reshape(-1, MASK_HEADS, MASK_HEAD_DIM)[rows.to(v_cache.device)]
    scale = MASK_HEAD_DIM ** -0.5
    errors = []
    for length in MASK_LENGTHS:
        q = torch.randn(1, 1, hidden, generator=gen).to(device, torch.float16)
        mask = torch.zeros(1, 1, 1, MASK_CAPACITY, dtype=torch.bool)
        mask[..., length:] = True
        out, _ = torch_npu.npu_fused_infer_attention_score(
            q, k_cache, v_cache, atten_mask=mask.to(device), block_table=block_table,
            actual_seq_lengths_kv=[MASK_CAPACITY], num_heads=MASK_HEADS, num_key_value_heads=MASK_HEADS,
            input_layout="BSH", scale=scale, block_size=MASK_BLOCK, sparse_mode=0)
        ref = attention_f64(q.reshape(1, MASK_HEADS, MASK_HEAD_DIM), k_rows[:length], v_rows[:length],
                            [0, 1], [0, length], scale=scale)
        errors.append((out.detach().to("cpu", torch.float64).reshape(ref.shape) - ref).abs().max().item())
    return max(errors), MASK_TOLERANCE, "%s BSH paged decode, sparse_mode=0, bool atten_mask [1, 1, 1, %d]: " \
        "KV lengths %s (errors %s), block size %d, %d heads x %d, float16 on %s" % (
            FIA, MASK_CAPACITY, "/".join(map(str, MASK_LENGTHS)), "/".join("%.1e" % e for e in errors),
            MASK_BLOCK, MASK_HEADS, MASK_HEAD_DIM, device)


REPORTS = (
    OpReport("vllm-ascend#13699", FIA,
             "input_layout='TND', sparse_mode=0, atten_mask=None, several images packed",
             "vllm-ascend #13699", "the plain average of V, error ~3.1, single and multi-image",
             "NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1 for vllm-ascend's encoder (npu_fusion_attention TND, "
             "vllm-ascend 0.18.0's call)", probe_tnd_no_mask),
    OpReport("vllm-ascend#15503", FIA,
             "sparse_mode=0, bool atten_mask [1, 1, 1, S], KV length > 512",
             "vllm-ascend #15503", "the mask not honoured past KV position 512",
             "the valid KV length as actual_seq_lengths_kv, or pse_shift [1, N, 1, S], instead of the "
             "[1, 1, 1, S] mask", probe_mask_1x1x1xs),
)


def run(report, device="cpu"):
    """``report``'s probe, judged: {max_abs_err, tolerance, ok, verdict, seconds, detail}."""
    started = time.perf_counter()
    err, tolerance, detail = report.probe(device)
    ok = err <= tolerance                               # NaN fails
    verdict = "ok" if ok else "FAIL (error): max_abs_err %.3g over tolerance %.3g; %s" % (
        err, tolerance, report.failure())
    return {"max_abs_err": err, "tolerance": tolerance, "ok": ok, "verdict": verdict,
            "seconds": time.perf_counter() - started, "detail": detail}
