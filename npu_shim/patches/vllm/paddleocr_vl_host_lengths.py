"""vllm.paddleocr_vl_host_lengths — PaddleOCR-VL's ``cu_seqlens`` copy keeps the host lengths it copied.

Why: vLLM's PaddleOCR-VL builds ``cu_seqlens`` on the host (a list in ``encode_image``,
  0.28.0 .. 0.30.0; a NumPy ``cumsum`` in 0.33.0) and copies it to the device itself with
  ``async_tensor_h2d(cu_seqlens, dtype=torch.int32, device=...)`` (in ``encode_image``, or in
  ``SiglipEncoder.forward`` where it is handed a host tensor), not through
  ``MMEncoderAttention.maybe_recompute_cu_seqlens``, so ``vllm.mm_encoder_host_lengths``
  never sees it. vllm-ascend's attention (with ``vllm.mm_encoder_attn``) reads the copy back:
  1 device->host read per tower call (upstream: 1 per layer), of numbers the host built a line
  above. 0.28.0 .. 0.30.0 call the tower once per image, so that is 1 read per image.
How: the module's own binding of vLLM's ``async_tensor_h2d`` (``from vllm.utils.torch_utils
  import async_tensor_h2d``) is wrapped, nothing else; the check requires that every call of it
  in the module is the ``cu_seqlens`` copy. Upstream's function runs with the caller's
  arguments (same op, same staging, same non-blocking copy); where it returns a 1-D int32
  tensor and the data it was handed is a host list, NumPy array or CPU tensor, the same values
  as int32 on the host are kept on the returned tensor with
  :func:`npu_shim.patches._shared.host_record.remember_lengths` (length and dtype must
  match). The attention's host read takes them once instead of reading back. The host values
  are the data the copy was made from, so they cannot differ from the device tensor's.
Window: read in the wheels: 0.28.0, 0.29.0 and 0.30.0 (``encode_image`` copies the list with
  ``async_tensor_h2d``; ``SiglipEncoder.forward`` copies a list the same way and moves a tensor
  with ``.to(device, non_blocking=True)``) and 0.33.0 (``encode_image`` hands the tower a host
  tensor, ``SiglipEncoder.forward`` copies it with ``async_tensor_h2d``). Run in the lanes
  vllm-0.28, vllm-0.29 and vllm-0.30. 0.26.0 and 0.27.1 copy with
  ``torch.tensor(cu_seqlens, dtype=torch.int32).to(pixel_values.device)`` (a blocking copy)
  after reading the device grid back (their field config sends ``image_grid_thw`` to the
  device): not in the window.
Upstream fix: none (vllm-ascend reads ``cu_seqlens`` back in every release read).
Remove when: PaddleOCR-VL copies ``cu_seqlens`` through ``maybe_recompute_cu_seqlens``, or
  vllm-ascend's attention takes host lengths from vLLM.
"""
import inspect

from npu_shim.patch import Defect, Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared import host_record
# the data it was handed as int32 host lengths; None for a device tensor (a stand-in's cpu:0
# included) or data that are not integers
from npu_shim.patches._shared.host_data import host_int32

TARGET = "vllm.model_executor.models.paddleocr_vl"
FUNCTION = "async_tensor_h2d"
VLLM_HOME = "vllm.utils.torch_utils"
# vLLM's signature: (data, device, dtype), in the later releases read also out=
PARAMS = (("data", "device", "dtype"), ("data", "device", "dtype", "out"))


def _squeezed(text):
    return "".join(text.split())


class _ModuleCopy:
    """Every ``async_tensor_h2d`` call of the module is ``cu_seqlens = async_tensor_h2d(cu_seqlens,
    dtype=torch.int32, device=...)`` (white space ignored); the module holds vLLM's function."""

    def __init__(self, statement):
        self.statement = statement

    def check(self, module, context):
        copy = getattr(module, FUNCTION, None)
        if getattr(copy, "__module__", None) != VLLM_HOME or getattr(copy, "__name__", None) != FUNCTION:
            raise TargetMismatch("%s.%s is not vLLM's %s.%s" % (module.__name__, FUNCTION, VLLM_HOME, FUNCTION))
        params = tuple(inspect.signature(copy).parameters)
        if params not in PARAMS:
            raise TargetMismatch("%s.%s takes %s; the family knows %s"
                                 % (VLLM_HOME, FUNCTION, params, " or ".join(map(str, PARAMS))))
        try:
            source = _squeezed(inspect.getsource(module))
        except (OSError, TypeError):
            raise TargetMismatch("%s: no source to find its cu_seqlens copies in" % module.__name__) from None
        calls, copies = source.count(FUNCTION + "("), source.count(_squeezed(self.statement))
        if copies == 0:
            raise TargetMismatch("%s does not copy cu_seqlens with %s" % (module.__name__, self.statement))
        if calls != copies:
            raise TargetMismatch("%s calls %s %d times, %d of them not the cu_seqlens copy"
                                 % (module.__name__, FUNCTION, calls, calls - copies))

    def build(self, module, context):
        upstream = getattr(module, FUNCTION)
        signature = inspect.signature(upstream)

        def async_tensor_h2d(*args, **kwargs):
            result = upstream(*args, **kwargs)                      # upstream's copy, its arguments
            data = signature.bind(*args, **kwargs).arguments.get("data")
            context.count("calls")
            host_record.remember_lengths(result, lambda: host_int32(data))
            return result

        context.present(async_tensor_h2d, upstream,
                        "upstream's copy, and the host values it copied kept on the int32 tensor it returns")
        return {FUNCTION: async_tensor_h2d}


# upstream's statement (white space ignored), in every release read
ASYNC_H2D = _ModuleCopy("cu_seqlens = async_tensor_h2d(cu_seqlens, dtype=torch.int32, device=")

PATCH = Patch(
    name="vllm.paddleocr_vl_host_lengths",
    target=TARGET,
    replaces=(FUNCTION,),
    requires={"vllm": ""},
    outside_window={"vllm": "the two releases read below the window copy cu_seqlens with "
                            "torch.tensor(...).to(device) after reading the device grid back (not patched); "
                            "older ones were not read"},
    needs_npu=True,
    families=(
        Family(__name__ + ":ASYNC_H2D", fence=">=0.28.0",
               keeps="async_tensor_h2d(cu_seqlens, dtype=torch.int32, device=...)"),
    ),
    summary="PaddleOCR-VL's cu_seqlens copy keeps the host values it copied; vllm.mm_encoder_attn takes "
            "them instead of reading back: 0 reads per forward (without it: 1 per image; vllm-ascend "
            "alone: 1 per layer and image)",
    # 0 where the grid is on the host (the later releases read): what this patch is for; a read is
    # the defect back. The first release read's field config sends the grid to the device:
    # encode_image's .tolist() of each image's
    # grid row is left, one for each of the selftest's two images.
    selftest=Selftest("npu_shim.selftest.vllm_census_tower:run",
                      host_syncs={"grid on the host": 0, "grid on the device": 2}, arguments={"tower": "PaddleOCR-VL"}),
    defect=Defect("PaddleOCR-VL's tower reads back the cu_seqlens it copied from the host", shows="reads"),
)
