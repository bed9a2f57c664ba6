"""Patch ``vllm.glm4_1v_host_lengths`` (with ``vllm.mm_encoder_attn`` and
``vllm.mm_encoder_host_lengths``): whole GLM-4.1V vision-tower forwards with no
device->host read.

vLLM's own ``Glm4vVisionTransformer`` from a tiny random config
(:mod:`npu_shim.testing.towers`), its ``MMEncoderAttention`` layers handed back
as vllm-ascend's class of each device class (A2, 310P) through the out-of-tree
registration, run in ``torch.inference_mode()``: two forwards with different
grids, each with a multi-frame item. The tower's parameters and
``pixel_values`` stand in for device tensors; placement is followed from there.

Gate, per device class: 0 reads and 0 blocking host->device copies per whole
forward with the shim; upstream (vLLM's own GLM-4.1V code,
``towers.upstream_code``, with the untouched vllm-ascend class) counted beside
it, and where the patch applies it reads the embeddings' lengths back (two per
frame) and makes blocking copies; outputs ``torch.equal`` to upstream's (the same
ops on the same data), close to vLLM's own TORCH_SDPA tower and to a float64 copy
(vLLM's own code, ``npu_shim.testing.attention_f64``). On vLLM 0.28 and later the
patch stays out (upstream builds the sizes on the host); the gate still holds
there with ``vllm.mm_encoder_host_lengths``.
"""
import pytest

pytestmark = [pytest.mark.claimed("vllm.glm4_1v_host_lengths"),
              pytest.mark.claimed("vllm.glm4_1v_host_lengths", outside="newest"),   # outside its window: skipped, and why,
              pytest.mark.patch("vllm.glm4_1v_host_lengths", "vllm.mm_encoder_host_lengths",
                                "vllm.mm_encoder_attn", "vllm.glm4_1v_rotary_ids")]

PATCH_NAME = "vllm.glm4_1v_host_lengths"
TOWER = "GLM-4.1V"
# |tower - float64 tower| and |tower - TORCH_SDPA tower|, relative to max |float64 tower| (no
# floor); measured worst (vllm-0.18): bfloat16 4.3e-2 (vs SDPA 2.7e-2), float16 4.7e-3 (3.0e-3)
TOWER_TOL = {"bfloat16": 1e-1, "float16": 1.5e-2}


def vllm_minor():
    from importlib.metadata import version

    return ".".join(version("vllm").split(".")[:2])


def claimed():
    """The family whose fence admits the installed vLLM (the declaration's claim), or None."""
    from npu_shim.testing import claims

    return claims.claimed_family(PATCH_NAME)


def applies():
    return claimed() is not None


def rotary_copies():
    """Upstream's blocking copies in rot_pos_emb: 2 where vllm.glm4_1v_rotary_ids claims the release."""
    from npu_shim.testing import claims

    return 2 if claims.claimed_family("vllm.glm4_1v_rotary_ids") is not None else 0


@pytest.fixture(scope="module")
def stack():
    from npu_shim.testing import towers

    return towers.setup()


def row():
    import npu_shim

    return next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)


def run(stack, tower, attention_class, x, grid, *, upstream):
    import contextlib

    import torch

    from npu_shim.testing import count_host_syncs, towers

    code = towers.upstream_code(stack, TOWER) if upstream else contextlib.nullcontext()
    with torch.inference_mode(), towers.registered(attention_class), code:
        with count_host_syncs(device_tensors=[x], device_modules=[tower]) as syncs:
            out = tower(x, grid_thw=grid)
    return out, syncs


def embedding_reads(syncs):
    """The reads made in vLLM's glm4_1v.py (the embeddings' repeat counts; 0.18.0's tolist)."""
    return sum("models/glm4_1v.py:" in str(event) for event in syncs.events)


