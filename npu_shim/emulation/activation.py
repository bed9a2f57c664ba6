"""Emulation of ``torch_npu.npu_swiglu`` (the SwiGlu activation).

vllm-ascend calls it for every gated MLP: ``AscendSiluAndMul.forward_oot`` (``npu_swiglu(x)``)
and the MoE experts' activation (``vllm_ascend/ops/fused_moe/moe_mlp.py``).

Documented behaviour implemented (Ascend Extension for PyTorch API reference,
torch_npu.npu_swiglu(Tensor self, int dim=-1) -> Tensor): ``self`` is split in two equal
halves ``A, B`` along ``dim`` and the result is ``Swish(A) * B = A * sigmoid(A) * B``; the
split dimension must be even. Computed in float32 (the input's own float64 in a test) and
rounded to the input dtype once.
"""
import torch

from npu_shim.emulation import dtypes

OP = "npu_swiglu"


def npu_swiglu(self, dim=-1):
    dtypes.check(OP, self=self)
    size = self.shape[dim]
    if size % 2:
        raise ValueError("%s: dim %d has odd size %d; it is split in two halves" % (OP, dim, size))
    dt = torch.float64 if self.dtype == torch.float64 else torch.float32
    a, b = self.to(dt).chunk(2, dim=dim)
    return (a * torch.sigmoid(a) * b).to(self.dtype)
