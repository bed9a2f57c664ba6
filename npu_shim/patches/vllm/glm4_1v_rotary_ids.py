"""vllm.glm4_1v_rotary_ids — GLM-4.1V's tower copies its rotary position ids to the device non-blocking (vLLM 0.18 - 0.21).

Why: ``Glm4vVisionTransformer.rot_pos_emb`` builds the position ids of every frame on the host
  (``torch.arange`` of the host grid's sizes) and indexes the device cos/sin tables of vLLM's
  rotary embedding with them (``cos[pos_ids]``, ``sin[pos_ids]``): each index goes to the device
  first, a blocking host->device copy, 2 per tower forward (``glm4_1v.py:722,723`` in 0.18.0),
  before the first token of every image request. GLM-OCR's tower (0.19.0 on) inherits the method.
  Counted with vLLM's own towers (``npu_shim.testing.towers``, ``npu_shim.testing.census``),
  upstream and with ``vllm.glm4_1v_host_lengths`` / ``vllm.glm_ocr_host_lengths`` alike; on CUDA
  such an index is a synchronising copy too (benchmarks/results/cuda-syncs.txt, "host index into
  a device tensor").
How: the method becomes upstream's own, edited
  (:func:`npu_shim.patches._shared.source_edit.edit_function`) by the one statement upstream added
  later: ``pos_ids = pos_ids.to(cos.device, non_blocking=True)`` just before
  ``cos_combined = cos[pos_ids].flatten(1)``, so the ids reach the tables' device without blocking and
  that device copy is what the method returns as its third value (the tower hands it to its
  embeddings, which move it to the device anyway). Every other statement is upstream's, compiled at
  upstream's lines: the cos/sin output is ``torch.equal`` to upstream's. A grid that is not a host grid
  tensor (:func:`npu_shim.patches._shared.host_data.host_grid_tensor`) goes to upstream's method.
  ``check`` builds the edit: a method without that anchor statement, or with it more than once, is
  another shape (TargetMismatch naming the anchor).
Window: read in the wheels: 0.18.0, 0.18.1, 0.19.0, 0.19.1, 0.20.0, 0.20.2 and 0.21.0 (one body);
  run in the lanes vllm-0.18 (GLM-4.1V) and vllm-0.19, vllm-0.20, vllm-0.21 (GLM-4.1V
  and GLM-OCR). 0.22.1 .. 0.28.0 move the ids themselves, 0.29.0 on build them on the device:
  outside the window. Releases before 0.18.0 were not read for this patch.
Upstream fix: vLLM 0.22.1's ``rot_pos_emb`` (the same line); not backported to 0.18 - 0.21.
Remove when: the oldest supported vLLM is 0.22.
"""

from npu_shim.patch import Defect, Family, Patch, Selftest
from npu_shim.patches._shared.host_data import host_grid_tensor
from npu_shim.patches._shared.source_edit import InsertBefore, edit_function
from npu_shim.patches._shared.structure import Edited, edit_of, module_class, own_function, replace_own

TARGET = "vllm.model_executor.models.glm4_1v"
TOWER = "Glm4vVisionTransformer"
METHOD = "rot_pos_emb"

# The fix, as upstream later wrote it: the host ids go to the tables' device without blocking,
# just before they index the tables.
IDS_NON_BLOCKING = (
    InsertBefore("cos_combined = cos[pos_ids].flatten(1)", "pos_ids = pos_ids.to(cos.device, non_blocking=True)"),
)


class _RotaryIds:
    def check(self, module, context):
        original = own_function(module_class(module, TOWER), METHOD)
        return {TOWER + "." + METHOD: Edited(original, edit_function(original, IDS_NON_BLOCKING))}

    def build(self, module, context):
        return {TOWER + "." + METHOD: replace_own(module, TOWER, METHOD, self.make, context,
                                                  "the host position ids copied to the device "
                                                  "non-blocking before the indexing (no blocking copy)")}

    def make(self, module, original, context):
        edited = edit_of(context, TOWER + "." + METHOD)

        def rot_pos_emb(self, grid_thw):
            context.count("calls")
            if not host_grid_tensor(grid_thw):
                context.count("upstream_calls")
                return original(self, grid_thw)
            return edited(self, grid_thw)

        return rot_pos_emb


BLOCKING_INDEX = _RotaryIds()

PATCH = Patch(
    name="vllm.glm4_1v_rotary_ids",
    target=TARGET,
    replaces=(TOWER + "." + METHOD,),
    requires={"vllm": ""},
    outside_window={"vllm": "above the window vLLM moves the ids to the device itself (first with the line this "
                            "patch backports, later by building them there); releases below the window were not read for this patch"},
    needs_npu=True,
    families=(
        Family(__name__ + ":BLOCKING_INDEX",
               fence=">=0.18.0,<0.22.0",
               keeps="upstream's ids, get_cos_sin and indexing in upstream's order, with the later vLLM's "
                     "pos_ids.to(cos.device, non_blocking=True)"),
    ),
    summary="GLM-4.1V's (and GLM-OCR's) rot_pos_emb copies its host position ids to the device non-blocking "
            "before indexing the device cos/sin tables, as vLLM does above the window: 0 blocking host->device copies "
            "there (upstream: 2 per forward)",
    # 0 host synchronisations (reads and blocking copies) over a whole tower forward: a blocking
    # copy of the ids is the defect back.
    selftest=Selftest("npu_shim.selftest.vllm_mm_encoder_host_lengths:run_synchronisations", host_syncs=0,
                      arguments={"tower": "GLM-4.1V"}),
    defect=Defect("GLM-4.1V's tower copies its rotary position ids to the device blocking",
                  shows="reads", fixed_at="vllm"),
)
