"""The structural decisions of ``sglang.small_page_fia`` and ``sglang.cp_fia_host_lengths``
on synthetic code (lane base: no sglang).

The real releases are covered by the sglang lanes (test_sglang_small_page_fia.py,
test_sglang_cp_fia_host_lengths.py). Here: which family a ``forward_extend`` of
each gate set gets (the gates are written after the upstream ones, bodies
reduced), that a missing gate or a changed signature is a mismatch, and how the
0.5.23 closure maps the strategy's tensors to the metadata's host lists.
"""
import re
import types

import pytest

from npu_shim import evidence
from npu_shim.patch import TargetMismatch
from npu_shim.patches.sglang import cp_fia_host_lengths as host_lengths
from npu_shim.patches.sglang import small_page_fia as small_page


# forward_extend shapes: only the ``if`` tests, the op names and the signature are read.
def release_0_5_13(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, k_rope=None,
                   topk_indices=None, sinks=None, slopes=None):
    if is_mla_preprocess_enabled() and self.use_mla:  # noqa: F821
        pass
    if self.is_dllm_model:
        pass
    if topk_indices is not None:
        pass
    if (forward_batch.forward_mode.is_target_verify() or forward_batch.forward_mode.is_draft_extend()
            or forward_batch.forward_mode.is_draft_extend_v2()):
        pass
    if not self.use_mla:
        if sinks is not None or (self.is_hybrid_swa and layer.sliding_window_size != -1):
            pass
        if is_cp_mode:  # noqa: F821
            pass
        if self.use_fia:
            torch_npu.npu_fused_infer_attention_score()  # noqa: F821
        else:
            if layer.is_cross_attention or layer.attn_type == AttentionType.ENCODER_ONLY:  # noqa: F821
                pass
            if (layer.qk_head_dim <= 128 and causal and forward_batch.encoder_lens is None  # noqa: F821
                    and layer.logit_cap == 0 and not getattr(self, "use_native_sdpa", False)):
                if not self.use_alibi:
                    torch_npu._npu_flash_attention_qlens()  # noqa: F821


def without_alibi_gate(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None,
                       k_rope=None, topk_indices=None, sinks=None):
    if self.use_fia:
        torch_npu.npu_fused_infer_attention_score()  # noqa: F821
    else:
        torch_npu._npu_flash_attention_qlens()  # noqa: F821


def renamed_parameters(self, query, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None,
                       k_rope=None, topk_indices=None, sinks=None):
    torch_npu.npu_fused_infer_attention_score()  # noqa: F821
    torch_npu._npu_flash_attention_qlens()  # noqa: F821


def target_with(forward_extend):
    backend = type("AscendAttnBackend", (), {"forward_extend": forward_extend})
    return types.SimpleNamespace(AscendAttnBackend=backend, __name__="fake_ascend_backend")


def _read_in(implementation):
    """The release the family implemented at ``implementation`` was read in (its evidence)."""
    family = next(f for f in small_page.PATCH.families if f.implementation.endswith(implementation))
    return evidence.read(small_page.PATCH.name, family.name)[0]


@pytest.mark.patch("sglang.small_page_fia")
def test_a_release_with_0_5_13s_gates_gets_its_family():
    from npu_shim.engine import guards

    family, implementation, _ = guards.select_family(small_page.PATCH, target_with(release_0_5_13),
                                                     {"sglang": _read_in(":HYBRID_SWA")})
    assert family.implementation.endswith(":HYBRID_SWA") and implementation is small_page.HYBRID_SWA
    # Chosen by structure alone (a development build of the next family's release): the gates
    # pick the same family.
    family, implementation, _ = guards.select_family(small_page.PATCH, target_with(release_0_5_13),
                                                     {"sglang": _read_in(":SWA_FIA") + ".dev3"})
    assert implementation is small_page.HYBRID_SWA


@pytest.mark.patch("sglang.small_page_fia")
def test_a_family_whose_fence_holds_but_gates_differ_is_refused_with_every_reason():
    from npu_shim.engine import guards

    hybrid_swa, swa_fia = (f.name for f in small_page.PATCH.families if f.implementation.endswith((":HYBRID_SWA", ":SWA_FIA")))
    release = _read_in(":HYBRID_SWA")
    with pytest.raises(TargetMismatch, match="%s .*not this family's.*%s: sglang %s outside"
                                             % (hybrid_swa, swa_fia, re.escape(release))):
        guards.select_family(small_page.PATCH, target_with(without_alibi_gate), {"sglang": release})


