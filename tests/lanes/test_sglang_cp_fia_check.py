"""The structural check of ``sglang.cp_fia`` on synthetic shapes (lane base: no sglang).

The real releases are covered by the sglang lanes (test_sglang_cp_fia_windows.py,
test_sglang_cp_fia.py). Here the decision table is exercised on small functions
and dataclasses written to have each shape, including the ones no release has:
a half-updated method, metadata with only some of the lists, a decorated method,
comments that mention the old code. The method shapes are written after the
upstream ones (0.5.12, 0.5.13, 0.5.23) but reduced to the names the check reads.
"""
import dataclasses
import functools
import sys
import types
from typing import List

import pytest

from npu_shim.patch import FamilyContext, NotNeeded, TargetMismatch
from npu_shim.patches.sglang import cp_fia as patch

CONTEXT = FamilyContext(patch.PATCH.name)

pytestmark = pytest.mark.patch("sglang.cp_fia")   # lane base: no sglang


# Method shapes. Bodies are never run: the check reads their code objects only.
def single_sequence(self, q, k_cache, v_cache, layer, forward_batch):
    cp_meta = forward_batch.attn_cp_metadata
    q_prev, q_next = torch.chunk(q, 2, dim=0)  # noqa: F821
    k = k_cache.view(-1, self.page_size, layer.tp_k_head_num * layer.qk_head_dim)
    v = v_cache.view(-1, self.page_size, layer.tp_v_head_num * layer.v_head_dim)
    return [torch.ops.npu.npu_fused_infer_attention_score(  # noqa: F821
        qh, k, v, block_table=self.forward_metadata.block_tables, atten_mask=self.fia_mask,
        num_heads=layer.tp_q_head_num, scale=layer.scaling, actual_seq_lengths=[ql], actual_seq_lengths_kv=[kl])
        for qh, ql, kl in ((q_prev, cp_meta.actual_seq_q_prev, cp_meta.kv_len_prev),
                           (q_next, cp_meta.actual_seq_q_next, cp_meta.kv_len_next))]


def fixed(self, q, k_cache, v_cache, layer, forward_batch):
    """Mentions torch.chunk(q, 2) and cp_meta.kv_len_prev in prose only."""
    cp_meta = forward_batch.attn_cp_metadata
    # torch.chunk(q, 2) was only correct for bs == 1; cp_meta.actual_seq_q_prev is gone.
    split = cp_meta.total_q_prev_tokens
    return (q[:split], q[split:], np.cumsum(cp_meta.actual_seq_q_prev_list).tolist(),  # noqa: F821
            cp_meta.kv_len_prev_list, np.cumsum(cp_meta.actual_seq_q_next_list).tolist(),  # noqa: F821
            cp_meta.kv_len_next_list, self.page_size, self.fia_mask)


def strategy(self, q, k_cache, v_cache, layer, forward_batch):
    def _fia_cp_attn(q_chunk, cu_seqlens_q_cp, cache_seqlens_cp, max_seqlen_q_cp):
        return torch_npu.npu_fused_infer_attention_score(  # noqa: F821
            q_chunk, block_table=self.forward_metadata.block_tables,
            actual_seq_lengths=cu_seqlens_q_cp[1:].tolist())

    return get_cp_strategy().run_attention(q, forward_batch, self.device, _fia_cp_attn)  # noqa: F821


def half_updated(self, q, k_cache, v_cache, layer, forward_batch):
    cp_meta = forward_batch.attn_cp_metadata
    q_prev, q_next = torch.chunk(q, 2)  # noqa: F821
    return cp_meta.actual_seq_q_prev_list, cp_meta.kv_len_prev, q_prev, q_next


def single_sequence_without_fia(self, q, k_cache, v_cache, layer, forward_batch):
    cp_meta = forward_batch.attn_cp_metadata
    q_prev, q_next = torch.chunk(q, 2)  # noqa: F821
    return (cp_meta.actual_seq_q_prev, cp_meta.actual_seq_q_next, cp_meta.kv_len_prev,
            cp_meta.kv_len_next, some_other_attention(q_prev, q_next))  # noqa: F821


# Metadata shapes.
@dataclasses.dataclass
class ScalarMetadata:
    split_list: List[int] = None
    kv_len_prev: int = -1
    kv_len_next: int = -1
    actual_seq_q_prev: int = -1
    actual_seq_q_next: int = -1


@dataclasses.dataclass
class ListMetadata:
    split_list: List[int] = None
    total_q_prev_tokens: int = 0
    kv_len_prev_list: List[int] = None
    kv_len_next_list: List[int] = None
    actual_seq_q_prev_list: List[int] = None
    actual_seq_q_next_list: List[int] = None


