"""Upstream's reported silent op failures, emulated on request (``NPU_SHIM_EMULATE_DEFECTS``).

The emulated ops compute what the torch_npu documentation says. Upstream has reported calls
of the very ops the shim keeps that return wrong numbers with no error on some stacks; a
check that is to catch them on a user's box (``npu-shim selftest``) must be seen to fail on
them. ``NPU_SHIM_EMULATE_DEFECTS=name,...`` (default none; read on every call, like
``NPU_SHIM_EMULATE_SOC``) makes the emulated op behave as the report says, for the calls the
report names and no other. Each defect is applied at the op's entry or exit (the op's own
argument checks run first, so a call the op refuses is still refused):

``fia-tnd-uniform`` -- vllm-ascend issue #13699 (open, triaged): ``AscendMMEncoderAttention``'s
  ``npu_fused_infer_attention_score`` call with ``input_layout="TND"``, ``sparse_mode=0`` and no
  ``atten_mask`` (non-paged) returns a uniform average of V ("softmax is effectively not
  applied"), error ~3.1 against an fp32 reference where fp16 gives ~3e-3, for single- and
  multi-sequence (several images packed) inputs; reported on torch_npu 2.10 (910B4-1).
  vllm-ascend 0.30.0rc2 makes the same call. Emulated: each query row of a segment gets the
  plain mean of its segment's V rows (its query head's KV head), every segment of the packed
  call. The paged and the ``sparse_mode=3`` calls (the LLM paths) are left alone, as reported.
  What to try: ``NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1`` (family 0.18.0's
  ``npu_fusion_attention`` call for the encoder).

``fia-mask-512`` -- vllm-ascend issue #15503 (open): ``npu_fused_infer_attention_score`` with
  ``sparse_mode=0`` and a bool ``atten_mask`` of shape ``[1, 1, 1, S]`` (paged decode: one query
  token, BSH, ``block_table``) is right up to KV length 512 and wrong from 513 (1.1e-2 at 513,
  0.17 at 600, 0.25 at 4095), with no error; 512 does not move with ``block_size`` (16-256) or
  the capacity (2048 / 4096). ``pse_shift`` ``[1, N, 1, S]`` is right everywhere (the
  reporter's workaround); a rank-2 ``[1, S]`` mask is refused (561002). Emulated: key positions
  from 512 on are left out of the softmax whatever the mask says there. Why that reading of
  "ignores the mask past 512": the reported error grows with the valid length L, from 1e-2 at
  513 (one real key past 512) to 0.25 at 4095; were the masked slots past 512 let in instead,
  the error would be largest just past 512 and vanish towards the capacity. What to try: give
  the valid length as ``actual_seq_lengths_kv`` (or ``pse_shift`` ``[1, N, 1, S]``) instead of
  the under-ranked mask.

Not emulated: sglang issue #38196 / PR #39905 (``torch_npu._npu_flash_attention_qlens`` prefill
wrong at page sizes 16, 32, 64 on 910C / A3, CANN 9.0): the emulated qlens op
(``prefix_attention``) refuses those block sizes as newer op-plugin documents the op to
("blockSize必须设为128"), so there is no wrong result to emulate; ``sglang.small_page_fia`` routes
those page sizes to FIA and cites it.

Only the emulation reads this; the production path never imports it.
"""
import os

ENV = "NPU_SHIM_EMULATE_DEFECTS"
FIA = "npu_fused_infer_attention_score"
MASK_LIMIT = 512    # vllm-ascend #15503: the last KV length still right


class Defect:
    """One reported defect: the op it is in, the report, and what to try."""

    __slots__ = ("name", "op", "issue", "call", "reported", "try_instead", "triggers", "apply")

    def __init__(self, name, op, issue, call, reported, try_instead, triggers, apply):
        self.name, self.op, self.issue, self.call = name, op, issue, call
        self.reported, self.try_instead = reported, try_instead
        self.triggers, self.apply = triggers, apply


