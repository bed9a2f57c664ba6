"""vllm.ascend_kv_split_exact — vllm-ascend splits a layer's KV-cache bytes into K and V exactly when their head dims differ.

Why: vllm-ascend's model runner allocates each attention layer's KV cache as raw bytes and splits
  them into a K and a V tensor by the ratio of their head dims: ``calc_split_factor([k_dim,
  v_dim])`` returns ``[total / k_dim, total / v_dim]`` as floats, and the runner takes
  ``int(size // factor)`` bytes for each (``model_runner_v1._allocate_kv_cache_tensors``;
  ``v2/attn_utils``). For K 192 / V 128 (MiMo-V2-Flash) ``320 / 192`` rounds up in binary, so
  ``size // 1.6666666666666667`` falls one byte short of ``size * 192 / 320`` at every block count
  (2457600 bytes: 1474559 + 983040 = 2457599), and the runner's own
  ``assert sum_page_size_bytes % page_size_bytes == 0`` fails: KV-cache set-up raises for any
  layer whose K and V head dims do not divide their sum exactly. Plain float arithmetic, so it
  happens on the device as on CPU; K == V (factor 2.0) and DeepSeek's MLA dims (512 / 64) are
  exact and never meet it. Found by running the runner's own allocation on the wheels
  (tests/lanes/test_mimo_v2_runner_kv_cache.py).
How: ``calc_split_factor`` is upstream's, edited
  (:func:`npu_shim.patches._shared.source_edit.edit_function`): ``total / num`` becomes
  ``Fraction(total, num)`` (:class:`fractions.Fraction`), so ``size // factor`` is the exact floor
  of ``size * num / total``: K and V take exactly their share, whatever the dims. Every caller
  divides an integer byte count by the factor and takes ``int`` of it, which a Fraction gives
  exactly; a float factor's callers get the same values wherever the float was exact.
Window: read in the builds of 0.20.2rc1 to 0.30.0rc2 (one body of ``calc_split_factor``), where a
  layer with V != K first reaches the runner (``vllm.ascend_attention_v_head_dim``). The fence is
  open-ended: a later release gets the family where the edit's anchor matches (status: not read
  yet), and is refused by structure where it does not; the vLLM window is the MiMo patches'.
Upstream fix: none (vllm-ascend 0.30.0rc2).
Remove when: ``calc_split_factor`` (or its callers) split the bytes exactly.
"""
from npu_shim.patch import Defect, Family, Patch, Selftest
from npu_shim.patches._shared.source_edit import ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import Edited, edit_of
from npu_shim.patches.vllm_ascend.attention_v_head_dim import MIMO_VLLM

TARGET = "vllm_ascend.utils"
FUNCTION = "calc_split_factor"
EDITS = (ReplaceExpression("total / num", "Fraction(total, num)"),)


def _function(module):
    import inspect

    from npu_shim.patch import TargetMismatch

    function = getattr(module, FUNCTION, None)
    if not inspect.isfunction(function):
        raise TargetMismatch("%s has no function %s" % (module.__name__, FUNCTION))
    return function


class _ExactSplit:
    def check(self, module, context):
        from fractions import Fraction

        function = _function(module)
        return {FUNCTION: Edited(function, edit_function(function, EDITS, names={"Fraction": Fraction}))}

    def build(self, module, context):
        return {FUNCTION: context.present(edit_of(context, FUNCTION), context.found[FUNCTION].original,
                                          "exact ratios (fractions.Fraction), not floats")}


EXACT_SPLIT = _ExactSplit()

PATCH = Patch(
    name="vllm.ascend_kv_split_exact",
    target=TARGET,
    replaces=(FUNCTION,),
    requires={"vllm-ascend": "", "vllm": MIMO_VLLM},
    outside_window={"vllm-ascend": "below, no layer with V != K reaches the runner's split (vLLM's model pads V "
                                   "itself)",
                    "vllm": "the window is the MiMo patches' (vllm.mimo_v2_flash_v_head_dim, "
                            "vllm.mimo_v2_v_head_dim), where a layer with V != K reaches the runner"},
    families=(
        Family(__name__ + ":EXACT_SPLIT", fence=">=0.20.0rc1",
               keeps="upstream's split of each layer's bytes by head-dim ratio, the ratio exact"),
    ),
    selftest=Selftest("npu_shim.selftest.vllm_ascend_kv_split_exact", host_syncs=0),
    defect=Defect("vllm-ascend's K/V split of a layer's KV-cache bytes off when their head dims differ",
                  shows="error"),
    summary="vllm-ascend's runner splits a layer's KV-cache bytes into K and V exactly when their head dims differ "
            "(K 192 / V 128: float ratios fell one byte short and KV-cache set-up asserted)",
)
