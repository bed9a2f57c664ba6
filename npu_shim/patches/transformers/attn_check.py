"""transformers.attn_check — accept the shim's ``ascend_fa`` attention name for MoonViT.

Why: vLLM's MoonViT (the Kimi-VL vision tower) is a transformers
  ``PreTrainedModel``; its ``__init__`` runs transformers'
  ``get_correct_attn_implementation``, which rejects every name outside
  ``"eager"`` + ``ALL_ATTENTION_FUNCTIONS``. A ``config.json`` asking for the
  shim's ``"ascend_fa"`` therefore dies with ``ValueError: Specified
  attn_implementation="ascend_fa" is not supported`` before vLLM's own
  dispatch table (where ``vllm.moonvit_attn`` registers the name) is ever
  consulted (seen with vllm 0.10.1.1 + transformers 4.56.0).
How: wrap ``PreTrainedModel.get_correct_attn_implementation``. A request for
  a name the shim provides returns that name unchanged, but only for a model
  class that can dispatch it: a subclass of vLLM's ``MoonVitPretrainedModel``
  whose module's ``VL_VISION_ATTENTION_FUNCTIONS`` holds the name right now
  (i.e. ``vllm.moonvit_attn`` is applied). Every other call — other names,
  other models, or MoonViT while the moonvit patch is off — goes to
  transformers untouched, so a Llama asking for ``ascend_fa`` still gets
  transformers' own ValueError and ``sdpa``/``eager``/flash behave as before.
  Nothing is registered in transformers' global ``ALL_ATTENTION_FUNCTIONS``
  (that would make every model accept the name and call a function with the
  wrong calling convention).
Window: the method exists from transformers 4.55.0 through 5.23.0 with the
  same ``(self, requested_attention, is_init_check=False)`` shape (4.55.0
  spells the first parameter ``_requested_attention``); open above: a later
  release whose method takes the requested name first gets the patch (status
  says it was not read yet), one without it is refused by structure. 4.54 does the name
  check inline in ``_check_and_adjust_attn_implementation`` and 4.53 in the
  classmethod ``_autoset_attn_implementation``; those transformers releases
  are reachable only with vllm 0.8.5–0.10.0, where ``vllm.moonvit_attn``
  selects ``ascend_fa`` on its own (``NPU_SHIM_MOONVIT_ATTN=auto``) without any
  config change, so the patch skips them rather than patching two more shapes.
  The patch is needed only while a shim-provided attention name can be
  requested at all, i.e. while ``vllm.moonvit_attn`` can apply: vllm
  >=0.8.5,<0.14 (0.14 moved MoonViT to ``MMEncoderAttention``) and torch_npu
  is importable (real, or the emulation). The guard says so (``requires`` on
  vllm, ``needs_npu`` although this wrapper calls no NPU op itself); with a
  newer or no vLLM, or no NPU, the patch is skipped with that reason.
Upstream fix: none (transformers has no hook for names served by another library).
Remove when: no supported vLLM dispatches MoonViT attention by name.
"""
from npu_shim.patch import Defect, Family, Patch, Selftest, TargetMismatch

METHOD = "get_correct_attn_implementation"

# name the shim provides -> model classes that can dispatch it:
# (module, class name, name of the module-level dispatch dict that must hold the name)
DISPATCHABLE = {
    "ascend_fa": (
        ("vllm.model_executor.models.moonvit", "MoonVitPretrainedModel", "VL_VISION_ATTENTION_FUNCTIONS"),
    ),
}

# Spellings of the first parameter across the window (keyword calls).
_REQUEST_PARAMS = ("requested_attention", "_requested_attention")


def can_dispatch(model_class, name) -> bool:
    """True when ``model_class`` inherits from a class that dispatches ``name`` in this process now."""
    import sys

    owners = DISPATCHABLE.get(name)
    if not owners or not isinstance(model_class, type):
        return False
    for klass in model_class.__mro__:
        for module_name, class_name, table_name in owners:
            if klass.__module__ != module_name or klass.__qualname__ != class_name:
                continue
            table = getattr(sys.modules.get(module_name), table_name, None)
            if isinstance(table, dict) and name in table:
                return True
    return False


def _requested_name(args, kwargs):
    if args:
        return args[0]
    for param in _REQUEST_PARAMS:
        if param in kwargs:
            return kwargs[param]
    return None


def check(module, context) -> None:
    import inspect

    method = module.PreTrainedModel.__dict__.get(METHOD)
    if not callable(method):
        raise TargetMismatch("PreTrainedModel.%s is not a plain method" % METHOD)
    params = list(inspect.signature(method).parameters)
    if len(params) < 2 or params[1] not in _REQUEST_PARAMS:
        raise TargetMismatch("PreTrainedModel.%s%s does not take the requested name first" % (METHOD, params))


def build(module, context):
    original = module.PreTrainedModel.__dict__[METHOD]

    def get_correct_attn_implementation(self, *args, **kwargs):
        context.count("calls")
        requested = _requested_name(args, kwargs)
        if isinstance(requested, str) and can_dispatch(type(self), requested):
            return requested
        context.count("upstream_calls")
        return original(self, *args, **kwargs)

    return {"PreTrainedModel.%s" % METHOD: context.present(
        get_correct_attn_implementation, original, "names another library dispatches accepted", wrapped=True)}


PATCH = Patch(
    name="transformers.attn_check",
    target="transformers.modeling_utils",
    replaces=("PreTrainedModel.%s" % METHOD,),
    requires={"transformers": ">=4.55", "vllm": ">=0.8.5,<0.14"},
    outside_window={
        "transformers": "the name check lives in other methods below the window",
        "vllm": "ascend_fa can be requested only where vllm.moonvit_attn applies",
    },
    needs_npu=True,   # needed only where vllm.moonvit_attn (an NPU patch) can serve the name
    families=(Family(__name__, id="allow-list",
               keeps="transformers' own get_correct_attn_implementation for every other name and model"),),
    summary="accept attn_implementation='ascend_fa' for vLLM's MoonViT while vllm.moonvit_attn serves it",
    # One: MoonViT's single read of cu_seqlens per forward, whatever the depth; none where
    # nothing dispatches ascend_fa and the selftest checks only that it stays rejected.
    selftest=Selftest("npu_shim.selftest.transformers_attn_check",
                      host_syncs={"ascend_fa forward": 1, "vllm.moonvit_attn not applied": 0}),
    defect=Defect("transformers refuses attn_implementation='ascend_fa' for MoonViT",
                  shows="raises", says="is not supported. The only possible arguments are"),
)
