"""Run vllm-ascend's encoder ACL-graph capture off the device, and check what its replay writes into.

Used by the selftest of ``vllm.encoder_acl_graph_refs`` and tests/lanes/test_encoder_acl_graph.py.
What runs is upstream's ``EncoderAclGraphManager.capture`` (with vLLM's
``EncoderCudaGraphManager.capture`` looping over the budgets) and ``_capture_budget_graph``. The
stand-ins, named:

* the manager is made with ``object.__new__`` and given the attributes those functions read (its
  ``__init__`` needs a whole vLLM model runner);
* :class:`ToyModel`: its ``encoder_cudagraph_forward`` doubles the input and, while capturing, makes
  the budget's FIA workspace and registers it with upstream's ``update_encoder_graph_workspace``,
  as vllm-ascend's ``_forward_capture_fia`` does in its first layer;
* :func:`graph_stand_in`: where there is no ``torch.npu`` (this CPU), ``torch.npu.NPUGraph`` /
  ``torch.npu.graph`` are a graph that captures nothing (the capture runs eagerly, replay does
  nothing), for the duration of the block.

:func:`replay` checks the two buffers upstream's replay writes into:
``BudgetGraphMetadata.output_buffer`` (what ``_run_budget_graph`` returns after ``graph.replay()``)
and the budget's workspace (what ``update_encoder_graph_params`` hands
``npu_fused_infer_attention_score.out``), with :func:`npu_shim.emulation.weak_ref.require_alive`:
one whose owner was released raises the 507011 error replay raised on the device (vllm-ascend PR
#16794). Not modelled: the real graph capture and replay, the graph pool, the NPU allocator.

:func:`capture_ops_stand_in` lets upstream's own ``_forward_capture_fia`` (the attention recorded into
the graph) and ``update_encoder_graph_params`` (the replay's rebinding of it) run here: the graph-task
ops (``torch.npu.graph_task_group_begin/end``, ``graph_task_update_begin/end``,
``torch.npu.ExternalEvent``) do nothing, ``torch_npu._npu_fused_infer_attention_score_get_max_workspace``
hands back a workspace, and ``torch_npu.npu_fused_infer_attention_score.out`` runs the emulated op
(:mod:`npu_shim.emulation.fused_infer_attention`, which rejects K/V whose head count is not
``num_key_value_heads``) and writes its attention output into ``out``, at once: a capture that runs the call
eagerly, as a replay with the capture-time lengths would. Every call's arguments are recorded.
"""
import contextlib
import types

from npu_shim.testing.attributes import attributes_set

WIDTH = 4
WORKSPACE_ELEMENTS = 64


class ToyModel:
    """The model's two capture hooks (see the module docstring); ``inputs[budget]`` is the input."""

    def __init__(self, module, device="cpu"):
        self.module, self.device, self.inputs = module, device, {}

    def prepare_encoder_cudagraph_capture_inputs(self, token_budget, max_batch_size, max_frames_per_batch,
                                                 device, dtype, path="default"):
        import torch

        pixels = torch.arange(token_budget * WIDTH, dtype=dtype, device=device).reshape(token_budget, WIDTH)
        self.inputs[token_budget] = pixels
        buffers = {"cu_seqlens": torch.tensor([0, token_budget], dtype=torch.int32, device=device)}
        return types.SimpleNamespace(mm_kwargs={"pixel_values": pixels}, buffers=buffers,
                                     values={"pixel_values": pixels, **buffers})

    def encoder_cudagraph_forward(self, values, *args, path="default"):
        import torch

        context = self.module.get_encoder_forward_context()
        if context.capturing:
            params = self.module.get_encoder_graph_params()
            if params.workspaces.get(context.token_budget) is None:
                workspace = torch.empty(WORKSPACE_ELEMENTS, device=values["pixel_values"].device)
                self.module.update_encoder_graph_workspace(context.token_budget, workspace)
        return values["pixel_values"] * 2


@contextlib.contextmanager
def graph_stand_in():
    """``torch.npu.NPUGraph`` / ``torch.npu.graph`` as a graph that captures nothing, where torch
    has no ``npu`` or has the emulation's (whose NPUGraph is an import placeholder; put back on
    exit); on an NPU machine, nothing changes."""
    import torch

    from npu_shim import emulation

    existing = getattr(torch, "npu", None)
    if existing is not None and not emulation.is_emulated():
        yield False
        return

    class Graph:
        def replay(self):
            pass

    @contextlib.contextmanager
    def graph(npu_graph, pool=None, *args, **kwargs):
        yield npu_graph

    if existing is None:
        torch.npu = types.SimpleNamespace(NPUGraph=Graph, graph=graph)
        try:
            yield True
        finally:
            del torch.npu
        return
    # the emulation's torch.npu, registered by an earlier test of this process
    saved = {name: getattr(existing, name, None) for name in ("NPUGraph", "graph")}
    existing.NPUGraph, existing.graph = Graph, graph
    try:
        yield True
    finally:
        for name, value in saved.items():
            if value is None:
                delattr(existing, name)
            else:
                setattr(existing, name, value)