@pytest.mark.patch("sglang.small_page_fia")
@pytest.mark.parametrize("release", [evidence.read(small_page.PATCH.name, f.name)[0] for f in small_page.PATCH.families])
@pytest.mark.parametrize("method, message", [
    (without_alibi_gate, "not this family's"),
    (renamed_parameters, "takes self, query"),
])
def test_unknown_shapes_are_mismatches(method, message, release):
    from npu_shim.engine import guards

    with pytest.raises(TargetMismatch, match=message):
        guards.select_family(small_page.PATCH, target_with(method), {"sglang": release})


@pytest.mark.patch("sglang.small_page_fia")
def test_families_are_exclusive_on_every_known_gate_set():
    gate_sets = [family.gates for family in small_page.FAMILIES]
    for gates in gate_sets:
        assert sum(family.matches(gates) for family in small_page.FAMILIES) == 1


@pytest.mark.patch("sglang.cp_fia_host_lengths")
def test_the_closure_finds_host_lists_by_tensor_identity():
    import torch

    meta = types.SimpleNamespace(
        cu_seqlens_q_prev_tensor=torch.tensor([0, 3, 7], dtype=torch.int32),
        kv_len_prev_tensor=torch.tensor([3, 9], dtype=torch.int32),
        cu_seqlens_q_next_tensor=torch.tensor([0, 2, 6], dtype=torch.int32),
        kv_len_next_tensor=torch.tensor([8, 14], dtype=torch.int32),
        actual_seq_q_prev_list=[3, 4], kv_len_prev_list=[3, 9],
        actual_seq_q_next_list=[2, 4], kv_len_next_list=[8, 14])
    assert host_lengths.host_lengths(meta, meta.cu_seqlens_q_prev_tensor, meta.kv_len_prev_tensor) == \
        ([3, 7], [3, 9])
    assert host_lengths.host_lengths(meta, meta.cu_seqlens_q_next_tensor, meta.kv_len_next_tensor) == \
        ([2, 6], [8, 14])
    # equal values are not enough: only the metadata's own tensors are known to match its lists
    assert host_lengths.host_lengths(meta, meta.cu_seqlens_q_prev_tensor.clone(), meta.kv_len_prev_tensor) is None
    assert host_lengths.host_lengths(meta, meta.cu_seqlens_q_prev_tensor, meta.kv_len_next_tensor) is None
    meta.kv_len_prev_list = None
    assert host_lengths.host_lengths(meta, meta.cu_seqlens_q_prev_tensor, meta.kv_len_prev_tensor) is None


@pytest.mark.patch("sglang.small_page_fia")
def test_the_open_ended_family_takes_only_a_set_of_if_tests_read(tmp_path):
    """The newest family's fence is open above, so its check must prove the shape: a method with
    every gate the family mirrors but a set of ``if`` tests no release had (here: the gates alone,
    as a newer release that dropped or added a branch would look) is another shape. Defect
    caught: the subset test alone accepts it, and a newer release's new gate is routed wrongly."""
    import importlib.util

    from npu_shim.engine import guards

    newest = small_page.FAMILIES[-1]
    lines = ["def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, q_rope=None, "
             "k_rope=None, topk_indices=None, sinks=None):"]
    lines += ["    if %s:\n        pass" % gate for gate in sorted(newest.gates)]
    lines += ["    torch_npu.npu_fused_infer_attention_score()", "    torch_npu._npu_flash_attention_qlens()"]
    (tmp_path / "gates_only.py").write_text("\n".join(lines) + "\n")
    spec = importlib.util.spec_from_file_location("gates_only", str(tmp_path / "gates_only.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    target = target_with(module.forward_extend)
    assert newest.matches(small_page.gate_conditions(target))           # every gate it mirrors is there
    release = evidence.read(small_page.PATCH.name, small_page.PATCH.families[-1].name)[-1]
    with pytest.raises(TargetMismatch, match="not a set read for this family"):
        guards.select_family(small_page.PATCH, target, {"sglang": release})
