"""sglang.vision_head_pad — sglang's vision attention on Ascend with head dims between 64 and 128: q, k and v padded to 128 for FIA's TND call, the output sliced back.

Why: from 0.5.14 ``VisionAscendAttention.forward`` calls
  ``torch_npu.npu_fused_infer_attention_score`` with ``input_layout="TND"`` and the
  model's head dim as it is (0.5.14 - 0.5.23, read in every wheel). CANN's FIA takes
  TND head dims 64, 128 and 192 only (or 192 for query/key with 128 for value): its
  message, quoted in vllm-ascend PR #9632, "When layout is TND, queryD(..), keyD(..)
  and valueD(..) must be same equal 192/128/64, or queryD and keyD equal 192 and
  valueD equal 128". FlagOS sglang-plugin-FL (``patches/vision.py``) reports the
  head-72 tower of Qwen3.6-VL failing before its first image response on sglang
  0.5.18 with CANN 8.5, and pads 72 to 128; vllm-ascend pads every 64 < D < 128 to
  128 before the same op (``ops/mm_encoder_attention.py``, ``MIN_PAD_SIZE`` /
  ``MAX_PAD_SIZE``). sglang PR #25768 (the switch to FIA) passed MMMU with
  Qwen3-VL-30B-A3B, whose tower has head dim 72, on a CANN its thread does not name:
  the rule depends on the CANN release, and no evidence names a release without it
  from 8.3 on. Before CANN 8.3 TND took query/key head dim 192 only (vllm-ascend
  issue #8045), where padding to 128 does not help. The emulation follows these
  rules by the emulated release (``NPU_SHIM_EMULATE_CANN``), so upstream's unpadded
  call fails in the tests where the hardware fails.
How: the forward is wrapped. A call that reaches the FIA call (not upstream's SDPA
  fallback for an additive ``attention_mask``, 0.5.17+; not NPU-graph mode, whose
  output buffer has the model's head dim) with one head dim D for q, k and v,
  64 < D < 128, on a CANN whose TND takes 64/128/192, gets q, k and v zero-padded to
  128 on the last axis, the forward below run with ``softmax_scale`` the model's (the
  one passed, else D ** -0.5: upstream's default would take 128 ** -0.5 from the
  padded q), and the first D columns of its output back, contiguous. Zero key columns
  add nothing to q.k and zero value columns give zero output columns, which are
  dropped: the result is the unpadded attention's. The forward below keeps its op,
  layout and arguments; it is upstream's, or the replacement of
  ``sglang.vision_device_lengths`` (0.5.14 - 0.5.15) or ``sglang.vision_host_lengths``
  (0.5.16+), which keep upstream's FIA call: the pad stands outside both. Every other
  call (D = 64 or 128 included) goes to it untouched.
  NPU-graph mode is decided as upstream's graph runner decides it: an ``output_ws`` buffer
  passed (not None). sglang's ``VisionAttention.forward`` hands ``output_ws=`` to every
  backend call, None outside graph mode (read in 0.5.14 and 0.5.23): the key's presence says nothing,
  and eager serving (the towers' own forward) is padded.
  The CANN release is read once, at the first call that would be padded, never at
  start-up: ``torch_npu.npu.utils.get_cann_version("CANN")`` (``torch_npu.utils`` in
  newer releases; "" below CANN 8.1.RC1), else the ``version=`` line of
  ``<ASCEND_TOOLKIT_HOME or ASCEND_HOME_PATH>/<arch>-linux/ascend_toolkit_install.info``.
  Status names what was read and what it decided. An unreadable release pads (the
  padded call is valid on every release from 8.3 and exact).
  ``NPU_SHIM_SGLANG_VISION_HEAD_PAD=0`` turns the patch off.
Upstream fix: none up to 0.5.23.
Remove when: sglang pads the head dim for FIA itself, or the CANN in use takes these
  head dims in TND.

Not covered: NPU-graph mode (``SGLANG_VIT_ENABLE_CUDA_GRAPH``, whose runner passes an
``output_ws`` buffer of the model's head dim): the captured call keeps upstream's head dim
(FIA refuses it where it refuses the eager call), and status says so once it is seen.
"""
import inspect
import os
import platform