def _tnd_uniform_triggers(a):
    return (a["input_layout"] == "TND" and a["sparse_mode"] == 0 and a["atten_mask"] is None
            and a["block_table"] is None)


def _tnd_uniform_apply(impl, a):
    """The op's own result, then every query row replaced by the plain mean of its segment's V."""
    from npu_shim.emulation import _common as C

    out, lse = impl(**a)
    query, value = a["query"], a["value"]
    n = C.as_int(FIA, "num_heads", a["num_heads"])
    nkv = C.as_int(FIA, "num_key_value_heads", a["num_key_value_heads"]) or n
    q_cum = C.host_ints(a["actual_seq_lengths"], FIA, "actual_seq_lengths")
    kv_cum = C.host_ints(a["actual_seq_lengths_kv"], FIA, "actual_seq_lengths_kv")
    q0 = k0 = 0
    for q1, k1 in zip(q_cum, kv_cum):
        if q1 > q0:
            if k1 > k0:
                mean = value[k0:k1].float().mean(dim=0)                     # (Nkv, Dv)
                out[q0:q1] = mean.repeat_interleave(n // nkv, dim=0).to(out.dtype)
            else:
                out[q0:q1] = 0
        q0, k0 = q1, k1
    return out, lse


def _mask_512_triggers(a):
    import torch

    mask = a["atten_mask"]
    return (a["sparse_mode"] == 0 and isinstance(mask, torch.Tensor) and mask.dtype == torch.bool
            and mask.dim() == 4 and tuple(mask.shape[:3]) == (1, 1, 1) and mask.shape[3] > MASK_LIMIT)


def _mask_512_apply(impl, a):
    mask = a["atten_mask"].clone()
    mask[..., MASK_LIMIT:] = True       # keys from 512 on drop out, whatever the mask says
    return impl(**dict(a, atten_mask=mask))


DEFECTS = {
    "fia-tnd-uniform": Defect(
        "fia-tnd-uniform", FIA, "vllm-ascend #13699",
        "input_layout='TND', sparse_mode=0, atten_mask=None, no block_table",
        "returns the plain average of V (error ~3.1 against fp32), single and several images packed",
        "NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1 (npu_fusion_attention TND, vllm-ascend 0.18.0's call)",
        _tnd_uniform_triggers, _tnd_uniform_apply),
    "fia-mask-512": Defect(
        "fia-mask-512", FIA, "vllm-ascend #15503",
        "sparse_mode=0, bool atten_mask [1, 1, 1, S], KV length > %d" % MASK_LIMIT,
        "the mask is not honoured past KV position %d (wrong from length %d, up to 0.25)"
        % (MASK_LIMIT, MASK_LIMIT + 1),
        "the valid KV length as actual_seq_lengths_kv (or pse_shift [1, N, 1, S]) instead of the "
        "[1, 1, 1, S] mask", _mask_512_triggers, _mask_512_apply),
}


def active(environ=None):
    """The defects ``NPU_SHIM_EMULATE_DEFECTS`` names, in its order; ValueError for a name that
    is not one of :data:`DEFECTS`."""
    environ = os.environ if environ is None else environ
    names = [part.strip() for part in (environ.get(ENV) or "").split(",") if part.strip()]
    unknown = [name for name in names if name not in DEFECTS]
    if unknown:
        raise ValueError("%s=%r names %s, not an emulated defect; use a comma list of %s"
                         % (ENV, environ.get(ENV), ", ".join(map(repr, unknown)), ", ".join(DEFECTS)))
    return [DEFECTS[name] for name in names]


def call(op, impl, args, kwargs):
    """``impl(*args, **kwargs)``, as the first active defect of ``op`` that the call triggers
    makes it behave (the op itself when none)."""
    defects = [d for d in active() if d.op == op]
    if not defects:
        return impl(*args, **kwargs)
    import inspect

    bound = inspect.signature(impl).bind(*args, **kwargs)
    bound.apply_defaults()
    arguments = dict(bound.arguments)
    for defect in defects:
        if defect.triggers(arguments):
            return defect.apply(impl, arguments)
    return impl(*args, **kwargs)
