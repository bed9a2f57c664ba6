"""vllm.encoder_acl_graph_refs — the encoder ACL graph keeps its output buffer and FIA workspaces alive.

Why: vllm-ascend's ``EncoderAclGraphManager`` (``vllm_ascend/worker/encoder_acl_graph.py``, the
  opt-in ``cudagraph_mm_encoder`` path) keeps, after capture, the buffer each budget's graph writes
  its output into and the FIA workspaces the graphs' attention writes into only as weak tensors
  (``weak_ref_tensors``, which keep no owner): ``_capture_budget_graph`` stores
  ``output_buffer=weak_ref_tensors(...)`` and ``capture`` ends by turning every workspace into a
  weak tensor (``weak_ref_encoder_graph_workspaces()``, later ``weak_ref_workspaces()``). Nothing
  else owns that memory, so the NPU allocator reuses it while the graphs hold its addresses; replay
  then fails with 507011 (invalid address). Reported on hardware in vllm-ascend PR #16794
  (GLM-5.3-Flash, TP16, Ascend 910_93): with strong references capture and replay work and the ViT
  attention span drops from 119.9 ms to 12.29 ms. vLLM's own ``EncoderCudaGraphManager`` keeps
  ``output_buffer`` itself (a strong reference).
How: ``capture`` and ``_capture_budget_graph`` become upstream's own, edited
  (:func:`npu_shim.patches._shared.source_edit.edit_function`) at the weak-reference calls only:
  the workspace helper's call is deleted (the workspaces stay in upstream's
  ``EncoderGraphParams.workspaces``, owned), and the ``weak_ref_tensors(...)`` around the output is
  dropped, so ``BudgetGraphMetadata.output_buffer`` holds the tensor the graph writes. Everything
  else (the capture, the graph pool, the metadata, replay) is upstream's. One family per shape:
  0.22.1rc1 (helper ``weak_ref_encoder_graph_workspaces``; a buffer allocated before capture,
  copied into inside it), 0.23.0 .. 0.28.0rc1 (helper ``weak_ref_workspaces``; the same buffer),
  0.29.0rc1 .. 0.30.0rc2 (the graph's own output, weakly referenced twice). A missing anchor is
  another shape (TargetMismatch naming it); code with no weak reference left in either function is
  the fixed upstream (NotNeeded).
  The captured attention is upstream's: while the encoder graph is captured, ``vllm.mm_encoder_attn``
  hands the call to upstream's ``forward_oot``, whose capture functions (``_forward_capture_fia``,
  ``_run_vit_fia``) that patch edits at one expression in every family 0.22.1rc1 .. 0.30.0rc2:
  upstream repeats K/V to the query heads there too but hands FIA ``num_kv_heads`` (workspace query,
  captured op, the replay's rebinding), which for a tower with grouped vision heads does not match its
  K/V; the edit passes the repeated K/V's head count. Such a tower is capturable: EXAONE 4.5
  (``SupportsEncoderCudaGraph`` through its Qwen2.5-VL base; 16 heads over 8), in vLLM 0.22.1 and
  0.30.0 as read (its config needs a transformers that has ``exaone4_5``: 5.14.1 has, 5.5.4 not);
  tests/lanes/test_encoder_acl_graph_gqa.py captures it through this manager. On 0.22.1rc1 the
  captured call keeps upstream's ``head_size ** -0.5`` (``scale_value``) instead of the model's
  ``scale``: every tower vLLM 0.22.1 can capture (Qwen2-VL, Qwen2.5-VL, Qwen3-VL, Step3-VL, EXAONE
  4.5) passes ``head_dim ** -0.5``, so it is the same number there.
  Verified here (CPU, real wheels, emulated torch_npu, tests/lanes/test_encoder_acl_graph.py):
  the edited functions run upstream's capture for every budget; the metadata and the graph params
  hold the output buffer and the workspaces as owners; after capture nothing the replay writes into
  is released (:mod:`npu_shim.emulation.weak_ref`); upstream's unedited code releases both, and the
  emulated replay raises the 507011 error. Not verifiable here: the real graph capture and replay
  and the NPU allocator (the emulation has no ``torch.npu``; the test stands in a graph that
  captures nothing).
Upstream fix: vllm-ascend PR #16794 (merged 2026-09-17; not in a release read here, 0.30.0rc2 has
  the weak references).
Remove when: the installed vllm-ascend keeps strong references (the check then says NotNeeded).
"""
from npu_shim.patch import Defect, Family, NotNeeded, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.source_edit import Replace, ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import own_function

TARGET = "vllm_ascend.worker.encoder_acl_graph"
CLASS_NAME = "EncoderAclGraphManager"
CAPTURE = "capture"
CAPTURE_BUDGET = "_capture_budget_graph"
WEAK = "weak_ref_tensors"