def test_status(stack):
    found = row()
    if applies():
        assert (found["state"], found["family"]) == ("applied", claimed().name), found
    else:
        assert found["state"] == "skipped" and "above it vLLM builds" in found["reason"], found


def test_whole_tower_forward_reads_nothing_back(stack, device_class):
    import torch

    from npu_shim.patches.vllm.glm4_1v_host_lengths import families
    from npu_shim.testing import towers

    patched = towers.build_tower(stack, TOWER, stack.attention[device_class])
    upstream = towers.build_tower(stack, TOWER, stack.upstream[device_class])
    sdpa = towers.build_tower(stack, TOWER, None)
    for forward in range(2):
        grid = towers.grids(forward)
        frames = sum(t for t, _, _ in grid)
        x = towers.pixel_values(patched, grid, seed=forward)
        out, syncs = run(stack, patched, stack.attention[device_class], x, grid, upstream=False)
        up, up_syncs = run(stack, upstream, stack.upstream[device_class], x, grid, upstream=True)
        sd, _ = run(stack, sdpa, None, x, grid, upstream=True)
        print("GLM-4.1V vllm %s %s forward %d: upstream %s -> shim %s" % (
            vllm_minor(), device_class, forward, up_syncs.summary(), syncs.summary()))
        assert syncs.count == 0, [str(e) for e in syncs.events]
        # No blocking copy with the shim. Upstream's rot_pos_emb indexes the device cos/sin tables
        # with position ids built on the host (the index copied over first: 2 per forward) on
        # vLLM 0.18 - 0.21, where vllm.glm4_1v_rotary_ids moves them non-blocking as 0.22.1 does.
        assert syncs.h2d_count == 0, [str(e) for e in syncs.h2d_events]
        assert sum(e.location.endswith(" in rot_pos_emb") for e in up_syncs.h2d_events) == rotary_copies()
        assert up_syncs.count > 0, up_syncs.summary()              # the attention's read(s), at least
        if applies():
            tolist = int(claimed().load() is families.COPY_THEN_TOLIST)   # 0.18.0's tolist of the device cu_seqlens
            assert embedding_reads(up_syncs) == 2 * frames + tolist, [str(e) for e in up_syncs.events]
            assert up_syncs.h2d_count > 0, up_syncs.summary()
        else:
            assert embedding_reads(up_syncs) == 0, [str(e) for e in up_syncs.events]
        assert torch.equal(out, up)
        with towers.upstream_code(stack, TOWER):
            ref = towers.reference_forward(stack, TOWER, x, grid)
        towers.assert_near_references("tower GLM-4.1V", out, ref, sd, TOWER_TOL)


def test_replacements_name_upstream_and_upstream_code_restores_them(stack):
    if not applies():
        pytest.skip("vLLM %s builds the embedding sizes on the host: the patch is out" % vllm_minor())
    from npu_shim.testing import towers

    module = stack.modules[TOWER]
    classes = (module.Glm4vVisionEmbeddings, module.Glm4vVisionTransformer)
    replaced = {(cls.__name__, name): value for cls in classes for name, value in vars(cls).items()
                if hasattr(value, "__wrapped_upstream__")}
    assert replaced, "nothing replaced"
    for value in replaced.values():
        assert value.__wrapped_upstream__.__code__.co_filename == module.__file__
    with towers.upstream_code(stack, TOWER):
        for (cls_name, name), value in replaced.items():
            assert vars(getattr(module, cls_name))[name] is value.__wrapped_upstream__
    for (cls_name, name), value in replaced.items():
        assert vars(getattr(module, cls_name))[name] is value


