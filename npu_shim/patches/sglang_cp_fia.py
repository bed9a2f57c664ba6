"""sglang.cp_fia — context-parallel FIA attention on NPU for batch size > 1.

Why: ``AscendAttnBackend.do_cp_attn_fia`` splits Q with ``torch.chunk(q, 2)``
  and passes scalar CP lengths: correct for one sequence only (seed 002,
  sglang PR 26705).
How: not implemented yet (issue 4).
Upstream fix: sglang PR 26705 (0.5.13).
Remove when: the pinned sglang has per-sequence CP metadata in do_cp_attn_fia.
"""
from npu_shim.patch import Patch

PATCH = Patch(
    name="sglang.cp_fia",
    target="sglang.srt.hardware_backend.npu.attention.ascend_backend",
    replaces=("AscendAttnBackend.do_cp_attn_fia",),
    requires={"sglang": ">=0.5.11"},
    needs_npu=True,
    summary="split Q at total_q_prev_tokens, per-sequence lengths",
)
