"""Emulation of ``torch_npu._npu_matmul_add_fp32`` (ATB ``LinearOperation``, accumulating).

Documented behaviour implemented (op-plugin ``op_plugin/ops/atb/LinearAtb.cpp``:
``_npu_matmul_add_fp32(x, weight, C)`` runs ``LinearOperation`` with ``transposeA = true``,
``transposeB = false``, ``hasBias = false``, ``enAccum = true``, input ``C`` and output ``C``;
MindSpeed's page for the same kernel, ``npu_matmul_add_fp32``: x and weight float16 or bfloat16, C
float32, "product = torch.mm(x.T, weight); result = product + C"): ``C += x^T @ weight`` in place,
accumulated in float32; returns nothing. ``x`` is ``(m, k)``, ``weight`` ``(m, n)``, ``C``
``(k, n)``. vllm-ascend's worker calls it once at start-up (``NPUWorker._warm_up_atb``, its result
discarded) to initialise ATB; 310P has no such kernel (vllm-ascend's 310P worker skips the call).
"""
import torch

from npu_shim.emulation import dtypes

OP = "_npu_matmul_add_fp32"


def _npu_matmul_add_fp32(x, weight, c):
    dtypes.check(OP, x=x, weight=weight)
    if x.dtype != weight.dtype:
        raise ValueError("%s: x is %s and weight %s; they must match" % (OP, x.dtype, weight.dtype))
    if c.dtype != torch.float32:
        raise ValueError("%s: C must be float32 (the accumulator), got %s" % (OP, c.dtype))
    if x.dim() != 2 or weight.dim() != 2 or c.dim() != 2:
        raise ValueError("%s: x, weight and C must be 2-D, got %s, %s, %s"
                         % (OP, tuple(x.shape), tuple(weight.shape), tuple(c.shape)))
    if x.shape[0] != weight.shape[0] or tuple(c.shape) != (x.shape[1], weight.shape[1]):
        raise ValueError("%s: x %s (m, k), weight %s (m, n) and C %s (k, n) do not agree"
                         % (OP, tuple(x.shape), tuple(weight.shape), tuple(c.shape)))
    c.add_(x.float().t() @ weight.float())
