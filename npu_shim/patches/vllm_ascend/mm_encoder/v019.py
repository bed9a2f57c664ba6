"""Family v019: vllm-ascend 0.19.1rc1 .. 0.21.0rc1 (``DeviceOperator.npu_flash_attention``).

Upstream there: the 0.18.0 ``forward_oot`` (``sequence_lengths`` when the
tower passes them, else ``torch.diff(cu_seqlens).to("cpu")`` in every layer;
``scale_value = head_size ** -0.5``) with the op call moved to
``DeviceOperator.npu_flash_attention(query, key, value, seq_lens_cpu,
head_num, scale_value, num_kv_heads)``: ``_npu_flash_attention_unpad`` on
A2/A3 (per-segment host lengths), TND ``npu_fusion_attention`` on A5.

Replaced: ``forward_oot`` (see :mod:`.v018`), calling the same
``DeviceOperator`` that upstream's module holds, with the model's ``scale``
and, under GQA, the head count of the repeated K/V as ``num_kv_heads``
(upstream passes ``num_kv_heads``, which does not match them).
"""
from npu_shim.patches.vllm_ascend.mm_encoder import v018

UPSTREAM_OP = "npu_flash_attention"
OP_OWNER = "DeviceOperator"


def attend(upstream_globals, q, k, v, seq_lens, heads, scale):
    return upstream_globals[OP_OWNER].npu_flash_attention(
        query=q, key=k, value=v, seq_lens_cpu=seq_lens, head_num=heads, scale_value=scale,
        num_kv_heads=k.shape[1])


def check(cls, context):
    v018.check_family(cls, UPSTREAM_OP, OP_OWNER)


def build(cls, context):
    return v018.build_family(cls, attend, context)
