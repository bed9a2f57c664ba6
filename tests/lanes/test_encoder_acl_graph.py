"""Patch ``vllm.encoder_acl_graph_refs``: the encoder ACL graph owns its output buffer and workspaces.

Every lane a family of the patch claims (vllm-ascend 0.22.1rc1 .. 0.30.0rc2), on the real wheels;
the lane below the window (vllm-ascend 0.21.0rc1, no encoder ACL graph) checks that the patch
stays out.

What runs: upstream's ``EncoderAclGraphManager.capture`` and ``_capture_budget_graph``, as the shim
edits them, and untouched (``upstream``: the same vllm-ascend file executed a second time under a
module name the shim does not watch), through :mod:`npu_shim.testing.encoder_graph` (the manager
made with ``object.__new__``, a toy model that registers an FIA workspace while capturing, a
``torch.npu`` graph that captures nothing: its docstring names each stand-in) with torch_npu the
emulation, whose ``_C._weak_ref_tensor`` (:mod:`npu_shim.emulation.weak_ref`) gives a tensor that
does not own its memory. vllm-ascend 0.22.1rc1 .. 0.28.0rc1 reach it for every tensor; 0.29.0rc1+
only for an ``"npu"`` tensor (a CPU tensor comes back itself, a strong reference), so on those
releases ``vllm_ascend.utils.weak_ref_tensor`` is stood in by what it does for an NPU tensor.
The emulated replay (``encoder_graph.replay``) checks the output buffer and the workspace upstream's
replay writes into: one whose owner was released raises the 507011 error, as replay did on the
device (vllm-ascend PR #16794).

Not testable on this CPU: the real NPU graph capture and replay (the graph tasks, the graph pool),
and the NPU caching allocator's reuse of released memory; the emulation treats released memory as
reused at once. The ViT attention speed-up the PR reports is hardware-only too.
"""
import importlib
import inspect
import os
import sys
import types

import pytest

from npu_shim.testing.claims import claimed_family
from npu_shim.testing.encoder_graph import capture, graphs, replay

pytestmark = [pytest.mark.claimed("vllm.encoder_acl_graph_refs"),
              pytest.mark.patch("vllm.encoder_acl_graph_refs")]

PATCH_NAME = "vllm.encoder_acl_graph_refs"
TARGET = "vllm_ascend.worker.encoder_acl_graph"
UPSTREAM_COPY = "npu_shim_tests_upstream_encoder_acl_graph"
BUDGETS = (8, 16)


def installed_ascend():
    from importlib.metadata import version

    return version("vllm-ascend")


def has_graph():
    """A family of the patch admits the installed release (else: below the window)."""
    return claimed_family(PATCH_NAME) is not None


@pytest.fixture(scope="module")
def stack():
    os.environ.setdefault("VLLM_PLUGINS", "")  # the lanes use "npu_shim"; never "ascend"
    import npu_shim
    from npu_shim import emulation

    emulation.install()
    npu_shim.install()
    if not has_graph():
        return types.SimpleNamespace(module=None, upstream=None,
                                     status=next(r for r in npu_shim.status() if r["name"] == PATCH_NAME))
    module = importlib.import_module(TARGET)
    row = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)
    spec = importlib.util.spec_from_file_location(UPSTREAM_COPY, module.__file__)
    upstream = importlib.util.module_from_spec(spec)
    sys.modules[UPSTREAM_COPY] = upstream        # its dataclasses look their module up there
    spec.loader.exec_module(upstream)
    return types.SimpleNamespace(module=module, upstream=upstream, status=row)


@pytest.fixture
def graph_stand_ins(monkeypatch):
    """``torch.npu``'s graph stand-in, and (0.29.0rc1+) vllm-ascend's ``weak_ref_tensor`` as it
    acts on an NPU tensor (see the module docstring)."""
    import torch
    import torch_npu
    import vllm_ascend.utils as ascend_utils
    from npu_shim.testing.encoder_graph import graph_stand_in

    assert getattr(torch_npu, "__npu_shim_emulated__", False)
    if 'device.type == "npu"' in inspect.getsource(ascend_utils.weak_ref_tensor):
        monkeypatch.setattr(ascend_utils, "weak_ref_tensor",
                            lambda t: torch_npu._C._weak_ref_tensor(t) if isinstance(t, torch.Tensor) else t)
    with graph_stand_in() as standing_in:
        assert standing_in
        yield


def test_status(stack):
    row = stack.status
    assert row["state"] == "applied", row
    assert row["family"] == claimed_family(PATCH_NAME).name, row


@pytest.mark.claimed("vllm.encoder_acl_graph_refs", outside="below")
def test_below_the_window_the_patch_stays_out(stack):
    """The release below the window has no encoder ACL graph: the patch reports why and the
    target does not exist."""
    row = stack.status
    assert not has_graph()
    assert row["state"] == "skipped", row
    assert "outside" in row["reason"] and "no encoder ACL graph" in row["reason"], row
    with pytest.raises(ImportError):
        importlib.import_module(TARGET)