def test_device_lengths_run_upstreams_embeddings(stack):
    """Lengths that are not on the host go to upstream's embeddings, which read them (the same
    output as the host lengths give)."""
    if not applies():
        pytest.skip("vLLM %s builds the embedding sizes on the host: the patch is out" % vllm_minor())
    import torch

    from npu_shim.testing import count_host_syncs, towers

    tower = towers.build_tower(stack, TOWER, stack.attention["A2"])
    embeddings = tower.embeddings
    h = torch.arange(4).repeat_interleave(4).repeat(2)
    w = torch.arange(4).repeat(4).repeat(2)
    x = torch.zeros(32, embeddings.embed_dim)
    shapes = torch.tensor([[2, 4, 4]])
    device_lengths = torch.tensor([16, 16])
    with torch.inference_mode(), count_host_syncs(device_tensors=[device_lengths, x],
                                                  device_modules=[tower]) as syncs:
        from_device = embeddings(x, device_lengths, shapes, h, w)
    assert syncs.count == 2 * 2, syncs.summary()                    # upstream's path: two per frame
    with torch.inference_mode(), count_host_syncs(device_tensors=[x], device_modules=[tower]) as syncs:
        from_host = embeddings(x, [16, 16], shapes, h, w)
    assert syncs.count == 0 and syncs.h2d_count == 0, syncs.summary()
    assert torch.equal(from_device, from_host)


def _another_forward(self, embeddings, lengths, image_shapes, h_coords, w_coords):
    return embeddings


def edit_diff(function, edits):
    """The lines ``edits`` add (``+``) to and remove (``-``) from ``function``'s source, stripped."""
    import difflib

    from npu_shim.patches._shared.source_edit import edited_source

    before, after = edited_source(function, ()).splitlines(), edited_source(function, edits).splitlines()
    return [line[0] + line[2:].strip() for line in difflib.ndiff(before, after) if line[:1] in "+-"]


def test_the_edits_and_checks_refusing_a_method_without_their_anchors(stack):
    """The embeddings' forward is upstream's with five edits; each family refuses embeddings
    without their anchors."""
    if not applies():
        pytest.skip("vLLM %s builds the embedding sizes on the host: the patch is out" % vllm_minor())
    import types

    from npu_shim.patch import FamilyContext, TargetMismatch
    from npu_shim.patches.vllm.glm4_1v_host_lengths import families

    module = stack.modules[TOWER]
    family = claimed().load()
    original = vars(module.Glm4vVisionEmbeddings)["forward"].__wrapped_upstream__
    assert edit_diff(original, families.HOST_LENGTHS) == [
        "-h_coords, w_coords = (h_coords.to(device), w_coords.to(device))",
        "+h_coords, w_coords = (h_coords.to(device, non_blocking=True), w_coords.to(device, non_blocking=True))",
        "-lengths = torch.tensor(lengths, device=device, dtype=torch.long)",
        "+pass",
        "-image_shapes = torch.tensor(image_shapes, device=device, dtype=torch.long)",
        "+image_shapes = torch.tensor(image_shapes, dtype=torch.long)",
        "+image_shapes = image_shapes.to(device, non_blocking=True)"]
    other = type(module.Glm4vVisionEmbeddings.__name__, (), {"forward": _another_forward})
    fake = types.SimpleNamespace(__name__=module.__name__, Glm4vVisionEmbeddings=other,
                                 Glm4vVisionTransformer=module.Glm4vVisionTransformer)
    with pytest.raises(TargetMismatch, match=r"anchor 'h_coords.to\(device\)' found 0 times"):
        families._check_embeddings(other)
    with pytest.raises(TargetMismatch, match="found 0 times"):
        family.check(fake, FamilyContext(PATCH_NAME))


