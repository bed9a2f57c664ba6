"""Selftest of ``transformers.attn_check``: the ``config.json`` route to ``ascend_fa``.

What the patch makes possible is a MoonViT whose config asks for
``attn_implementation="ascend_fa"``. ``run()`` builds vLLM's real
``MoonVitPretrainedModel`` from such a config (through transformers'
``PreTrainedModel.__init__`` and the patched check), runs one forward and
compares every layer's attention with the float64 reference, exactly like the
``vllm.moonvit_attn`` selftest. It also checks that the patch changed nothing
else: a transformers Llama asking for ``ascend_fa`` still gets transformers' own
ValueError, and ``sdpa``/``eager`` resolve as the wrapped original does.

Where ``vllm.moonvit_attn`` is not applied (switched off), nothing dispatches
``ascend_fa``, so the patch must keep rejecting it for MoonViT too: that is what
is checked then (error 0, nothing to compare numerically).
"""
import os

PATCH_NAME = "transformers.attn_check"
# The cases the patch's Selftest declares reads for (npu_shim.patches.transformers.attn_check).
CASE_FORWARD = "ascend_fa forward"
CASE_REJECTED = "vllm.moonvit_attn not applied"


def _outcome(function, *args):
    try:
        return ("returned", function(*args))
    except Exception as exc:
        return ("raised", type(exc).__name__, str(exc))


def _check_other_models_unchanged(modeling_utils):
    from transformers import LlamaConfig, LlamaModel

    from npu_shim.selftest import on_upstream

    if on_upstream(PATCH_NAME):
        return                  # upstream's own method in place: nothing to compare it with

    method = modeling_utils.PreTrainedModel.get_correct_attn_implementation
    original = getattr(method, "__wrapped__", None)
    ours = os.path.join("patches", "transformers", "attn_check.py")
    if original is None or not method.__code__.co_filename.endswith(ours):
        raise RuntimeError("%s reports applied but PreTrainedModel.get_correct_attn_implementation "
                           "is not the shim's wrapper" % PATCH_NAME)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    llama = LlamaModel(config)
    for name in (None, "sdpa", "eager", "ascend_fa"):
        mine, theirs = _outcome(method, llama, name, True), _outcome(original, llama, name, True)
        if mine != theirs:
            raise RuntimeError("LlamaModel asking for %r: the patch answers %r, transformers %r"
                               % (name, mine, theirs))
    if _outcome(method, llama, "ascend_fa", True)[0] != "raised":
        raise RuntimeError("LlamaModel was allowed attn_implementation='ascend_fa'")


def run(device=None):
    import time

    from npu_shim import status
    from npu_shim.selftest import applied_target
    from npu_shim.testing import moonvit as mv

    device = device or "cpu"
    modeling_utils = applied_target(PATCH_NAME)
    rows = {r["name"]: r for r in status()}
    started = time.perf_counter()
    _check_other_models_unchanged(modeling_utils)
    module = mv.moonvit_module()
    dtype = mv.selftest_dtype(device)

    if rows[mv.PATCH_NAME]["state"] != "applied":
        from npu_shim.testing import count_host_syncs

        # Counted, not assumed: the declared 0 for this case must be what happened.
        with count_host_syncs() as syncs:
            try:
                mv.build_tower(module, mv.TINY, dtype=dtype, device=device, attn_implementation="ascend_fa")
            except ValueError as exc:
                if "ascend_fa" not in str(exc):
                    raise
            else:
                raise RuntimeError("MoonViT accepted ascend_fa although %s is %s: nothing dispatches it"
                                   % (mv.PATCH_NAME, rows[mv.PATCH_NAME]["state"]))
        return {"max_abs_err": 0.0, "tolerance": 0.0, "host_syncs": syncs.count,
                "case": CASE_REJECTED, "seconds": time.perf_counter() - started,
                "detail": "%s is %s, so ascend_fa stays rejected (transformers' ValueError); other "
                          "names unchanged" % (mv.PATCH_NAME, rows[mv.PATCH_NAME]["state"])}

    # choice "auto": an explicit config request for ascend_fa is honoured.
    model = mv.build_tower(module, mv.SELFTEST, dtype=dtype, device=device, choice="auto",
                           attn_implementation="ascend_fa")
    if model.config._attn_implementation != "ascend_fa":
        raise RuntimeError("config asked for ascend_fa, transformers resolved %r"
                           % model.config._attn_implementation)
    max_err, tolerance, syncs, _ = mv.check_tower(model, mv.SELFTEST, dtype=dtype, device=device)
    return {
        "max_abs_err": max_err,
        "tolerance": tolerance,
        "host_syncs": syncs,
        "case": CASE_FORWARD,
        "seconds": time.perf_counter() - started,
        "detail": mv.describe(mv.SELFTEST, dtype) + ", built from a config asking for ascend_fa; "
                  "LlamaModel still rejected",
    }
