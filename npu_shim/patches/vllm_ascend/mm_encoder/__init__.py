"""Release families of the MMEncoderAttention patches (``vllm.mm_encoder_attn`` on
``AscendMMEncoderAttention``, ``vllm.mm_encoder_attn_310p`` on
``AscendMMEncoderAttention310``), one module per vllm-ascend release family,
plus what they share (:mod:`.common`, :mod:`.fia`).

A family module defines ``check(cls)`` and ``build(cls)`` for the patched class
(the patch's ``subject``); the declarations in
:mod:`npu_shim.patches.vllm_ascend.mm_encoder_attn` and ``..._310p`` name the
module, its releases, its fence and the upstream op call it keeps
(:class:`npu_shim.patch.Family`). ``check(cls, context)`` raises
:class:`~npu_shim.patch.TargetMismatch` unless the class has the shape the
family was written for (signatures, names the methods use; never versions: the
fence does that). ``build(cls, context)`` returns ``{attribute name: replacement}``
(e.g. ``{"forward_oot": f}``), presented with ``context.present`` (upstream's
signature), counting with ``context.count``, with the shared per-forward host
lengths and lazy layer state of :mod:`.common`. Adding a family = one module + one ``Family`` in the declaration.

This package is imported only once a target module has been: the family
modules import torch.
"""