@contextlib.contextmanager
def npu_weak_refs(device="cpu"):
    """vllm-ascend's ``weak_ref_tensor`` acting as it acts on an NPU tensor, while the block runs,
    where the installed release makes it a no-op off the NPU (0.29.0rc1+: ``device.type == "npu"``)
    and the ops are the emulation's (its ``_weak_ref_tensor`` keeps no owner, as on the device);
    elsewhere nothing changes. Without it, on CPU tensors upstream's weak references of those
    releases keep their tensors alive and no capture, fixed or not, releases anything."""
    import inspect

    from npu_shim import emulation

    if device != "cpu" or not emulation.is_emulated():
        yield
        return
    import torch
    import torch_npu
    import vllm_ascend.utils as ascend_utils

    upstream = ascend_utils.weak_ref_tensor
    if 'device.type == "npu"' not in inspect.getsource(upstream):
        yield
        return
    ascend_utils.weak_ref_tensor = (lambda t: torch_npu._C._weak_ref_tensor(t)
                                    if isinstance(t, torch.Tensor) else t)
    try:
        yield
    finally:
        ascend_utils.weak_ref_tensor = upstream


def capture(module, budgets, device="cpu", model=None, dtype=None):
    """Upstream's capture of ``budgets`` by ``module``'s ``EncoderAclGraphManager``, the capture's
    locals collected afterwards; ``(manager, model)``. ``model``: the model whose capture hooks
    run (default :class:`ToyModel`), e.g. a vLLM model class around a tower; ``dtype``: the
    capture inputs' (default float32)."""
    import gc

    import torch

    manager = object.__new__(module.EncoderAclGraphManager)
    model = ToyModel(module, device) if model is None else model
    manager.__dict__.update(
        model=model, token_budgets=list(budgets), path_token_budgets={"default": list(budgets)},
        _capture_axes=(), budget_graphs={}, graph_pool=None, update_stream=None, fullatt=None,
        max_batch_size=1, max_frames_per_batch=1, device=torch.device(device), dtype=dtype or torch.float32,
        # enable_dual_path_graph: vLLM 0.24 - 0.26's capture asks it (one path here)
        config=types.SimpleNamespace(input_key_by_modality={"image": "pixel_values"}, enable_dual_path_graph=False))
    manager.capture()
    gc.collect()
    return manager, model


def graphs(manager):
    """``{budget: BudgetGraphMetadata}`` (vLLM 0.24+ keys them by path first)."""
    found = manager.budget_graphs.get("default", manager.budget_graphs)
    return {meta.token_budget: meta for meta in found.values()}


def replay(module, manager, budget):
    """Replay ``budget``'s graph; what it writes into checked as the device would find it; the
    output buffer."""
    from npu_shim.emulation.weak_ref import require_alive

    meta = graphs(manager)[budget]
    meta.graph.replay()
    require_alive(module.get_encoder_graph_params().workspaces[budget], "the FIA workspace of budget %d" % budget)
    return require_alive(meta.output_buffer, "the output buffer of budget %d" % budget)


class _Event:
    """``torch.npu.ExternalEvent`` (what ``_forward_capture_fia`` and the replay call on it: nothing
    is ever pending here)."""

    def wait(self, stream=None):
        pass

    def reset(self, stream=None):
        pass

    def record(self, stream=None):
        pass


@contextlib.contextmanager
def capture_ops_stand_in():
    """The graph-task and FIA ``out``/workspace ops named in the module docstring, for the block, on
    ``torch.npu`` as :func:`graph_stand_in` (entered first) leaves it and on the emulated torch_npu;
    yields the list of ``(op, keyword arguments)`` of every FIA call made through them. On an NPU
    machine (a real torch_npu) nothing changes and it yields None."""
    import torch

    from npu_shim import emulation

    if not emulation.is_emulated():
        yield None
        return
    import torch_npu

    calls = []
    fia = torch_npu.npu_fused_infer_attention_score

    def get_max_workspace(**kwargs):
        calls.append(("workspace", kwargs))
        return torch.empty(WORKSPACE_ELEMENTS, device=kwargs["query"].device)

    def fia_out(*, workspace, out, **kwargs):
        if workspace is None:
            raise ValueError("npu_fused_infer_attention_score.out: no workspace")
        calls.append(("out", kwargs))
        attention_out, _ = fia(**kwargs)
        out[0].copy_(attention_out)          # softmax_lse (out[1]): upstream never reads it
        return out

    handles = []

    def group_end(stream):
        handles.append(object())
        return handles[-1]

    device = torch.npu
    on_device = {
        "ExternalEvent": _Event, "graph_task_group_begin": lambda stream: None, "graph_task_group_end": group_end,
        "graph_task_update_begin": lambda stream, handle: None, "graph_task_update_end": lambda stream: None,
        "Stream": torch_npu.npu.Stream, "stream": torch_npu.npu.stream,
    }
    with attributes_set() as put:
        for name, value in on_device.items():
            put(device, name, value)
        put(torch_npu, "_npu_fused_infer_attention_score_get_max_workspace", get_max_workspace)
        put(fia, "out", fia_out)
        yield calls