from npu_shim.patch import Defect, Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.code import names_in_code
from npu_shim.patches._shared.structure import own_function, upstream_of

TARGET = "sglang.srt.layers.attention.vision"
FORWARD = "VisionAscendAttention.forward"
FIA = "npu_fused_infer_attention_score"
PARAMETERS = ("self", "q", "k", "v", "cu_seqlens", "bsz", "seq_len", "softmax_scale")
# TND head dims: 64 < D < 128 is padded to 128 (CANN's set is 64, 128, 192)
SMALLEST, PADDED = 64, 128
TND_WIDE_SINCE = (8, 3)      # CANN release from which TND takes 64/128/192 (before: 192 only)
VERSION_GETTERS = ("torch_npu.npu.utils", "torch_npu.utils")
TOOLKIT_HOMES = ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH")
TOOLKIT_INFO = "ascend_toolkit_install.info"


def toolkit_version(environ=os.environ):
    """(version, file) from the CANN toolkit's install info, or ("", what was looked at)."""
    looked = []
    for variable in TOOLKIT_HOMES:
        home = environ.get(variable, "").strip()
        if not home:
            continue
        path = os.path.join(home, "%s-linux" % platform.machine(), TOOLKIT_INFO)
        looked.append("$%s/%s-linux/%s" % (variable, platform.machine(), TOOLKIT_INFO))
        try:
            with open(path, encoding="utf-8", errors="replace") as info:
                for line in info:
                    key, _, value = line.partition("=")
                    if key.strip() == "version" and value.strip():
                        return value.strip(), looked[-1]
        except OSError:
            continue
    return "", " or ".join(looked) or "no %s" % " / ".join(TOOLKIT_HOMES)


def installed_cann():
    """(version text, where it was read): torch_npu's documented getter, else the toolkit's info."""
    import importlib

    for module_name in VERSION_GETTERS:
        try:
            module = importlib.import_module(module_name)
        except ImportError:
            continue
        getter = getattr(module, "get_cann_version", None)
        if not callable(getter):
            continue
        try:
            version = str(getter("CANN") or "").strip()
        except Exception as exc:      # a broken install: say so, read the toolkit instead
            version = ""
            module_name = "%s (raised %s)" % (module_name, type(exc).__name__)
        if version:
            return version, "%s.get_cann_version('CANN')" % module_name
        break
    return toolkit_version()


def cann_decision(version, where):
    """(pad?, the sentence status shows) for the CANN ``version`` read from ``where``."""
    from npu_shim.emulation.soc import parse_cann

    release = parse_cann(version)
    since = "%d.%d" % TND_WIDE_SINCE
    if release is None:
        return True, ("CANN release not readable (%r from %s): 64 < D < 128 padded to %d (valid on every "
                      "release from %s, exact)" % (version, where, PADDED, since))
    if release < TND_WIDE_SINCE:
        return False, ("CANN %s (from %s): TND takes query/key head dim 192 only before %s, so padding to %d "
                       "does not make the call valid; upstream's call as is" % (version, where, since, PADDED))
    return True, ("CANN %s (from %s): TND takes head dims 64/128/192; 64 < D < 128 padded to %d"
                  % (version, where, PADDED))


class _Cann:
    """The decision for this application of the patch, read at its first padded call."""

    def __init__(self):
        self.pad = None

    def decide(self, context):
        if self.pad is None:
            pad, sentence = cann_decision(*installed_cann())
            context.note("cann", sentence)
            self.pad = pad
        return self.pad