def test_patched_capture_owns_what_replay_writes(stack, graph_stand_ins):
    import torch
    from npu_shim.emulation.weak_ref import is_weak, released

    manager, model = capture(stack.module, BUDGETS)
    params = stack.module.get_encoder_graph_params()
    assert sorted(graphs(manager)) == sorted(BUDGETS)
    for budget in BUDGETS:
        meta, workspace = graphs(manager)[budget], params.workspaces[budget]
        assert not is_weak(meta.output_buffer) and not released(meta.output_buffer)
        assert workspace is not None and not is_weak(workspace) and not released(workspace)
        out = replay(stack.module, manager, budget)
        # the buffer the metadata holds is the one the captured forward wrote (graph ran eagerly)
        assert torch.equal(out, model.inputs[budget] * 2)


def test_upstream_capture_releases_what_replay_writes(stack, graph_stand_ins):
    """Before: upstream's own capture leaves both buffers to weak tensors only; the emulated replay
    fails as the device did (507011)."""
    from npu_shim.emulation.weak_ref import DeviceMemoryError, is_weak, released

    manager, _ = capture(stack.upstream, BUDGETS)
    params = stack.upstream.get_encoder_graph_params()
    for budget in BUDGETS:
        meta, workspace = graphs(manager)[budget], params.workspaces[budget]
        assert is_weak(meta.output_buffer) and released(meta.output_buffer)
        assert is_weak(workspace) and released(workspace)
        with pytest.raises(DeviceMemoryError, match="507011"):
            replay(stack.upstream, manager, budget)


def test_replacements_are_upstream_edited(stack):
    """Each replacement is upstream's function less its weak-reference calls, nothing else."""
    cls = stack.module.EncoderAclGraphManager
    for name in ("capture", "_capture_budget_graph"):
        replacement = vars(cls)[name]
        original = replacement.__wrapped_upstream__
        untouched = vars(stack.upstream.EncoderAclGraphManager)[name]
        assert original.__code__.co_code == untouched.__code__.co_code
        assert "weak_ref" in inspect.getsource(original)
        names = set(replacement.__code__.co_names)
        assert not {n for n in names if n.startswith("weak_ref")}, sorted(names)
        assert replacement.__code__.co_filename == original.__code__.co_filename
        removed = {n for n in original.__code__.co_names if n.startswith("weak_ref")}
        assert set(original.__code__.co_names) - removed == names


def test_capture_path_keeps_upstream_attention_call(stack, monkeypatch):
    """``vllm.mm_encoder_attn``'s eager path is not the capture path: while the encoder graph is
    captured the patched ``forward_oot`` hands the call to upstream's, which goes to
    ``_forward_capture_fia`` (stood in here; the head-count edit of it is
    tests/lanes/test_encoder_acl_graph_gqa.py's). On 0.22.1rc1 that call uses ``scale_value``
    (``head_size ** -0.5``), not the model's scale: status names it."""
    import torch
    import npu_shim
    from npu_shim.testing.isolation import import_vllm_ascend_ops_module
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    attention = import_vllm_ascend_ops_module()
    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        # the Ascend class itself (vLLM's MMEncoderAttention(...) hands it back once vllm-ascend
        # registers it; the registry is left alone here, other lane tests register their own)
        layer = attention.AscendMMEncoderAttention(num_heads=2, head_size=64, scale=0.5,
                                                   prefix="visual.blocks.0.attn")
    assert getattr(type(layer).forward_oot, "__npu_shim_patch__", None) == "vllm.mm_encoder_attn"
    seen = {}

    def capture_fia(query, key, value, **kwargs):
        seen["called"] = True
        return torch.zeros_like(query)

    monkeypatch.setattr(layer, "_forward_capture_fia", capture_fia, raising=False)
    before = npu_shim.stats()["vllm.mm_encoder_attn"]["upstream_calls"]
    q = k = v = torch.zeros(1, 8, 2, 64)
    with stack.module.set_encoder_forward_context(BUDGETS[0], True):
        layer.forward_oot(q, k, v, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32))
    assert seen.get("called")
    assert npu_shim.stats()["vllm.mm_encoder_attn"]["upstream_calls"] == before + 1
    capture_source = inspect.getsource(vars(attention.AscendMMEncoderAttention)["_forward_capture_fia"])
    if "self.scale_value" in capture_source:
        # the capture path's scale is upstream's head_size ** -0.5, not the model's: status says so
        assert layer.scale_value == 64 ** -0.5 != layer.scale
        summary = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)["summary"]
        assert "head_size ** -0.5, not the model's scale" in summary and claimed_family(PATCH_NAME).name in summary
    else:
        assert "self.scale" in capture_source
