"""vllm.cast_overflow_on_device — float16 overflow clamp decided on the device, not by two reads back.

Why: vLLM's ``cast_overflow_tensors`` (``vllm/model_executor/models/utils.py``), which
  Qwen2.5-VL's vision tower calls on its output when it runs in float16 (the dtype of
  310P) and the Whisper and MiniCPM-o audio encoders call too, asks
  ``if tensors.isinf().any() or tensors.isnan().any()`` before clamping to the dtype's
  range less ``offset``: each ``.any()`` is read back to the host, 2 device->host reads
  per call when nothing overflowed (1 when something did). Measured on vLLM 0.18.0's
  Qwen2.5-VL tower (``npu_shim.testing.towers``, 310P, float16): 2 reads per forward
  that ``vllm.qwen2_5_vl_host_lengths`` and ``vllm.mm_encoder_attn`` leave, the tower's
  only ones. The reads are of device data (whether anything overflowed), not of numbers
  the host has; the decision itself need not reach the host.
How: the function is replaced by one that computes the same flag on the device
  (``isinf().any() | isnan().any()``, a 0-d boolean) and selects with ``torch.where``
  between the clamped tensor and the tensor itself: the values upstream returns in both
  cases (``torch.equal``), no read. A non-floating tensor goes to upstream's function.
  Model modules import the function by name (``from .utils import cast_overflow_tensors``)
  and so hold the replacement; it defers to whatever the target module holds now, so they
  follow ``npu_shim.uninstall()`` and a later ``install()``.
Window: read in the wheels: 0.13.0 .. 0.21.0 test ``isinf().any() or isnan().any()``
  (one shape); from 0.22.1 upstream clamps unconditionally (no read): the check says
  "not needed" there.
Upstream fix: vLLM 0.22 (0.22.1 read): ``cast_overflow_tensors`` clamps without asking.
  Not backported here as such: an unconditional clamp changes values within ``offset`` of
  the dtype's largest finite value where nothing overflowed, which the releases of the
  window return unchanged.
Remove when: the pinned vLLM is 0.22 or later.
"""

from npu_shim.patch import Defect, Family, NotNeeded, Patch, Selftest, TargetMismatch

TARGET = "vllm.model_executor.models.utils"
FUNCTION = "cast_overflow_tensors"
PARAMS = ("tensors", "offset")
ASKS = ("isinf", "isnan", "any", "finfo", "clamp")


def _function(module):
    import inspect

    function = vars(module).get(FUNCTION)
    if not inspect.isfunction(function):
        raise TargetMismatch("%s.%s is not a function" % (module.__name__, FUNCTION))
    return function


class _AskThenClamp:
    def check(self, module, context):
        import inspect

        from npu_shim.patches._shared.code import names_in_code, source_text

        function = _function(module)
        params = tuple(inspect.signature(function).parameters)
        if params != PARAMS:
            raise TargetMismatch("%s takes %s; the family knows %s" % (FUNCTION, params, PARAMS))
        names = names_in_code(function.__code__, nested=False)
        if "clamp" in names and not {"isinf", "isnan", "any"} & names:
            raise NotNeeded("%s clamps without asking the device whether anything overflowed (as vLLM does above the window)"
                            % FUNCTION)
        missing = [name for name in ASKS if name not in names]
        if missing:
            raise TargetMismatch("%s does not use %s" % (FUNCTION, ", ".join(missing)))
        text = source_text(function, "%s: no source to read" % FUNCTION)
        if "if tensors.isinf().any() or tensors.isnan().any():" not in text:
            raise TargetMismatch("%s does not ask isinf().any() or isnan().any() before clamping" % FUNCTION)

    def build(self, module, context):
        import torch

        upstream = _function(module)

        def cast_overflow_tensors(tensors, offset=1000):
            current = vars(module).get(FUNCTION)
            if current is not cast_overflow_tensors:
                # a module that imported the function by name follows the target
                return current(tensors, offset)
            if not (isinstance(tensors, torch.Tensor) and tensors.is_floating_point()):
                context.count("upstream_calls")
                return upstream(tensors, offset)
            context.count("calls")
            clamp_value = torch.finfo(tensors.dtype).max - offset
            overflowed = tensors.isinf().any() | tensors.isnan().any()     # stays on the device
            return torch.where(overflowed, torch.clamp(tensors, min=-clamp_value, max=clamp_value), tensors)

        context.present(cast_overflow_tensors, upstream,
                        "the overflow flag kept on the device and applied with torch.where (no read)")
        return {FUNCTION: cast_overflow_tensors}


ASK_THEN_CLAMP = _AskThenClamp()

PATCH = Patch(
    name="vllm.cast_overflow_on_device",
    target=TARGET,
    replaces=(FUNCTION,),
    requires={"vllm": ""},
    outside_window={"vllm": "above the window vLLM clamps without asking (no read); releases below it were "
                            "not read for this patch"},
    needs_npu=True,
    families=(
        Family(__name__ + ":ASK_THEN_CLAMP", fence=">=0.13.0,<0.22.0",
               keeps="upstream's clamp to finfo.max - offset; the overflow test's ops (isinf, isnan, any)"),
    ),
    summary="cast_overflow_tensors (Qwen2.5-VL's tower in float16, i.e. on 310P; Whisper, MiniCPM-o) decides "
            "on the device with torch.where instead of reading isinf().any() and isnan().any() back: "
            "2 -> 0 reads per call",
    # 0: what this patch is for; a read is the defect back.
    selftest=Selftest("npu_shim.selftest.vllm_cast_overflow_on_device", host_syncs=0),
    defect=Defect("the float16 overflow clamp reads two flags back to the host",
                  shows="reads", fixed_at="vllm"),
)
