"""Selftest of ``vllm.mm_merge_310p``: vLLM's own merge of image embeddings, in float16.

Calls the patched ``_merge_multimodal_embeddings`` of the installed vLLM on a
prompt of 24 rows with three image items (3, 5 and 3 rows) in float16, the dtype
310P models run. The mask is built on the host, as vLLM's model runner builds it
(``device="cpu"``); the prompt and the embeddings are on the device. The result is
compared with a float64 reference written from the definition of the merge (row
``i`` is the next embedding row where the mask is set, the prompt's row otherwise):
a copy of float16 rows, so the tolerance is 0.

On a 310P (case ``"310P"``) the shim's path runs (``torch.nonzero`` + ``index_copy_``)
and must read nothing back: the positions come from the host mask. On the emulation
the aicpu IndexPut defect is modelled as well (:mod:`npu_shim.emulation.index_put`):
a boolean-mask assignment on a device tensor raises there, so the selftest also
shows the path never reaches it. On an A2/A3 (case ``"A2/A3"``) the replacement hands
the call to upstream's function, which must give the same rows, with no read either.
Either way the selftest checks, from the shim's counters, which of the two ran.
"""
import contextlib
import time

PATCH_NAME = "vllm.mm_merge_310p"
HIDDEN = 32
ROWS = 24
SPANS = ((1, 4), (7, 12), (20, 23))     # 3, 5 and 3 placeholder rows
TOLERANCE = 0.0                          # a copy of float16 rows: exact
CASE_310P, CASE_A2 = "310P", "A2/A3"


def reference(inputs, embeddings, mask):
    """float64, from the definition: row i is the next embedding row where mask[i], else inputs[i]."""
    rows = iter([row.double() for item in embeddings for row in item])
    out = inputs.double().clone()
    for i in range(mask.shape[0]):
        if bool(mask[i]):
            out[i] = next(rows)
    if next(rows, None) is not None:
        raise ValueError("more embedding rows than placeholders")
    return out


def case(device, dtype):
    """(prompt rows, embeddings per item, host mask), seeded."""
    import torch

    gen = torch.Generator().manual_seed(25)
    mask = torch.zeros(ROWS, dtype=torch.bool)
    for start, stop in SPANS:
        mask[start:stop] = True
    embeddings = [torch.randn(stop - start, HIDDEN, generator=gen).to(dtype).to(device)
                  for start, stop in SPANS]
    inputs = torch.randn(ROWS, HIDDEN, generator=gen).to(dtype).to(device)
    return inputs, embeddings, mask


def run(device=None):
    import torch

    import npu_shim
    from npu_shim import emulation
    from npu_shim.patches.vllm.mm_merge_310p import FUNCTION
    from npu_shim.patches.vllm.mm_merge_310p.families import on_310p
    from npu_shim.selftest import applied_target, on_upstream
    from npu_shim.testing import count_host_syncs

    device = device or "cpu"
    module = applied_target(PATCH_NAME)
    merge = getattr(module, FUNCTION)
    family = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)["family"]
    on_310p_here = on_310p()
    inputs, embeddings, mask = case(device, torch.float16)
    ref = reference(inputs.cpu(), [e.cpu() for e in embeddings], mask)
    before = dict(npu_shim.stats()[PATCH_NAME])
    stand_ins = [inputs, *embeddings] if device == "cpu" else []
    started = time.perf_counter()
    with count_host_syncs(device_tensors=stand_ins, follow_placement=True) as syncs:
        defect = contextlib.nullcontext()
        if emulation.is_emulated():
            from npu_shim.emulation.index_put import aicpu_index_put_defect

            defect = aicpu_index_put_defect(syncs.is_device)
        with defect:
            out = merge(inputs, embeddings, mask)
        if device != "cpu":
            torch.npu.synchronize()
    seconds = time.perf_counter() - started
    after = npu_shim.stats()[PATCH_NAME]
    ran = "calls" if on_310p_here else "upstream_calls"
    if not on_upstream(PATCH_NAME) and after[ran] != before[ran] + 1:
        raise RuntimeError("the replacement did not take the %s path on this %s (stats %s -> %s)"
                           % ("shim's" if on_310p_here else "upstream's", CASE_310P if on_310p_here
                              else CASE_A2, before, after))
    if out.dtype != torch.float16 or out.shape != ref.shape:
        raise RuntimeError("merged %s %s, expected float16 %s" % (out.dtype, tuple(out.shape), tuple(ref.shape)))
    err = (out.double().cpu() - ref).abs().max().item()
    return {
        "case": CASE_310P if on_310p_here else CASE_A2,
        "max_abs_err": err,
        "tolerance": TOLERANCE,
        "host_syncs": syncs.count,
        "seconds": seconds,
        "detail": "vLLM %s: %d rows, items of %s rows, float16 on %s, host mask; %s; family %s"
                  % (FUNCTION, ROWS, [stop - start for start, stop in SPANS], device,
                     "torch.nonzero + index_copy_ (emulated IndexPut defect armed)" if on_310p_here
                     and emulation.is_emulated() else "torch.nonzero + index_copy_" if on_310p_here
                     else "upstream's boolean-mask assignment", family),
    }