class _StrongRefs:
    """The family of one shape: ``helper``, the call ``capture`` ends with; ``output_edits``, the
    edits of ``_capture_budget_graph`` that drop ``weak_ref_tensors`` around the output."""

    def __init__(self, helper, output_edits):
        self.helper, self.output_edits = helper, tuple(output_edits)

    def check(self, cls, context):
        capture, capture_budget = own_function(cls, CAPTURE), own_function(cls, CAPTURE_BUDGET)
        if WEAK not in capture_budget.__code__.co_names and self.helper not in capture.__code__.co_names:
            raise NotNeeded("%s keeps the output buffer and the workspaces (no weak reference left in %s or %s): "
                            "fixed upstream (vllm-ascend PR #16794)" % (CLASS_NAME, CAPTURE, CAPTURE_BUDGET))
        if self.helper not in capture.__globals__:
            raise TargetMismatch("%s has no module-level %s" % (capture.__module__, self.helper))
        return {CAPTURE: (capture, self.capture_edited(capture)),
                CAPTURE_BUDGET: (capture_budget, self.capture_budget_edited(capture_budget))}

    def capture_edited(self, capture):
        return edit_function(capture, (Replace("%s()" % self.helper, ""),))

    def capture_budget_edited(self, capture_budget):
        return edit_function(capture_budget, self.output_edits)

    def build(self, cls, context):
        found = context.found
        return {
            CAPTURE: context.present(found[CAPTURE][1], found[CAPTURE][0],
                                     "the FIA workspaces stay owned (no %s())" % self.helper),
            CAPTURE_BUDGET: context.present(found[CAPTURE_BUDGET][1], found[CAPTURE_BUDGET][0],
                                            "BudgetGraphMetadata.output_buffer owns the output (no %s)" % WEAK),
        }


# A buffer allocated before capture and copied into inside it, stored weakly.
_COPIED_BUFFER = (ReplaceExpression("weak_ref_tensors(output_buffer)", "output_buffer"),)

WEAK_ENCODER_GRAPH_WORKSPACES = _StrongRefs("weak_ref_encoder_graph_workspaces", _COPIED_BUFFER)
WEAK_WORKSPACES = _StrongRefs("weak_ref_workspaces", _COPIED_BUFFER)
# The graph's own output, weakly referenced where it is made and again where it is stored.
WEAK_GRAPH_OUTPUT = _StrongRefs("weak_ref_workspaces", (
    ReplaceExpression("weak_ref_tensors(self.model.encoder_cudagraph_forward(dict(values), path=path))",
                      "self.model.encoder_cudagraph_forward(dict(values), path=path)"),
    ReplaceExpression("weak_ref_tensors(output)", "output"),
))

KEEPS = "upstream's capture (NPUGraph, graph pool, FIA graph tasks) and replay; owning references only"

PATCH = Patch(
    name="vllm.encoder_acl_graph_refs",
    target=TARGET,
    subject=CLASS_NAME,
    replaces=(CLASS_NAME + "." + CAPTURE, CLASS_NAME + "." + CAPTURE_BUDGET),
    requires={"vllm-ascend": ""},
    outside_window={"vllm-ascend": "below the window vllm-ascend has no encoder ACL graph "
                                   "(vllm_ascend.worker.encoder_acl_graph)"},
    needs_npu=True,
    families=(
        Family(__name__ + ":WEAK_ENCODER_GRAPH_WORKSPACES", fence=">=0.22.0rc1,<0.23.0rc1", keeps=KEEPS),
        Family(__name__ + ":WEAK_WORKSPACES", fence=">=0.23.0rc1,<0.29.0rc1", keeps=KEEPS),
        Family(__name__ + ":WEAK_GRAPH_OUTPUT", fence=">=0.29.0rc1", keeps=KEEPS),
    ),
    summary="encoder ACL graph: the output buffer and the FIA workspaces stay owned after capture (upstream "
            "holds them weakly; replay fails with 507011 on the device, vllm-ascend #16794). The captured "
            "attention call is upstream's, with vllm.mm_encoder_attn's head-count edit (grouped vision heads, "
            "vLLM's exaone4_5 tower); family weak-encoder-graph-workspaces' release keeps head_size ** -0.5, not the model's "
            "scale, there (equal for every tower that vLLM release can capture)",
    # Capture and replay of a toy encoder read nothing back; what replay writes into must be owned.
    selftest=Selftest("npu_shim.selftest.vllm_encoder_acl_graph_refs", host_syncs=0),
    defect=Defect("the encoder ACL graph leaves its output buffer and FIA workspaces to weak tensors",
                  shows="raises", says="DeviceMemoryError: emulated ACL error 507011"),
)
