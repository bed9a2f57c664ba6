"""The encoder ACL graph's captured attention call for grouped vision heads (``vllm.mm_encoder_attn``).

vllm-ascend 0.22.1rc1 .. 0.30.0rc2 repeat K/V to the query heads before either path of
``AscendMMEncoderAttention.forward_oot``, and the capture path (``_forward_capture_fia``, run while
``EncoderAclGraphManager`` captures a token budget) still hands FIA ``num_key_value_heads=num_kv_heads``:
at the workspace query, at the captured op (``_run_vit_fia``) and, packed into the graph params, at
the replay's rebinding (``update_encoder_graph_params``). For a tower with grouped vision heads that
call does not match its K/V (the documented op takes K/V of shape (T, num_key_value_heads, D); the
emulation rejects it). EXAONE 4.5's vision tower (16 heads over 8 K/V heads, a Qwen2.5-VL subclass:
capturable) is such a tower where vLLM has it.

What runs: vllm-ascend's own capture path, on the real wheels. The layer as vLLM builds it
(``MMEncoderAttention(..., num_kv_heads=...)`` handed back as vllm-ascend's class, registered the way
its platform registers it) through its ``forward_oot`` inside ``set_encoder_forward_context(budget,
True)``, then upstream's replay rebinding; and, where vLLM has it, EXAONE 4.5's tower captured by
upstream's ``EncoderAclGraphManager.capture`` through the model class's own capture hooks
(``prepare_encoder_cudagraph_capture_inputs``, ``encoder_cudagraph_forward``). Stand-ins, named in
:mod:`npu_shim.testing.encoder_graph`: a graph that captures nothing (the capture runs eagerly), the
graph-task ops, and FIA's ``out`` / workspace entry points over the emulated op. Numbers are checked
against the float64 reference (:func:`npu_shim.testing.attention_f64`); ``upstream`` is the same
vllm-ascend file executed again under a module name the shim does not watch.

Not testable here: the real graph capture and replay on the device.
"""
import importlib
import importlib.util

import pytest

from npu_shim.testing.claims import claimed_family

pytestmark = [pytest.mark.claimed("vllm.encoder_acl_graph_refs"), pytest.mark.patch("vllm.mm_encoder_attn")]

PATCH = "vllm.mm_encoder_attn"
GRAPH = "vllm_ascend.worker.encoder_acl_graph"
HEADS, KV_HEADS, HEAD_SIZE = 4, 2, 64
TOKENS = (10, 6)                        # two sequences (0.23.0rc1+ capture them as one: [16])
BUDGET = 16
LAYER_TOL = {"bfloat16": 1e-2}
TOWER_TOL = {"bfloat16": 5e-2}
EXAONE = "vllm.model_executor.models.exaone4_5"


@pytest.fixture(scope="module")
def stack():
    from npu_shim.testing import towers

    stack = towers.setup()
    stack.graph = importlib.import_module(GRAPH)
    return stack


@pytest.fixture
def capture_ops():
    from npu_shim.testing.encoder_graph import capture_ops_stand_in, graph_stand_in

    with graph_stand_in() as standing_in, capture_ops_stand_in() as calls:
        assert standing_in and calls is not None
        yield calls


def make_layer(stack, cls, heads=HEADS, kv_heads=KV_HEADS):
    """The layer as a tower builds it: vLLM's ``MMEncoderAttention(...)``, handed back as ``cls``."""
    from vllm.config import set_current_vllm_config
    from vllm.model_executor.layers.attention.mm_encoder_attention import MMEncoderAttention

    from npu_shim.testing.towers import registered

    with registered(cls), set_current_vllm_config(stack.config):
        layer = MMEncoderAttention(num_heads=heads, head_size=HEAD_SIZE, num_kv_heads=kv_heads,
                                   scale=HEAD_SIZE ** -0.5, prefix="visual.blocks.0.attn.attn")
    assert type(layer) is cls and layer.num_kv_heads == kv_heads
    layer._forward_method = layer.forward_oot        # as vllm-ascend's platform routes it
    return layer


