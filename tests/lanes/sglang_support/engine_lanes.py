"""The lanes the sglang engine tests run on, read from the pin files (variant lanes, e.g. another
Python, left out), naming no release.

* ``LANES`` (tests/lanes/test_engine_sglang.py, text): the lane pinning the newest sglang and the one
  pinning the oldest, where the Ascend backend has its oldest shape (a prefill log of page-rounded
  budgets, sglang's own Triton kernels launched on the device).
* ``VL_LANES`` (tests/lanes/test_engine_sglang_vl.py, one image request): the newest, and the lane above
  the oldest: on the oldest, sglang's NPU wrapper of the Qwen2-VL image processor
  (``hardware_backend/npu/modules/qwen_vl_processor.npu_wrapper_preprocess``) takes ``interpolation``
  where the transformers it pins passes ``resample``, so no image request reaches the tower
  (docs/validation.md); the lane above has the same tower families of the shim's sglang vision patches.
"""
from packaging.version import Version

from sglang_support import newest

_BY_RELEASE = sorted(newest._LANES, key=lambda lane: Version(newest._LANES[lane]["sglang"]))
OLDEST = _BY_RELEASE[0]
LANES = (newest.LANE, OLDEST)
VL_LANES = (newest.LANE, _BY_RELEASE[1])
