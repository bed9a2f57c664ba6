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
How: the method is replaced by upstream's body with the one line vLLM 0.22.1 added to it: the ids
  are moved to the tables' device with ``pos_ids.to(cos.device, non_blocking=True)`` before the
  same indexing, and that device copy is what the method returns as its third value (as in 0.22.1;
  the tower hands it to its embeddings, which move it to the device anyway). Every other op is
  upstream's, in upstream's order: the cos/sin output is ``torch.equal`` to upstream's. A grid not
  on the host goes to upstream's method. ``check`` accepts only the body the replacement was
  written from (source parsed, docstring and comments left out, hashed).
Window: read in the wheels: 0.18.0, 0.18.1, 0.19.0, 0.19.1, 0.20.0, 0.20.2 and 0.21.0 (one body,
  digest below); run in the lanes vllm-0.18 (GLM-4.1V) and vllm-0.19, vllm-0.20, vllm-0.21 (GLM-4.1V
  and GLM-OCR). 0.22.1 .. 0.28.0 move the ids themselves, 0.29.0 on build them on the device:
  outside the window. Releases before 0.18.0 were not read for this patch.
Upstream fix: vLLM 0.22.1's ``rot_pos_emb`` (the same line); not backported to 0.18 - 0.21.
Remove when: the oldest supported vLLM is 0.22.
"""

from npu_shim.patch import Family, Patch, Selftest
from npu_shim.patches._shared.host_data import host_grid_tensor
from npu_shim.patches._shared.structure import expect_body, module_class, own_function, replace_own

TARGET = "vllm.model_executor.models.glm4_1v"
TOWER = "Glm4vVisionTransformer"
METHOD = "rot_pos_emb"

# body_digest of the upstream body the replacement was written from
ROT_POS_EMB = {"73f9c2ff5981"}        # every release read (docs/reference.md)


class _RotaryIds:
    def check(self, module, context):
        expect_body(own_function(module_class(module, TOWER), METHOD), ROT_POS_EMB,
                    "the %s replacement" % context.patch)

    def build(self, module, context):
        return {TOWER + "." + METHOD: replace_own(module, TOWER, METHOD, self.make, context,
                                                  "the host position ids copied to the device "
                                                  "non-blocking, as vLLM does above the window (no blocking copy)")}

    def make(self, module, original, context):
        import torch

        def rot_pos_emb(self, grid_thw):
            context.count("calls")
            if not host_grid_tensor(grid_thw):
                context.count("upstream_calls")
                return original(self, grid_thw)
            merge = self.spatial_merge_size
            pos_ids = []
            for t, h, w in grid_thw:
                hpos_ids = torch.arange(h).unsqueeze(1).expand(-1, w)
                wpos_ids = torch.arange(w).unsqueeze(0).expand(h, -1)
                hpos_ids = hpos_ids.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten()
                wpos_ids = wpos_ids.reshape(h // merge, merge, w // merge, merge).permute(0, 2, 1, 3).flatten()
                pos_ids.append(torch.stack([hpos_ids, wpos_ids], dim=-1).repeat(t, 1))
            pos_ids = torch.cat(pos_ids, dim=0)
            max_grid_size = grid_thw[:, 1:].max()
            cos, sin = self.rotary_pos_emb.get_cos_sin(max_grid_size)
            # vLLM's line above the window: the index goes over without blocking
            pos_ids = pos_ids.to(cos.device, non_blocking=True)
            cos_combined = cos[pos_ids].flatten(1)
            sin_combined = sin[pos_ids].flatten(1)
            return cos_combined, sin_combined, pos_ids

        return rot_pos_emb


BLOCKING_INDEX = _RotaryIds()

PATCH = Patch(
    name="vllm.glm4_1v_rotary_ids",
    target=TARGET,
    replaces=(TOWER + "." + METHOD,),
    requires={"vllm": ">=0.18.0,<0.22.0"},
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
)