def qkv(heads=HEADS, kv_heads=KV_HEADS, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    total = sum(TOKENS)
    q = torch.randn(1, total, heads, HEAD_SIZE, generator=gen).to(torch.bfloat16)
    k, v = (torch.randn(1, total, kv_heads, HEAD_SIZE, generator=gen).to(torch.bfloat16) for _ in range(2))
    return q, k, v


def captured(stack, layer, q, k, v, reads=None):
    """``layer``'s forward inside the capture of ``BUDGET`` (upstream's graph params set up for it);
    the device->host reads it makes (q, k, v and cu_seqlens standing in for device tensors) are
    appended to ``reads``."""
    import torch

    from npu_shim.testing import count_host_syncs

    stack.graph.set_encoder_graph_params([BUDGET])
    cu = torch.tensor([0, TOKENS[0], sum(TOKENS)], dtype=torch.int32)
    with torch.inference_mode(), stack.graph.set_encoder_forward_context(BUDGET, True), \
            count_host_syncs(device_tensors=(q, k, v, cu)) as counter:
        try:
            return layer(q, k, v, cu_seqlens=cu)
        finally:
            if reads is not None:
                reads.extend(counter.events)


def replayed(stack):
    """Upstream's replay rebinding of every captured call with this batch's lengths (``TOKENS``)."""
    import torch

    cu = torch.tensor([0, TOKENS[0], sum(TOKENS)], dtype=torch.int32)
    with torch.inference_mode(), stack.graph.set_encoder_forward_context(BUDGET, False, cu_seqlens_cpu=cu):
        stack.graph.update_encoder_graph_params(torch.npu.Stream(), BUDGET)
    return stack.graph.get_encoder_graph_params().attn_params[BUDGET]


def reference(q, k, v, bounds):
    from npu_shim.testing import attention_f64

    flat = [t.reshape(-1, t.shape[2], HEAD_SIZE) for t in (q, k, v)]
    return attention_f64(*flat, bounds, scale=HEAD_SIZE ** -0.5)


def rel_err(out, ref):
    return ((out.double().reshape(ref.shape) - ref).abs().max() / ref.abs().max()).item()


def test_status_names_the_capture_edit(stack):
    import npu_shim

    row = next(r for r in npu_shim.status() if r["name"] == PATCH)
    assert row["state"] == "applied" and row["family"].startswith("fia-tnd"), row
    cls = stack.attention["A2"]
    for name in ("_forward_capture_fia", "_run_vit_fia"):
        assert getattr(vars(cls)[name], "__npu_shim_patch__", None) == PATCH, name
    assert "repeated K/V" in row["summary"], row["summary"]


def test_grouped_layer_capture_and_replay(stack, capture_ops):
    """Capture of a grouped layer (4 heads over 2): every FIA call it makes (workspace, the captured
    op, the replay's rebinding) gets the head count of the K/V handed over, and the output is the
    float64 reference's, at capture (upstream's capture-time lengths) and after the replay
    rebinding (this batch's two segments)."""
    import torch

    layer = make_layer(stack, stack.attention["A2"])
    q, k, v = qkv()
    reads = []
    out = captured(stack, layer, q, k, v, reads)
    # the edit reads a shape: no device->host read in the edited functions (upstream's own reads of
    # cu_seqlens elsewhere, 0.22.1rc1's per layer, are the ungrouped test's: the same as upstream's)
    assert not [e for e in reads if e.location.endswith(("in _forward_capture_fia", "in _run_vit_fia"))], reads
    assert [op for op, _ in capture_ops] == ["workspace", "out"]
    for op, kwargs in capture_ops:
        assert kwargs["num_key_value_heads"] == kwargs["key"].shape[1] == HEADS, (op, kwargs["num_key_value_heads"])
    # the capture-time lengths are upstream's (0.23.0rc1+: one segment built on the host; 0.22.1rc1:
    # the model's cu_seqlens); the replay rebinds them to this batch's below
    lengths = capture_ops[-1][1]["actual_seq_lengths"]
    assert lengths[-1] == sum(TOKENS)
    err = rel_err(out, reference(q, k, v, [0] + list(lengths)))
    assert err <= LAYER_TOL["bfloat16"], err

    packed = stack.graph.get_encoder_graph_params().attn_params[BUDGET]
    graph_out = packed[0][-2]                 # the graph's output buffer (upstream's packing: ..., out, lse)
    assert len(packed) == 1 and torch.equal(graph_out.reshape(out.shape), out)
    replayed(stack)
    assert [op for op, _ in capture_ops] == ["workspace", "out", "out"]
    op, kwargs = capture_ops[-1]
    assert kwargs["num_key_value_heads"] == kwargs["key"].shape[1] == HEADS
    assert kwargs["actual_seq_lengths"] == [TOKENS[0], sum(TOKENS)]
    err = rel_err(graph_out, reference(q, k, v, [0, TOKENS[0], sum(TOKENS)]))
    assert err <= LAYER_TOL["bfloat16"], err


def test_upstream_grouped_capture_call_is_rejected(stack, capture_ops):
    """Before: upstream's own capture path hands FIA ``num_key_value_heads=2`` beside K/V repeated to
    4 heads; the op (emulated as documented) rejects it."""
    layer = make_layer(stack, stack.upstream["A2"])
    with pytest.raises(ValueError, match=r"TND key/value must be \(T, Nkv=%d, D\)" % KV_HEADS):
        captured(stack, layer, *qkv())
    op, kwargs = capture_ops[-1]
    assert kwargs["num_key_value_heads"] == KV_HEADS != kwargs["key"].shape[1]


def test_ungrouped_layer_capture_equals_upstream(stack, capture_ops):
    """As many K/V heads as query heads: the edited capture makes upstream's very call; the outputs
    at capture and after the replay rebinding are torch.equal to upstream's, with the same
    device->host reads (upstream's own: none from 0.23.0rc1, 0.22.1rc1's copy of cu_seqlens)."""
    import torch

    results, reads = {}, {"A2": [], "upstream": []}
    for side in ("A2", "upstream"):
        cls = stack.attention["A2"] if side == "A2" else stack.upstream["A2"]
        layer = make_layer(stack, cls, HEADS, HEADS)
        q, k, v = qkv(HEADS, HEADS)
        start = len(capture_ops)
        out = captured(stack, layer, q, k, v, reads[side])
        packed = replayed(stack)
        calls = capture_ops[start:]
        # packed: q, k, v, ..., the output buffer, softmax_lse (never written: upstream does not read it)
        results[side] = (out.clone(), [t.clone() for t in packed[0][:-1] if isinstance(t, torch.Tensor)],
                         [{k: v for k, v in kw.items() if not isinstance(v, torch.Tensor)} for _, kw in calls])
    shim, upstream = results["A2"], results["upstream"]
    assert torch.equal(shim[0], upstream[0])
    assert len(shim[1]) == len(upstream[1]) and all(torch.equal(a, b) for a, b in zip(shim[1], upstream[1]))
    assert shim[2] == upstream[2]
    assert reads["A2"] == reads["upstream"], reads


def _exaone_config():
    from transformers.models.exaone4_5.configuration_exaone4_5 import Exaone4_5_VisionConfig

    # EXAONE 4.5's grouping (2 query heads per K/V head), head dim 64; one window per capture grid
    return Exaone4_5_VisionConfig(depth=2, hidden_size=256, num_heads=4, num_key_value_heads=2,
                                  intermediate_size=256, out_hidden_size=64, patch_size=14, spatial_merge_size=2,
                                  temporal_patch_size=2, window_size=112, fullatt_block_indexes=[1])


def exaone_model(stack, attention_class):
    """EXAONE 4.5's model class around its vision tower as vLLM builds it (``attention_class`` for its
    attention layers): the capture hooks are the class's own (Qwen2.5-VL's, inherited), reading only
    ``self.visual``; the language model is not built."""
    import torch
    from vllm.config import set_current_vllm_config

    from npu_shim.testing import towers

    with towers.placeholder_torchvision(), set_current_vllm_config(stack.config):
        module = importlib.import_module(EXAONE)
    tower = towers.build_tower_of(stack, module.EXAONE4_5_VisionTransformer, _exaone_config, attention_class)
    model = object.__new__(module.Exaone4_5_ForConditionalGeneration)
    torch.nn.Module.__init__(model)
    model.visual = tower
    return module, model


def exaone_reference(stack, module, pixels, metadata):
    """The float64 tower (the same weights, rounded to the inputs' dtype first), every attention
    layer :func:`npu_shim.testing.attention_f64` (grouped: query head h reads K/V head h // 2), on the
    capture's own inputs."""
    import torch

    from npu_shim.testing import towers

    ref = towers.build_tower_of(stack, module.EXAONE4_5_VisionTransformer, _exaone_config, None,
                                dtype=pixels.dtype).double()
    towers.f64_attention_layers(ref)
    metadata = {k: v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v
                for k, v in metadata.items()}
    with torch.inference_mode(), towers.registered(None), towers.upstream_methods(module), \
            towers.upstream_methods(importlib.import_module("vllm.model_executor.models.qwen2_5_vl")):
        return ref(pixels.double(), None, encoder_metadata=metadata)


# EXAONE 4.5's tower is in every vLLM of the window (read in 0.22.1 and 0.30.0); its config class is
# transformers' (transformers.models.exaone4_5): in 5.14.1, not in 5.5.4 (0.22 / 0.23's pins; 5.13.0 not read).
@pytest.mark.claimed("vllm.encoder_acl_graph_refs", pinned={"transformers": ">=5.14.1"})
def test_exaone_4_5_tower_captured_by_the_manager(stack, capture_ops):
    """EXAONE 4.5's vision tower (grouped heads) captured by upstream's ``EncoderAclGraphManager.capture``
    through the model class's own capture hooks: every FIA call gets the K/V's head count, and the
    captured output (the graph's output buffer) is the float64 tower's on the capture's inputs. With
    upstream's attention class the capture fails at the first layer's captured op."""
    import torch

    from npu_shim.testing.encoder_graph import capture, graphs

    budget = 4                       # one 1 x 4 merged-token image: one window, one segment per layer
    module, model = exaone_model(stack, stack.attention["A2"])
    layers = [m for m in model.visual.modules() if isinstance(m, stack.attention["A2"])]
    assert layers and all(m.num_kv_heads * 2 == m.num_heads for m in layers)
    torch.manual_seed(0)
    manager, _ = capture(stack.graph, (budget,), model=model, dtype=torch.bfloat16)
    meta = graphs(manager)[budget]
    assert [op for op, _ in capture_ops] == ["workspace"] + ["out"] * len(layers)
    for op, kwargs in capture_ops:
        assert kwargs["num_key_value_heads"] == kwargs["key"].shape[1] == layers[0].num_heads, op
    inputs = dict(meta.input_buffers)
    pixels = inputs.pop("pixel_values")
    ref = exaone_reference(stack, module, pixels, inputs)
    out = meta.output_buffer
    assert out.shape == ref.shape
    err = ((out.double() - ref).abs().max() / ref.abs().max()).item()
    assert err <= TOWER_TOL["bfloat16"], err

    _, upstream_model = exaone_model(stack, stack.upstream["A2"])
    torch.manual_seed(0)
    with pytest.raises(ValueError, match=r"TND key/value must be \(T, Nkv=2, D\)"):
        capture(stack.graph, (budget,), model=upstream_model, dtype=torch.bfloat16)
