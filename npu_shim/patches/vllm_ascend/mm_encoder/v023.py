"""Family v023: vllm-ascend 0.23.0rc1 .. 0.26.0rc1 and every later source of that shape.

Upstream there (see :mod:`.fia` for what the fused-infer families share): the
eager path ignores ``sequence_lengths`` (vLLM 0.23+ no longer computes them for
the Ascend class: the class dropped ``maybe_compute_seq_lens`` and vLLM's own
returns None off FlashInfer) and converts ``cu_seqlens`` with
``_maybe_compute_cu_seqlens`` (``cu_seqlens.cpu()``: a device->host copy in
every layer, 27 per 27-layer forward, for every model) and the module's
``maybe_compute_actual_seq_lengths`` (``.tolist()``). The scale is the model's
(``self.scale``). 0.26.0rc1 hands K/V over with ``.contiguous()``.

Replaced: ``forward_oot`` (and the capture functions, :mod:`.fia`).
``cu_seqlens`` read at most once per encoder forward, then upstream's own ``maybe_compute_actual_seq_lengths`` on that host
tensor (same lists, KV lengths scaled as upstream does when K/V have a
different token count); uniform lengths built on the host where the model
passes none, as upstream; ``.contiguous()`` K/V where the installed
``_run_vit_fia`` does it; the K/V head count that matches the repeated K/V.
Read in the wheels 0.23.0rc1, 0.23.0, 0.24.0rc1, 0.25.1rc1, 0.26.0rc1 and on
upstream's main branch (no fence above: a later release of this shape is served,
one of another shape is refused by the structural check).
"""
import torch

from npu_shim.patch import TargetMismatch
from npu_shim.patches.vllm_ascend.mm_encoder import fia

LENGTHS_FUNCTION = "maybe_compute_actual_seq_lengths"
CU_METHOD = "_maybe_compute_cu_seqlens"


def host_lengths(layer, upstream_globals, query, tokens_q, tokens_kv, cu_seqlens, sequence_lengths, context):
    # sequence_lengths is ignored, as upstream does (see the module docstring).
    if cu_seqlens is None:
        lengths = fia.uniform_lengths(query)
        if tokens_kv == tokens_q:
            return lengths, lengths
        host = torch.tensor([0] + lengths, dtype=torch.int32)   # upstream's helper scales the KV list
    else:
        host = fia.host_tensor(layer, cu_seqlens, context)
    return upstream_globals[LENGTHS_FUNCTION](host, tokens_q, tokens_kv, cudagraph_mm_encoder=False)


def check(cls, context):
    found = fia.check_family(cls, eager_uses=(LENGTHS_FUNCTION, CU_METHOD), fia_uses=("scale",),
                             fia_avoids=("scale_value",))
    if LENGTHS_FUNCTION not in vars(cls)["forward_oot"].__globals__:
        raise TargetMismatch("%s has no module-level %s" % (cls.__module__, LENGTHS_FUNCTION))
    return found


def build(cls, context):
    return fia.build_forward(cls, host_lengths, context)
