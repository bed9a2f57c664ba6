"""transformers.attn_check — accept the shim's ``ascend_fa`` attention name.

Why: vLLM's MoonViT (Kimi-VL vision tower) is a transformers ``PreTrainedModel``;
  its ``__init__`` runs transformers' ``get_correct_attn_implementation``,
  which rejects any name it does not know: ``attn_implementation="ascend_fa"``
  raises ``ValueError: Specified attn_implementation="ascend_fa" is not
  supported`` (seed 000, vllm 0.10.1.1 + transformers 4.56.0).
How: not implemented yet (issue 5).
Upstream fix: none.
Remove when: no supported vLLM dispatches MoonViT attention by name.
"""
from npu_shim.patch import Patch

PATCH = Patch(
    name="transformers.attn_check",
    target="transformers.modeling_utils",
    replaces=("PreTrainedModel.get_correct_attn_implementation",),
    requires={"transformers": ">=4.55"},
    summary="accept attn_implementation='ascend_fa' for MoonViT",
)