class _FiaTnd:
    """``VisionAscendAttention.forward`` calling FIA with layout TND.

    ``fallback``  the forward takes ``attention_mask`` and hands a mask to SDPA (0.5.17+)
    """

    def __init__(self, fallback):
        self.fallback = fallback

    def check(self, module, context):
        cls = getattr(module, "VisionAscendAttention", None)
        if not isinstance(cls, type):
            raise TargetMismatch("%s has no class VisionAscendAttention" % TARGET)
        current = own_function(cls, "forward")
        upstream = upstream_of(current)
        params = tuple(inspect.signature(upstream).parameters)
        if params[:len(PARAMETERS)] != PARAMETERS:
            raise TargetMismatch("VisionAscendAttention.forward takes %s, not %s first"
                                 % (", ".join(params), ", ".join(PARAMETERS)))
        if ("attention_mask" in params) != self.fallback:
            raise TargetMismatch("VisionAscendAttention.forward %s attention_mask"
                                 % ("lacks" if self.fallback else "takes"))
        names = names_in_code(upstream.__code__)
        if FIA not in names or "_npu_flash_attention_unpad" in names or "TND" not in upstream.__code__.co_consts:
            raise TargetMismatch("VisionAscendAttention.forward does not call %s with input_layout TND alone" % FIA)
        if self.fallback and "sdpa_fallback" not in names:
            raise TargetMismatch("VisionAscendAttention.forward takes attention_mask but has no sdpa_fallback")
        return {FORWARD: current}

    def build(self, module, context):
        inner = context.found[FORWARD]      # the forward check read (the engine hands it to build)
        forward = make_forward(inner, self.fallback, context)
        return {FORWARD: context.present(forward, inner,
                                         "64 < D < 128 padded to 128 for the FIA TND call, sliced back")}


def make_forward(inner, fallback, context):
    cann = _Cann()
    signature = inspect.signature(inner)      # upstream's (a replacement below presents it)

    def passed(name, args, kwargs):
        """What the caller passed as upstream's ``name``: a parameter (by position or keyword), or a key of
        its ``**kwargs``; None where it was not passed."""
        bound = signature.bind_partial(*args, **kwargs).arguments
        if name in bound:
            return bound[name]
        extra = [value for key, value in bound.items()
                 if signature.parameters[key].kind is inspect.Parameter.VAR_KEYWORD]
        return extra[0].get(name) if extra else None

    # upstream's parameters after softmax_scale (forward_metadata, attention_mask where it takes them) pass through
    # *args / **kwargs as they came
    def forward(self, q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=None, *args, **kwargs):
        context.count("calls")
        d = q.shape[-1]
        everything = (self, q, k, v, cu_seqlens, bsz, seq_len, softmax_scale) + args
        if (SMALLEST < d < PADDED and k.shape[-1] == d and v.shape[-1] == d
                and not (fallback and passed("attention_mask", everything, kwargs) is not None)):
            if passed("output_ws", everything, kwargs) is not None:
                context.note("graph", "NPU-graph mode (an output_ws buffer): the captured call keeps head "
                                      "dim %d, not padded" % d)
            elif cann.decide(context):
                import torch.nn.functional as F

                scale = softmax_scale if softmax_scale is not None else d ** -0.5
                q, k, v = (F.pad(t, (0, PADDED - d)) for t in (q, k, v))
                out = inner(self, q, k, v, cu_seqlens, bsz, seq_len, scale, *args, **kwargs)
                return out[..., :d].contiguous()
        context.count("upstream_calls")
        return inner(self, q, k, v, cu_seqlens, bsz, seq_len, softmax_scale, *args, **kwargs)

    return forward


NO_FALLBACK = _FiaTnd(fallback=False)
SDPA_FALLBACK = _FiaTnd(fallback=True)

KEEPS = ("torch_npu.npu_fused_infer_attention_score, input_layout TND, upstream's arguments, on q/k/v "
         "padded to head dim 128 (the model's softmax scale)")

PATCH = Patch(
    name="sglang.vision_head_pad",
    target=TARGET,
    replaces=(FORWARD,),
    requires={"sglang": ""},
    outside_window={"sglang": "below the window VisionAscendAttention calls _npu_flash_attention_unpad, "
                              "not FIA's TND layout"},
    needs_npu=True,
    families=(
        Family(__name__ + ":NO_FALLBACK", fence=">=0.5.14,<0.5.17", keeps=KEEPS),
        Family(__name__ + ":SDPA_FALLBACK", fence=">=0.5.17", keeps=KEEPS),
    ),
    summary="VisionAscendAttention with 64 < head dim < 128: q/k/v padded to 128 for FIA's TND call and the "
            "output sliced back (CANN's TND takes 64/128/192), decided by the installed CANN release",
    selftest=Selftest("npu_shim.selftest.sglang_vision_head_pad", host_syncs=0),
    defect=Defect("sglang's vision attention hands FIA's TND call head dims between 64 and 128, which it rejects",
                  shows="raises", says="When layout is TND, queryD(72)"),
)
