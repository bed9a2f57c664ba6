"""Family v014_310p: ``AscendMMEncoderAttention310`` of vllm-ascend 0.14.0rc1.

Upstream there: a subclass of 0.14.0rc1's ``AscendMMEncoderAttention`` (the
class ``vllm.mm_encoder_attn`` patches), registered as ``"MMEncoderAttention"``
when ``is_310p()``. Its ``forward_oot(query, key, value, cu_seqlens=None,
max_seqlen=None, **kwargs)`` repeats K/V to the query heads (the base's
``reshape_qkv_to_3d``), builds a uniform ``cu_seqlens`` on ``query.device``
when none is given, copies ``torch.diff(cu_seqlens).to("cpu", dtype=torch.int32)``
in every layer, does not pad the head dim, and calls
``torch_npu._npu_flash_attention_unpad(query, key, value, seq_len,
scale_value=head_size ** -0.5, num_heads, num_kv_heads, out)`` whatever
``scale`` the model gave; the output is (B, S, N, D) for 3-D and 4-D inputs
alike. (0.15.0rc1 .. 0.17.0rc1 have no 310P class.)

Replaced: ``forward_oot`` only, with upstream's op call and layout (no
padding, int32 ``seq_len``, (B, S, N, D) output), the lengths read from the
device at most once per encoder forward (a uniform ``cu_seqlens`` is built on
the host: no copy), the model's ``scale`` and, under GQA, the head count of
the repeated K/V. The layer's state is kept apart from the one
``vllm.mm_encoder_attn`` may keep on the same layer (its base class).
"""
import inspect

import torch

from npu_shim.patch import TargetMismatch
from npu_shim.patches._shared.code import names_in_code
from npu_shim.patches._shared.host_data import is_host
from npu_shim.patches.vllm_ascend.mm_encoder import common as C
from npu_shim.patches.vllm_ascend.mm_encoder import v018_310p as F

FORWARD_PARAMS = ("self", "query", "key", "value", "cu_seqlens", "max_seqlen", "kwargs")
SEQ_LEN_DTYPE = torch.int32        # upstream: .to("cpu", dtype=torch.int32)


def check(cls, context):
    if F.ASCEND_MAIN_CLASS not in [base.__name__ for base in cls.__mro__[1:]]:
        raise TargetMismatch("%s no longer derives from vllm-ascend's %s (this family's shape does)"
                             % (cls.__name__, F.ASCEND_MAIN_CLASS))
    forward = C.own_function(cls, "forward_oot")
    C.check_params(forward, FORWARD_PARAMS, ((),), cls.__name__ + ".forward_oot")
    if inspect.signature(forward).parameters["kwargs"].kind is not inspect.Parameter.VAR_KEYWORD:
        raise TargetMismatch("%s.forward_oot no longer takes **kwargs" % cls.__name__)
    names = names_in_code(forward.__code__, nested=False)
    if "torch_npu" not in forward.__globals__ or F.UNPAD not in names or "diff" not in names:
        raise TargetMismatch("%s.forward_oot no longer calls torch_npu.%s with torch.diff(cu_seqlens)"
                             % (cls.__name__, F.UNPAD))


def build(cls, context):
    original_forward = vars(cls)["forward_oot"]
    upstream_globals = original_forward.__globals__
    make_state = F.state_maker(pads=False)

    def forward_oot(self, query, key, value, cu_seqlens=None, max_seqlen=None, **kwargs):
        context.count("calls")
        state = C.layer_state(self, make_state, F.STATE_ATTR)
        if cu_seqlens is None and not is_host(query):
            context.count("upstream_host_copies")   # upstream builds it on query.device
        seq_len = F.host_seq_len(self, query, cu_seqlens, context).to(SEQ_LEN_DTYPE)
        out = F.attend(self, state, upstream_globals["torch_npu"], query, key, value, seq_len)
        bsz, q_len = query.shape[:2]
        return out.view(bsz, q_len, self.num_heads, self.head_size)

    return {"forward_oot": context.present(forward_oot, original_forward)}
