"""Emulation of ``torch_npu.npu_format_cast`` (a tensor's storage format on the device).

sglang casts every unquantized MoE weight to FRACTAL_NZ after loading
(``NPUUnquantMoEMethod.process_weights_after_loading`` through its ``npu_format_cast`` helper,
``torch.ops.npu.npu_format_cast(tensor, 29)``).

Documented behaviour (Ascend Extension for PyTorch API reference, (beta)
torch_npu.npu_format_cast(self, acl_format) -> Tensor: "修改NPU张量的格式", ``acl_format`` an
aclFormat number, e.g. 2 for ACL_FORMAT_ND, 29 for FRACTAL_NZ): the result holds the same
logical values in the asked storage layout. The emulated device keeps every tensor in its logical
layout, so the result is a copy with the input's values and dtype; the layout itself is not
modelled (no op here reads it; an op that needs NZ on the hardware, 310P's, is not emulated). A
number that is not one of the aclFormat values below is refused, as are the packed-FP4 unpacking
arguments (``customize_dtype``, ``input_dtype``), which this emulation does not implement.
"""
OP = "npu_format_cast"

# aclFormat (CANN AscendCL): the values a cast may name
ACL_FORMATS = {0: "NCHW", 1: "NHWC", 2: "ND", 3: "NC1HWC0", 4: "FRACTAL_Z", 27: "NDHWC", 29: "FRACTAL_NZ",
               30: "NCDHW", 32: "NDC1HWC0", 33: "FRACTAL_Z_3D"}


def npu_format_cast(self, acl_format, *, customize_dtype=None, input_dtype=None):
    if acl_format not in ACL_FORMATS:
        raise ValueError("%s: acl_format %r is not an aclFormat value (%s)"
                         % (OP, acl_format, ", ".join("%d %s" % kv for kv in sorted(ACL_FORMATS.items()))))
    if customize_dtype is not None or input_dtype is not None:
        raise NotImplementedError("%s: the packed-FP4 unpacking (customize_dtype=%r, input_dtype=%r) is not emulated"
                                  % (OP, customize_dtype, input_dtype))
    return self.clone()
