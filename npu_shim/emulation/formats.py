"""Emulation of ``torch_npu.npu_format_cast``, ``torch_npu.empty_with_format`` and
``torch_npu.get_npu_format`` (a tensor's storage format on the device).

vllm-ascend's 310P path makes its KV cache with ``empty_with_format(..., acl_format=29)`` and casts its
attention masks to FRACTAL_NZ (``vllm_ascend/_310p``).

sglang casts every unquantized MoE weight to FRACTAL_NZ after loading
(``NPUUnquantMoEMethod.process_weights_after_loading`` through its ``npu_format_cast`` helper,
``torch.ops.npu.npu_format_cast(tensor, 29)``).

Documented behaviour (Ascend Extension for PyTorch API reference, (beta)
torch_npu.npu_format_cast(self, acl_format) -> Tensor: "修改NPU张量的格式", ``acl_format`` an
aclFormat number, e.g. 2 for ACL_FORMAT_ND, 29 for FRACTAL_NZ): the result holds the same
logical values in the asked storage layout. The emulated device keeps every tensor in its logical
layout, so the result is a copy with the input's values and dtype; the storage layout itself is
not modelled, only recorded (below). A
number that is not one of the aclFormat values below is refused, as are the packed-FP4 unpacking
arguments (``customize_dtype``, ``input_dtype``), which this emulation does not implement.

The format a tensor was given (by ``npu_format_cast`` or ``empty_with_format``) is recorded on the
result (:func:`acl_format_of`, also ``torch_npu.get_npu_format``), because the ATB kernels choose
their reading by it, as op-plugin's ATB glue hands each tensor's format to ATB
(``atb::utils::GetFormatForAtb``: FRACTAL_NZ kept, the base formats as ND). What NZ means for the
shapes 310P's vllm-ascend gives those ops is in :func:`nz_to_nd`: for them the NZ storage is the
logical row-major order itself, so keeping the logical values is exact.

``torch_npu.empty_with_format(size, dtype=None, layout=None, device=None, pin_memory=False,
acl_format=2)`` (Ascend Extension for PyTorch 6.0.0 API reference, (beta) empty_with_format: "返回一个
填充未初始化数据的张量", ``acl_format`` "返回张量所需内存格式"): ``torch.empty`` of that size, dtype and
device, its format recorded; a layout other than strided and pinned memory are refused
(NotImplementedError), as is a format number that is not an aclFormat value (ValueError).
"""
import torch
OP = "npu_format_cast"
EMPTY_OP = "empty_with_format"
ND, NZ = 2, 29
_FORMAT_ATTR = "npu_shim_acl_format"
NZ_CUBE = 16   # FRACTAL_NZ's fractal: 16 x 16 for the 2-byte types (int8: 16 x 32, not emulated)

# aclFormat (CANN AscendCL): the values a cast may name
ACL_FORMATS = {0: "NCHW", 1: "NHWC", 2: "ND", 3: "NC1HWC0", 4: "FRACTAL_Z", 27: "NDHWC", 29: "FRACTAL_NZ",
               30: "NCDHW", 32: "NDC1HWC0", 33: "FRACTAL_Z_3D"}


def npu_format_cast(self, acl_format, *, customize_dtype=None, input_dtype=None):
    _check_format(OP, acl_format)
    if customize_dtype is not None or input_dtype is not None:
        raise NotImplementedError("%s: the packed-FP4 unpacking (customize_dtype=%r, input_dtype=%r) is not emulated"
                                  % (OP, customize_dtype, input_dtype))
    out = self.clone()
    _record(out, acl_format)
    return out


def _check_format(op, acl_format):
    if acl_format not in ACL_FORMATS:
        raise ValueError("%s: acl_format %r is not an aclFormat value (%s)"
                         % (op, acl_format, ", ".join("%d %s" % kv for kv in sorted(ACL_FORMATS.items()))))


def _record(tensor, acl_format):
    setattr(tensor, _FORMAT_ATTR, int(acl_format))


def acl_format_of(tensor):
    """The aclFormat recorded on ``tensor`` by the emulated ``npu_format_cast`` / ``empty_with_format``;
    ND (2) for any other tensor (torch_npu's default format for a tensor of up to 4 dims made by torch)."""
    return getattr(tensor, _FORMAT_ATTR, ND)


def get_npu_format(tensor):
    """``torch_npu.get_npu_format(tensor)``: the tensor's aclFormat number."""
    return acl_format_of(tensor)


def empty_with_format(size, dtype=None, layout=None, device=None, pin_memory=False, acl_format=ND):
    _check_format(EMPTY_OP, acl_format)
    if layout not in (None, torch.strided):
        raise NotImplementedError("%s: layout %r is not emulated (strided only)" % (EMPTY_OP, layout))
    if pin_memory:
        raise NotImplementedError("%s: pin_memory=True is not emulated" % EMPTY_OP)
    out = torch.empty(tuple(size), dtype=dtype, device=device)
    _record(out, acl_format)
    return out


def nz_to_nd(op, name, tensor):
    """The row-major (rows, cols) matrix a FRACTAL_NZ tensor of shape (1, cols / 16, rows, 16) holds.

    Why this reading: FRACTAL_NZ stores an ND (rows, cols) matrix (rows and cols padded to 16) as
    (cols / 16, rows / 16, 16, 16) fractals, element [i, j] at [j // 16, i // 16, i % 16, j % 16]; with
    the two middle dims merged that is (cols / 16, rows, 16), element [i, j] at [j // 16, i, j % 16]:
    the documented 310P shapes ("[1, 128//16, 128, 16]" for a 128 x 128 mask in ATB
    SelfAttentionOperation's constraints; "[block_num, head_size * head_num / 16, block_size, 16]" for
    the 310P KV cache in ATB's reshape_and_cache / paged_attention inference demos). vllm-ascend builds
    its 310P masks that way with plain reshapes (``vllm_ascend.utils.nd_to_nz_2d``: pad to 16, view as
    (1, rows, cols / 16, 16), swap dims 1 and 2) and then casts the 4-D result to NZ; the NZ form of a
    tensor whose last two dims are (a multiple of 16, 16) is its own row-major order, so the kernel
    receives exactly those values in that order. Any other shape is refused."""
    if tensor.dim() != 4 or tensor.shape[0] != 1 or tensor.shape[3] != NZ_CUBE or tensor.shape[2] % NZ_CUBE:
        raise NotImplementedError("%s: %s in FRACTAL_NZ of shape %s is not emulated (only (1, cols / 16, rows, 16) "
                                  "with rows a multiple of 16)" % (op, name, tuple(tensor.shape)))
    col_tiles, rows = tensor.shape[1], tensor.shape[2]
    return tensor[0].permute(1, 0, 2).reshape(rows, col_tiles * NZ_CUBE)
