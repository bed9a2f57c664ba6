"""vllm.ascend_qkv_v_head_size — vllm-ascend's QKV projection sizes its V slice with the layer's ``v_head_size``.

Why: at worker start vllm-ascend's ``register_ascend_customop()`` registers
  ``AscendQKVParallelLinear`` as vLLM's out-of-tree ``QKVParallelLinear``, and vLLM's
  ``PluggableLayer.__new__`` hands every model that asks for ``QKVParallelLinear`` that class.
  Its ``__init__`` takes ``v_head_size`` and stores it, but sizes the layer (``output_size``,
  ``output_sizes``) with ``head_size`` for V as for K. MiMo-V2-Flash's attention (K 192, V 128,
  ``v_head_size=self.v_head_dim``) then gets a projection ``kv_heads * (192 - 128)`` columns
  too wide per rank: vLLM's weight loader (inherited, it reads ``v_head_size``) writes V's 128
  rows per head where they belong and leaves the rest of the V slice uninitialised, and the
  model's ``qkv.split([q_size, k_size, v_size])`` raises ``RuntimeError`` at the first forward
  (the engine's profile run). A tiny layer (4 heads over 2 KV heads, hidden 64) gives a 1,536-wide
  qkv against split sizes [768, 384, 256] (tests/lanes/test_mimo_v2_qkv_ascend.py, built with
  upstream's ``register_ascend_customop`` in effect). A layer with ``v_head_size`` equal to
  ``head_size`` (every other model) is unaffected.
How: ``AscendQKVParallelLinear.__init__`` is upstream's, edited
  (:func:`npu_shim.patches._shared.source_edit.edit_function`): the V term of ``output_size``
  and the V entry of ``output_sizes`` take ``self.v_head_size`` (the value upstream's ``__init__``
  already stores, ``head_size`` when none is given), as vLLM's own ``QKVParallelLinear.__init__``
  sizes them. Nothing else changes: the weight loaders are vLLM's (they read ``v_head_size``),
  the forward and the parallel op are upstream's.
Window: read in the builds of 0.18.0, 0.19.1rc1, 0.20.2rc1, 0.22.1rc1 and 0.30.0rc2 and in
  vllm-ascend's release branches 0.20.2rc - 0.26.0rc and main of this writing (one text of the
  class's ``__init__``); 0.27.1rc1 - 0.29.0rc1 are admitted by the fence between them (the edit's
  anchors must match there, or the patch refuses). Tests run here on the vllm-0.18, vllm-0.19,
  vllm-0.20, latest-vllm (0.26.0rc1) and vllm-0.30 lanes; through the engine on vllm-0.18 and
  vllm-0.30. On 0.18 / 0.19 vLLM's MiMo model pads V to K's head dim after the split, but builds
  the projection with ``v_head_size=128`` all the same: upstream's too-wide qkv raises at the split
  there too, full-attention layers included (``vllm.LLM`` on vllm-0.18 with a full-attention MiMo,
  tests/lanes/test_engine_vllm_mimo.py). 0.15.0rc1 - 0.17.0rc1 have the same ``__init__`` (read in
  their wheels) but no test runs them here: not claimed. The fence is open-ended: a later release
  gets the family where the edit's anchors match (status: not read yet), and is refused by structure
  where they do not.
Upstream fix: none (vllm-ascend 0.30.0rc2).
Remove when: ``AscendQKVParallelLinear.__init__`` sizes V with ``v_head_size``.
"""
import inspect

from npu_shim.patch import Defect, Family, NotNeeded, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.source_edit import Replace, edit_function
from npu_shim.patches._shared.structure import Edited, edit_of, module_class, own_function

TARGET = "vllm_ascend.ops.linear"
CLASS = "AscendQKVParallelLinear"
INIT = CLASS + ".__init__"

EDITS = (
    Replace("output_size = (self.num_heads + 2 * self.num_kv_heads) * tp_size * self.head_size",
            "output_size = (self.num_heads + self.num_kv_heads) * tp_size * self.head_size"
            " + self.num_kv_heads * tp_size * self.v_head_size"),
    Replace("self.output_sizes = [self.num_heads * self.head_size * tp_size,"
            " self.num_kv_heads * self.head_size * tp_size, self.num_kv_heads * self.head_size * tp_size]",
            "self.output_sizes = [self.num_heads * self.head_size * tp_size,"
            " self.num_kv_heads * self.head_size * tp_size, self.num_kv_heads * self.v_head_size * tp_size]"),
)


class _VHeadSize:
    def check(self, module, context):
        init = own_function(module_class(module, CLASS), "__init__")
        if "v_head_size" not in inspect.signature(init).parameters:
            raise TargetMismatch("%s.__init__ takes no v_head_size" % CLASS)
        if "self.v_head_size * tp_size" in inspect.getsource(init):
            raise NotNeeded("%s.__init__ sizes V with v_head_size" % CLASS)
        return {INIT: Edited(init, edit_function(init, EDITS))}

    def build(self, module, context):
        return {INIT: context.present(edit_of(context, INIT), context.found[INIT].original,
                                      "the V slice (output_size, output_sizes) v_head_size wide")}


V_HEAD_SIZE = _VHeadSize()

PATCH = Patch(
    name="vllm.ascend_qkv_v_head_size",
    target=TARGET,
    replaces=(INIT,),
    requires={"vllm-ascend": ""},
    outside_window={"vllm-ascend": "below, the same class text in the older releases read (see Window) but no test runs it here"},
    families=(
        Family(__name__ + ":V_HEAD_SIZE", fence=">=0.18.0rc1",
               keeps="upstream's __init__, parallel op, forward and vLLM's weight loaders; only the V sizes change"),
    ),
    selftest=Selftest("npu_shim.selftest.vllm_ascend_qkv_v_head_size", host_syncs=0),
    defect=Defect("vllm-ascend's QKV projection sizes V's slice K-wide",
                  shows="raises", says="sized [768, 384, 384], not [768, 384, 256]"),
    summary="vllm-ascend's QKV projection is v_head_size wide for V (MiMo-V2-Flash: K 192 / V 128 built a "
            "too-wide qkv whose split raised at the first forward)",
)
