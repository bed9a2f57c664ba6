"""vllm.sinks_refuse — vllm-ascend's attention refuses, at model build, a layer with learnable sinks it would drop.

Why: vLLM hands every attention impl a layer's learnable sinks as the keyword ``sinks``
  (MiMo-V2-Flash's sliding-window layers, gpt-oss). vllm-ascend 0.14.0rc1's
  ``AscendAttentionBackendImpl.__init__`` takes no ``sinks`` parameter: it lands in ``**kwargs``
  and is never read, and its op calls cannot take it (``torch_npu._npu_paged_attention`` and
  ``torch_npu.npu_fused_infer_attention_score`` have no sink argument in the torch_npu reference;
  ``learnable_sink`` is an argument of ``npu_fused_infer_attention_score_v2``, which that release
  does not call). So the sink logit of every such layer is silently dropped: the model serves,
  wrong. With vLLM 0.14.1 and MiMo-V2-Flash (V padded by the model), that is the only defect:
  the model builds and runs with the sinks ignored (reproduced on CPU with the wheels' classes,
  tests/lanes/test_mimo_v2_flash.py).
How: ``AscendAttentionBackendImpl.__init__`` is wrapped: a call with ``sinks`` that is not None
  raises ``NotImplementedError`` naming the layer's sizes, what would be dropped, and the way out
  (vllm-ascend 0.15.0rc1 or later passes the sinks as ``learnable_sink``); every other call is
  upstream's, unchanged. The check reads the structure: ``__init__`` takes ``**kwargs`` and names
  no ``sinks``, and the class's source never mentions sinks.
Window: read in the wheel 0.14.0rc1 (0.13.0 has the same shape but is not run here: not claimed).
Upstream fix: vllm-ascend 0.15.0rc1 (``sinks`` taken and passed as ``learnable_sink``).
Remove when: the pinned vllm-ascend is 0.15.0rc1 or later.
"""
import inspect

from npu_shim.patch import Defect, Family, NotNeeded, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.structure import module_class, own_function

TARGET = "vllm_ascend.attention.attention_v1"
IMPL = "AscendAttentionBackendImpl"
INIT = IMPL + ".__init__"


class _Refuse:
    def check(self, module, context):
        impl = module_class(module, IMPL)
        init = own_function(impl, "__init__")
        parameters = inspect.signature(init).parameters
        if "sinks" in parameters or "sinks" in inspect.getsource(impl):
            raise NotNeeded("%s takes the sinks" % IMPL)
        if not any(p.kind is inspect.Parameter.VAR_KEYWORD for p in parameters.values()):
            raise TargetMismatch("%s.__init__ takes no **kwargs (sinks would raise TypeError there)" % IMPL)
        return {INIT: init}

    def build(self, module, context):
        original = context.found[INIT]      # the __init__ check read (the engine hands it to build)
        version = _version()

        def __init__(self, *args, **kwargs):
            if kwargs.get("sinks") is not None:
                context.count("calls")
                bound = inspect.signature(original).bind_partial(self, *args, **kwargs).arguments
                raise NotImplementedError(
                    "npu-shim (vllm.sinks_refuse): vllm-ascend %s cannot serve this attention layer "
                    "(heads %s, head size %s, sliding window %s): it has learnable sinks, which this "
                    "vllm-ascend's attention takes into **kwargs and never passes to its ops "
                    "(torch_npu._npu_paged_attention / npu_fused_infer_attention_score take no sink), "
                    "so the model would run with the sinks dropped and give wrong outputs. Use "
                    "vllm-ascend %s or later, which passes them to the op as learnable_sink."
                    % (version, bound.get("num_heads"), bound.get("head_size"), bound.get("sliding_window"),
                       _window_end()))
            return original(self, *args, **kwargs)

        return {INIT: context.present(__init__, original, "refuses a layer with sinks (it would drop them)",
                                      wrapped=True)}


def _window_end():
    """The release where this patch's window ends (read from its declaration)."""
    return PATCH.window["vllm-ascend"][-1].rpartition("<")[2]


def _version():
    import importlib.metadata

    try:
        return importlib.metadata.version("vllm-ascend")
    except importlib.metadata.PackageNotFoundError:
        return "(unknown)"


REFUSE = _Refuse()

PATCH = Patch(
    name="vllm.sinks_refuse",
    target=TARGET,
    replaces=(INIT,),
    requires={"vllm-ascend": ""},
    outside_window={"vllm-ascend": "later releases take the sinks and pass them as learnable_sink; the release "
                                   "below has the same shape but is not run here"},
    families=(
        Family(__name__ + ":REFUSE", fence=">=0.14.0rc1,<0.15.0rc1",
               keeps="upstream's __init__ and op calls for every layer without sinks"),
    ),
    selftest=Selftest("npu_shim.selftest.vllm_sinks_refuse", host_syncs=0),
    defect=Defect("vllm-ascend's attention builds a layer with learnable sinks it would drop",
                  shows="raises", says="was not refused", fixed_at="vllm-ascend"),
    summary="a layer with learnable sinks is refused at model build on the vllm-ascend that drops them "
            "(MiMo-V2-Flash, gpt-oss), never served silently wrong",
)
