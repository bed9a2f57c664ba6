"""vllm.mm_merge_310p — on 310P, image embeddings are merged with integer positions, not a boolean mask.

Why: vLLM's ``_merge_multimodal_embeddings`` (``vllm/model_executor/models/utils.py``),
  which writes every multimodal embedding into the text embeddings, assigns through
  a boolean mask (``inputs_embeds[is_multimodal] = ...``) in the releases of the
  family below. On an Ascend NPU that assignment runs the aicpu IndexPut kernel,
  which is defective on 310P: every image request kills the engine with aicpu error
  507018, the stack often pointing at a later, unrelated op (vllm-ascend #12086, open:
  ``v0.23.0rc1-310p`` image, CANN 9.1.0-beta.1, torch_npu 2.10.0.post2, Qwen3-VL-2B/4B
  and Qwen2.5-VL-3B; again #13050 on 0.23.0 with vLLM 0.25.0, and #4419). PR #12914's
  table, measured on 310P one subprocess per case: mask on the NPU fails, mask on the
  CPU fails, ``index_copy_`` with integer indices works. The crash was verified on
  310P hardware upstream (#12086, PR #12914, PR #11435), not here: this project has
  no NPU; its tests reproduce the failure with the emulation's model of the kernel
  (:mod:`npu_shim.emulation.index_put`).
How: the function is replaced by one that, on a 310P (the SoC torch_npu reports, read
  per call; A2/A3 and every process without torch_npu get upstream's function itself,
  counted as ``upstream_calls``), does what PR #12914 verified on the hardware:
  integer positions from the mask (``torch.nonzero``; on the host when the mask is on
  the host, as vLLM's model runner builds it (``device="cpu"``) in every release of
  the family, so no device->host read; a device mask costs the one read upstream's
  assignment also makes), moved to the embeddings' device, and ``index_copy_`` of the embeddings cast
  to the input dtype. The embeddings broadcast to the positions as upstream's
  assignment broadcasts them; a count mismatch raises upstream's ``ValueError`` with
  upstream's message (the placeholder count is the number of positions: no read).
  A mask that is not a 1-D boolean of the embeddings' length goes to upstream's
  function. Output is ``torch.equal`` to upstream's wherever upstream runs. vLLM's model
  modules import the function by name (``from .utils import _merge_multimodal_embeddings``),
  so they hold the replacement itself: it defers to whatever the target module holds now,
  and those modules follow ``npu_shim.uninstall()`` and a later ``install()`` too.
Window: read in the wheels: 0.13.0, 0.14.1, 0.18.0 and 0.19.1 merge with
  ``masked_scatter_`` (vLLM #22105; no IndexPut, and no 310P failure of it reported):
  outside the window, and the check says "not needed" on that shape. 0.20.2 and
  later assign through the mask again (vLLM #34246); the family's releases below
  were read and run in their lanes.
Upstream fix: none released; vllm-ascend PR #12914 and PR #11435 (both open) patch
  the same function for 310P only.
Remove when: every supported vllm-ascend release patches the merge for 310P itself,
  or torch_npu's IndexPut works on 310P.
"""
from npu_shim.patch import Defect, Family, Patch, Selftest

NAME = "vllm.mm_merge_310p"
TARGET = "vllm.model_executor.models.utils"
FUNCTION = "_merge_multimodal_embeddings"

PATCH = Patch(
    name=NAME,
    target=TARGET,
    replaces=(FUNCTION,),
    requires={"vllm": ""},
    outside_window={"vllm": "below the window vLLM merges with masked_scatter_ (vLLM #22105), not the "
                            "boolean-mask assignment whose 310P IndexPut kernel fails"},
    needs_npu=True,
    selftest=Selftest("npu_shim.selftest.vllm_mm_merge_310p", host_syncs={"310P": 0, "A2/A3": 0}),
    defect=Defect("vLLM merges image embeddings with a boolean-mask assignment, which 310P's aicpu IndexPut fails",
                  shows="raises",
                  says="ValueError: Error during index put operation",
                  on="310P"),
    families=(
        Family("npu_shim.patches.vllm.mm_merge_310p.families:BOOLEAN_MASK_ASSIGNMENT", fence=">=0.20.0",
               keeps="upstream's function on every device class but 310P; on 310P "
                     "torch.nonzero + index_copy_ (vllm-ascend PR #12914)"),
    ),
    summary="310P only: multimodal embeddings merged with torch.nonzero + index_copy_ instead of the "
            "boolean-mask assignment whose aicpu IndexPut kernel fails (error 507018)",
)
