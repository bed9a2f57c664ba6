"""Family v022: vllm-ascend 0.22.1rc1 (fused-infer attention, ``head_size ** -0.5``).

Upstream there (see :mod:`.fia` for what the fused-infer families share):
``_maybe_compute_actual_seq_lengths`` takes the host ``sequence_lengths`` when
the tower passes them (vLLM 0.22's Qwen-VL towers compute them once per forward
with the class's ``maybe_compute_seq_lens``), else ``cu_seqlens``, copying
either to the host (``.to("cpu")`` + ``.tolist()``) in every layer where it
lives on the device: 27 copies per 27-layer MoonViT forward. ``_run_vit_fia``
passes ``scale=self.scale_value``, which ``__init__`` sets to
``head_size ** -0.5`` whatever ``scale`` the model gave.

Replaced: ``forward_oot`` (and the capture functions, :mod:`.fia`). The same
lengths rule (``sequence_lengths`` cumulated, else ``cu_seqlens[1:]``, else uniform lengths built on the host) with
the tensor read at most once per encoder forward; the model's ``scale``
(``self.scale``); the K/V head count that matches the repeated K/V.
"""
import torch

from npu_shim.patch import TargetMismatch
from npu_shim.patches.vllm_ascend.mm_encoder import fia

SEQ_LENS_HOOK = "maybe_compute_seq_lens"
LENGTHS_METHOD = "_maybe_compute_actual_seq_lengths"


def host_lengths(layer, upstream_globals, query, tokens_q, tokens_kv, cu_seqlens, sequence_lengths, context):
    if sequence_lengths is not None:
        lengths = fia.host_tensor(layer, sequence_lengths, context).cumsum(0).to(torch.int64).tolist()
    elif cu_seqlens is not None:
        lengths = fia.host_tensor(layer, cu_seqlens, context)[1:].to(torch.int64).tolist()
    else:
        lengths = fia.uniform_lengths(query)
    return lengths, lengths


def check(cls, context):
    found = fia.check_family(cls, eager_uses=(LENGTHS_METHOD,), fia_uses=("scale_value",))
    for name in (SEQ_LENS_HOOK, LENGTHS_METHOD):
        if name not in vars(cls):
            raise TargetMismatch("%s has no %s (this family's shape has)" % (cls.__name__, name))
    return found


def build(cls, context):
    return fia.build_forward(cls, host_lengths, context)