@dataclasses.dataclass
class PartialMetadata:
    total_q_prev_tokens: int = 0
    kv_len_prev_list: List[int] = None


def target_with(method, metadata, monkeypatch):
    """A stand-in target module and metadata module with these shapes."""
    backend = type("AscendAttnBackend", (), {"do_cp_attn_fia": method})
    target = types.ModuleType("fake_ascend_backend")
    target.AscendAttnBackend = backend
    meta_module = types.ModuleType("fake_cp_utils")
    meta_module.ContextParallelMetadata = metadata
    monkeypatch.setitem(sys.modules, "fake_cp_utils", meta_module)
    monkeypatch.setattr(patch, "METADATA_MODULES", ("not_a_module_xyz", "fake_cp_utils"))
    return target


def test_method_shapes():
    assert patch.method_shape(patch.code_names(single_sequence)) == "single-sequence"
    assert patch.method_shape(patch.code_names(fixed)) == "fixed"
    assert patch.method_shape(patch.code_names(strategy)) == "strategy"


def test_nested_code_is_read():
    names = patch.code_names(strategy)
    assert {"npu_fused_infer_attention_score", "block_tables", "run_attention"} <= names


def test_prose_does_not_count():
    names = patch.code_names(fixed)
    assert "chunk" not in names and "kv_len_prev" not in names and "actual_seq_q_prev" not in names


def test_decorated_method_is_unwrapped():
    @functools.wraps(single_sequence)
    def wrapper(*args, **kwargs):
        return single_sequence(*args, **kwargs)

    assert patch.method_shape(patch.code_names(wrapper)) == "single-sequence"


@pytest.mark.parametrize("method", [half_updated, single_sequence_without_fia])
def test_unknown_shapes_mismatch(method):
    with pytest.raises(TargetMismatch):
        patch.method_shape(patch.code_names(method))


def test_not_a_function_mismatches():
    with pytest.raises(TargetMismatch, match="not a Python function"):
        patch.code_names(len)


def test_broken_window_applies(monkeypatch):
    assert patch.check(target_with(single_sequence, ListMetadata, monkeypatch), CONTEXT) is None


@pytest.mark.parametrize("method, metadata, reason", [
    (single_sequence, ScalarMetadata, patch.SINGLE_SEQUENCE_ONLY),
    (fixed, ListMetadata, patch.FIXED_UPSTREAM),
    (strategy, ListMetadata, patch.STRATEGY_REWRITE),
    (strategy, ScalarMetadata, patch.STRATEGY_REWRITE),
])
def test_releases_skip_with_their_reason(monkeypatch, method, metadata, reason):
    with pytest.raises(NotNeeded) as raised:
        patch.check(target_with(method, metadata, monkeypatch), CONTEXT)
    assert str(raised.value) == reason


def test_partial_metadata_mismatches(monkeypatch):
    with pytest.raises(TargetMismatch, match="neither the scalar CP lengths nor all of"):
        patch.check(target_with(single_sequence, PartialMetadata, monkeypatch), CONTEXT)


def test_missing_metadata_mismatches(monkeypatch):
    target = target_with(single_sequence, ListMetadata, monkeypatch)
    monkeypatch.setattr(patch, "METADATA_MODULES", ("not_a_module_xyz",))
    with pytest.raises(TargetMismatch, match="no ContextParallelMetadata"):
        patch.check(target, CONTEXT)


def test_inherited_method_mismatches(monkeypatch):
    target = target_with(single_sequence, ListMetadata, monkeypatch)
    target.AscendAttnBackend = type("AscendAttnBackend", (target.AscendAttnBackend,), {})
    with pytest.raises(TargetMismatch, match="does not define"):
        patch.check(target, CONTEXT)


def test_declaration():
    assert patch.PATCH.name == "sglang.cp_fia"
    assert patch.PATCH.target == "sglang.srt.hardware_backend.npu.attention.ascend_backend"
    assert patch.PATCH.replaces == ("AscendAttnBackend.do_cp_attn_fia",)
    assert patch.PATCH.needs_npu and patch.PATCH.implemented
    doc = patch.__doc__
    for heading in ("Why:", "How:", "Upstream fix:", "Remove when:"):
        assert heading in doc


def test_patch_module_imports_no_torch(run_python, make_env):
    proc = run_python("import sys, npu_shim.patches.sglang.cp_fia as p; "
                      "print(sorted(m for m in ('torch', 'numpy', 'sglang') if m in sys.modules))",
                      env=make_env())
    assert proc.stdout.strip() == "[]"