def test_the_copy_then_tolist_family_needs_the_copy_before_the_read(stack):
    """A tower forward that reads seqlens from the host tensor before copying it holds both
    anchors of :data:`SEQLENS_FROM_HOST` but is not the copy-then-tolist shape: the family's check
    refuses it by their order (the release's own forward where it has that order, else the
    release's forward with the two statements swapped)."""
    if not applies():
        pytest.skip("vLLM %s builds the embedding sizes on the host: the patch is out" % vllm_minor())
    import inspect
    import linecache
    import textwrap
    import types

    from npu_shim.patch import FamilyContext, TargetMismatch
    from npu_shim.patches.vllm.glm4_1v_host_lengths import families

    module = stack.modules[TOWER]
    forward = vars(module.Glm4vVisionTransformer)["forward"]
    forward = getattr(forward, "__wrapped_upstream__", forward)
    source = textwrap.dedent(inspect.getsource(forward))
    copy, read = families.COPY_THEN_TOLIST.ORDER
    if -1 < source.find(copy) < source.find(read):
        assert claimed().load() is families.COPY_THEN_TOLIST
        assert edit_diff(forward, families.SEQLENS_FROM_HOST) == [
            "+host_cu_seqlens = cu_seqlens",
            "+host_record.remember(cu_seqlens, host_cu_seqlens)",
            "-seqlens = (cu_seqlens[1:] - cu_seqlens[:-1]).tolist()",
            "+seqlens = (host_cu_seqlens[1:] - host_cu_seqlens[:-1]).tolist()"]
        swapped = source.replace(copy, "#COPY#").replace(read, copy).replace("#COPY#", read)
        name = "<glm4_1v_test_%d>" % id(swapped)
        linecache.cache[name] = (len(swapped), None, swapped.splitlines(True), name)
        namespace = {}
        exec(compile(swapped, name, "exec"), dict(forward.__globals__, __file__=name), namespace)
        forward = namespace["forward"]
    embeddings = vars(module.Glm4vVisionEmbeddings)["forward"].__wrapped_upstream__
    fake = types.SimpleNamespace(
        __name__=module.__name__,
        Glm4vVisionEmbeddings=type(module.Glm4vVisionEmbeddings.__name__, (), {"forward": embeddings}),
        Glm4vVisionTransformer=type(module.Glm4vVisionTransformer.__name__, (), {"forward": forward}))
    with pytest.raises(TargetMismatch, match="in that order"):
        families.COPY_THEN_TOLIST.check(fake, FamilyContext(PATCH_NAME))


STRICT_CODE = """
import json, npu_shim
from npu_shim.patches._shared.source_edit import ReplaceExpression
from npu_shim.patches.vllm.glm4_1v_host_lengths import families
# as if the installed embeddings had another statement there
families.HOST_LENGTHS = (ReplaceExpression("h_coords.cuda()", "h_coords"),)
from npu_shim.testing import towers
m = towers.setup().modules["GLM-4.1V"]
row = next(r for r in npu_shim.status() if r["name"] == %r)
print(json.dumps([row["state"], row["reason"], hasattr(m.Glm4vVisionEmbeddings.forward, "__wrapped_upstream__")]))
""" % PATCH_NAME


@pytest.mark.claimed(PATCH_NAME, per_family=True)
@pytest.mark.parametrize("strict", ["0", "1"])
def test_a_mismatch_inside_the_window_skips_or_raises_in_strict_mode(stack, strict):
    if not applies():
        pytest.skip("vLLM %s is outside the window: no family is asked" % vllm_minor())
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, NPU_SHIM_STRICT=strict)
    env.pop("NPU_SHIM_DISABLE", None)
    proc = subprocess.run([sys.executable, "-P", "-c", STRICT_CODE], env=env, capture_output=True, text=True,
                          timeout=300)
    if strict == "1":
        assert proc.returncode != 0
        assert "PatchError" in proc.stderr and "h_coords.cuda()" in proc.stderr, proc.stderr[-2000:]
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        state, reason, patched = json.loads(proc.stdout.strip().splitlines()[-1])
        assert state == "skipped" and "found 0 times" in reason and not patched, (state, reason)


@pytest.mark.claimed(PATCH_NAME, per_family=True)
def test_disable_switch(stack):
    from npu_shim.testing import towers

    assert towers.state_with_disabled(PATCH_NAME) == "disabled"
