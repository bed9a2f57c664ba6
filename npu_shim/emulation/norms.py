"""Emulation of the RMSNorm family: ``torch_npu.npu_rms_norm``, ``torch_npu.npu_add_rms_norm``
and vllm-ascend's own ``torch.ops._C_ascend.npu_add_rms_norm_bias``.

vllm-ascend runs every decoder norm through them (``vllm_ascend/ops/layernorm.py``:
``AscendRMSNorm.forward_oot`` calls ``npu_rms_norm(x, weight, eps)`` without a residual and
``_C_ascend.npu_add_rms_norm_bias(x, residual, weight, bias, eps)`` with one;
``AscendGemmaRMSNorm`` calls ``npu_add_rms_norm(x, residual, 1 + weight, eps)``).

Documented behaviour implemented:

* ``npu_rms_norm(self, gamma, epsilon=1e-6) -> (y, rstd)`` (Ascend Extension for PyTorch
  API reference, torch_npu.npu_rms_norm; CANN aclnnRmsNorm): over the trailing
  ``gamma.dim()`` dimensions of ``x``, ``rstd = 1 / sqrt(mean(x^2) + eps)`` and
  ``y = x * rstd * gamma``. ``gamma``'s shape must equal ``x.shape[-gamma.dim():]``
  ("gamma_shape = x_shape[n:]") and its dtype ``x``'s ("数据类型需要和self保持一致").
  ``rstd`` is float32 with ``x``'s leading dimensions and ones for the normalised ones
  ("rstdOut … 数据类型支持FLOAT32 … shape与x前几维保持一致").
* ``npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6) -> (y, rstd, x)`` (CANN aclnnAddRmsNorm):
  ``x = x1 + x2``, then RmsNorm of ``x`` as above; ``x`` is returned in the input dtype.
* ``_C_ascend.npu_add_rms_norm_bias(x1, x2, gamma, beta=None, epsilon=1e-6)
  -> (y, rstd, x)`` (vllm-ascend csrc ``add_rms_norm_bias``, its torch binding's schema): npu_add_rms_norm with
  ``beta`` (shape of ``gamma``) added to ``y`` when given.

The kernels accumulate in float32 and round ``y`` and ``x`` to the input dtype once; the
emulation does the same (in the input's own precision when it is float64, which the dtype
table refuses outside a test's deliberate float32/float64 use).
"""
import torch

from npu_shim.emulation import dtypes

RMS = "npu_rms_norm"
ADD_RMS = "npu_add_rms_norm"
ADD_RMS_BIAS = "npu_add_rms_norm_bias"


def _check_gamma(op, x, gamma, name="gamma"):
    if not isinstance(gamma, torch.Tensor):
        raise TypeError("%s: %s must be a tensor, got %s" % (op, name, type(gamma).__name__))
    if gamma.dim() < 1 or gamma.dim() > x.dim() or tuple(gamma.shape) != tuple(x.shape[x.dim() - gamma.dim():]):
        raise ValueError("%s: %s has shape %s; it must equal the trailing dims of x %s"
                         % (op, name, tuple(gamma.shape), tuple(x.shape)))
    if gamma.dtype != x.dtype:
        raise ValueError("%s: %s has dtype %s, x %s; they must match" % (op, name, gamma.dtype, x.dtype))


def _compute_dtype(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rms(x, gamma, epsilon):
    """(y in the compute dtype, rstd float32) of RmsNorm over gamma's dims."""
    dims = tuple(range(x.dim() - gamma.dim(), x.dim()))
    xc = x.to(_compute_dtype(x))
    rstd = torch.rsqrt(xc.pow(2).mean(dim=dims, keepdim=True) + float(epsilon))
    return xc * rstd * gamma.to(xc.dtype), rstd.to(torch.float32)


def npu_rms_norm(self, gamma, epsilon=1e-6):
    dtypes.check(RMS, self=self)
    _check_gamma(RMS, self, gamma)
    y, rstd = _rms(self, gamma, epsilon)
    return y.to(self.dtype), rstd


def _add(op, x1, x2):
    dtypes.check(op, x1=x1, x2=x2)
    if x1.shape != x2.shape or x1.dtype != x2.dtype:
        raise ValueError("%s: x1 %s %s and x2 %s %s must have one shape and dtype"
                         % (op, tuple(x1.shape), x1.dtype, tuple(x2.shape), x2.dtype))
    dt = _compute_dtype(x1)
    return x1.to(dt) + x2.to(dt)


def npu_add_rms_norm(x1, x2, gamma, epsilon=1e-6):
    total = _add(ADD_RMS, x1, x2)
    _check_gamma(ADD_RMS, x1, gamma)
    y, rstd = _rms(total, gamma, epsilon)
    return y.to(x1.dtype), rstd, total.to(x1.dtype)


def npu_add_rms_norm_bias(x1, x2, gamma, beta=None, epsilon=1e-6):
    total = _add(ADD_RMS_BIAS, x1, x2)
    _check_gamma(ADD_RMS_BIAS, x1, gamma)
    y, rstd = _rms(total, gamma, epsilon)
    if beta is not None:
        _check_gamma(ADD_RMS_BIAS, x1, beta, "beta")
        y = y + beta.to(y.dtype)
    return y.to(x1.dtype), rstd, total.to(x1.dtype)
