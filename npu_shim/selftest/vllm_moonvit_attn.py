"""Selftest of ``vllm.moonvit_attn``.

``run()`` builds vLLM's real ``MoonVitPretrainedModel`` (already patched by the
shim) with Kimi-VL's head geometry (head dim 72, so the NPU path pads it to
128) and random weights, runs one vision-tower forward over three images of
uneven grids packed into one sequence, and reports:

* ``max_abs_err``: the largest deviation of any layer's ``ascend_fa`` output
  from ``npu_shim.testing.attention_f64`` evaluated on the very q/k/v that layer
  handed to the NPU op (recorded with ``record_npu_calls``);
* ``host_syncs``: host syncs of the attention path in that forward (one: the
  single read of ``cu_seqlens``, whatever the depth);
* checks that every layer made exactly one fused ``npu_fusion_attention`` call
  with no mask (a failure raises).

The tower set-up is :mod:`npu_shim.testing.moonvit`'s, shared with the tests and the benchmark.
"""
from npu_shim.testing.moonvit import SELFTEST, applied_module, build_tower, check_tower, describe, selftest_dtype


def run(device=None):
    device = device or "cpu"
    module = applied_module()
    dtype = selftest_dtype(device)
    model = build_tower(module, SELFTEST, dtype=dtype, device=device, choice="auto")
    max_err, tolerance, syncs, seconds = check_tower(model, SELFTEST, dtype=dtype, device=device)
    return {
        "max_abs_err": max_err,
        "tolerance": tolerance,
        "host_syncs": syncs,
        "seconds": seconds,
        "detail": describe(SELFTEST, dtype) + ", NPU_SHIM_MOONVIT_ATTN=auto, one fused call/layer, no mask",
    }
