"""Which window reading the installed ``npu_fused_infer_attention_score_v2`` has: a probe.

vllm-ascend hands a sliding-window layer's FIA v2 call ``sparse_mode=4, pre_tokens=W,
next_tokens=0`` (TND). The op page's band reading (quoted in
npu_shim/emulation/decoder_attention.py) admits W + 1 keys there, the model W; and the page says
pre_tokens has no effect "when Q_S is 1", which a TND decode call (every query segment one token
long) may or may not count as. Two calls answer it on whatever ops are installed (the real
kernels on an NPU, the emulation elsewhere), bfloat16, K = V = 128 (a documented TND head dim),
2 query heads over 1 KV head:

* ``prefill``: one TND segment of 20 queries over its own 20 keys (no paging, as vllm-ascend's
  ``PrefillNoCache``), pre_tokens=W=4: compared with W keys per query and with W + 1;
* ``decode``: a decode-only TND call, two sequences of one query each over 20 cached keys in
  16-token blocks, pre_tokens=W=4. The block table is what vLLM's KV manager leaves once the
  first block lies wholly before the window: ``[0, b]``, block 0 being the null block (filled
  with large random values). The query at position 19 has its window at 16-19; key 15, the one
  the W + 1 reading adds, is the null block's last row. Compared with W keys, W + 1 keys, and
  every key (pre_tokens ignored): each reading gives a different answer.

Each call's answer is the reading whose float64 reference (:mod:`npu_shim.testing.reference`,
over the key rows the block table names) the output matches within bfloat16 rounding (2**-7 of
max |ref|), or "none" with the errors. No device->host read inside the op calls (lengths are
host lists).
"""
import math

__all__ = ["WINDOW", "BLOCK", "probe_window_edge"]

WINDOW, BLOCK, KV_LEN = 4, 16, 20
HEADS, KV_HEADS, DIM = 2, 1, 128
OP = "npu_fused_infer_attention_score_v2"


def _reference(q, k, v, keys):
    """float64 attention of each query (the last len(q) positions of a kv_len-key sequence) over
    its last ``keys`` keys (None: every key)."""
    from npu_shim.testing.reference import attention_f64

    sq, skv = q.shape[0], k.shape[0]

    def allowed(segment, rows, cols):
        import torch

        pos = torch.arange(rows).unsqueeze(1) + (cols - rows)
        return torch.arange(cols).unsqueeze(0) > pos - keys

    return attention_f64(q, k, v, [0, sq], [0, skv], scale=1 / math.sqrt(DIM), causal=True,
                         allowed=None if keys is None else allowed)


def _judge(got, references):
    """(the reading whose reference ``got`` matches, {reading: error})."""
    errors = {}
    for name, ref in references.items():
        errors[name] = (got.double().cpu() - ref).abs().max().item() / max(ref.abs().max().item(), 1e-30)
    within = [name for name, err in errors.items() if err <= 2 ** -7]
    return (within[0] if len(within) == 1 else "none" if not within else "/".join(within)), errors


def probe_window_edge(device="cpu", seed=0):
    """{"prefill": reading, "decode": reading, "errors": {...}, "detail": str}; a reading is
    "W", "W+1", "all" (decode: pre_tokens ignored) or "none" (no reference matched)."""
    import torch
    import torch_npu

    generator = torch.Generator().manual_seed(seed)

    def rand(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=generator)).to(torch.bfloat16)

    mask = torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1).to(device)
    common = dict(num_query_heads=HEADS, num_key_value_heads=KV_HEADS, input_layout="TND",
                  softmax_scale=1 / math.sqrt(DIM), sparse_mode=4, pre_tokens=WINDOW, next_tokens=0,
                  atten_mask=mask)
    # prefill: 20 queries over their own 20 keys
    q, k, v = rand(KV_LEN, HEADS, DIM), rand(KV_LEN, KV_HEADS, DIM), rand(KV_LEN, KV_HEADS, DIM)
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(
        q.to(device), k.to(device), v.to(device), actual_seq_qlen=[KV_LEN], actual_seq_kvlen=[KV_LEN], **common)
    prefill, prefill_err = _judge(out, {"W": _reference(q, k, v, WINDOW), "W+1": _reference(q, k, v, WINDOW + 1)})
    # decode: two sequences, one query each, 20 cached keys; block 0 = the null block
    blocks = 1 + 2 * 2
    kc, vc = rand(blocks, BLOCK, KV_HEADS * DIM), rand(blocks, BLOCK, KV_HEADS * DIM)
    kc[0], vc[0] = rand(BLOCK, KV_HEADS * DIM, scale=8.0), rand(BLOCK, KV_HEADS * DIM, scale=8.0)
    table = torch.tensor([[0, 2], [0, 4]], dtype=torch.int32)     # blocks 1 and 3 freed: the null block
    qd = rand(2, HEADS, DIM)
    out, _ = torch_npu.npu_fused_infer_attention_score_v2(
        qd.to(device), kc.to(device), vc.to(device), block_table=table.to(device), block_size=BLOCK,
        actual_seq_qlen=[1, 2], actual_seq_kvlen=[KV_LEN, KV_LEN], **common)
    refs = {}
    for name, keys in (("W", WINDOW), ("W+1", WINDOW + 1), ("all", None)):
        rows = []
        for i in range(2):
            seen = torch.cat([kc[b] for b in table[i].tolist()])[:KV_LEN].view(KV_LEN, KV_HEADS, DIM)
            seen_v = torch.cat([vc[b] for b in table[i].tolist()])[:KV_LEN].view(KV_LEN, KV_HEADS, DIM)
            rows.append(_reference(qd[i:i + 1], seen, seen_v, keys))
        refs[name] = torch.cat(rows)
    decode, decode_err = _judge(out, refs)
    detail = ("window probe (FIA v2 TND sparse_mode 4, pre_tokens=W=%d, next_tokens=0): prefill (20 queries) "
              "admits %s keys, decode-only TND (Q_S 1, null block before the window) %s"
              % (WINDOW, prefill, {"all": "ignores pre_tokens (every key, the null block's too)",
                                  "W": "admits W keys", "W+1": "admits W + 1 keys (the null block's last row)"}
                 .get(decode, "matches no reading (errors %s)" % decode_err)))
    return {"prefill": prefill, "decode": decode, "errors": {"prefill": prefill_err, "decode": decode_err},
            "detail": detail}
