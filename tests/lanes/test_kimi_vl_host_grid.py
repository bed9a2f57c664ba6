"""Patch ``vllm.kimi_vl_host_grid`` (with ``vllm.mm_encoder_attn``): whole MoonViT forwards
with no device->host read.

vLLM's own MoonViT (Kimi-VL's vision tower, ``MoonVitPretrainedModel``) from a
tiny random config (:mod:`npu_shim.testing.towers`), its ``MMEncoderAttention``
layers handed back as vllm-ascend's class of each device class (A2, 310P).
The inputs go the way vLLM hands them to the model: Kimi-VL's processor field
config builds one item per image and vLLM's ``group_and_batch_mm_kwargs``
places them on the device (on this CPU-only machine the stand-in device
``npu_shim.testing.syncs.DEVICE``, placement followed by the counter). Two
forwards with different grids, in ``torch.inference_mode()``.

Gate, per device class: 0 reads for batching plus the whole forward with the
shim; upstream (upstream's field config, the untouched vllm-ascend class)
reads the grid back three times (``tolist``) and more in the attention;
outputs ``torch.equal`` to upstream's (the same ops on the same data), close to
vLLM's own TORCH_SDPA tower and to a float64 copy with
``npu_shim.testing.attention_f64``.
"""

import pytest

pytestmark = [pytest.mark.claimed("vllm.kimi_vl_host_grid"),
              pytest.mark.patch("vllm.kimi_vl_host_grid", "vllm.mm_encoder_attn")]

PATCH_NAME = "vllm.kimi_vl_host_grid"
# |tower - float64 tower| and |tower - TORCH_SDPA tower|, relative to max |float64 tower| (no
# floor); measured worst (vllm-0.18, MoonViT): bfloat16 1.7e-2 (vs SDPA 1.3e-2), float16 1.7e-3 (1.6e-3)
TOWER_TOL = {"bfloat16": 5e-2, "float16": 5e-3}


def claimed():
    """The family whose fence admits the installed vLLM (the declaration's claim)."""
    from npu_shim.testing import claims

    family = claims.claimed_family(PATCH_NAME)
    assert family is not None, "no family of %s claims this vLLM: the lane marker names a lane it has none for" % PATCH_NAME
    return family


def grid_on_host_upstream():
    """Whether vLLM's own field config keeps image_grid_hws on the host (the family that leaves it alone)."""
    from npu_shim.patches.vllm.kimi_vl_host_grid import families

    return claimed().load() is families.HOST_LENGTHS


@pytest.fixture(scope="module")
def stack():
    from npu_shim.testing import towers

    return towers.setup()


def grid_reads(syncs):
    """The reads made in vLLM's moonvit.py (the grid's ``tolist()``; the attention's are elsewhere)."""
    return sum("models/moonvit.py:" in str(event) for event in syncs.events)


def run(stack, tower, attention_class, x, grid, *, upstream_fields):
    import torch

    from npu_shim.testing import count_host_syncs, towers
    from npu_shim.testing.syncs import DEVICE

    with torch.inference_mode(), towers.registered(attention_class):
        with count_host_syncs(device_modules=[tower]) as syncs:
            pixels, grid_hws = towers.kimi_vl_batch(stack, x, grid, device=DEVICE,
                                                    upstream_fields=upstream_fields)
            out = tower(pixels, grid_hws)
    return torch.cat(out), syncs


def test_status(stack):
    import npu_shim

    row = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)
    assert (row["state"], row["family"]) == ("applied", claimed().name), row
    if grid_on_host_upstream():
        module = stack.modules["Kimi-VL model"]            # the forward only: the field config is upstream's
        assert hasattr(module.MoonVitPretrainedModel.forward, "__wrapped_upstream__")
        assert not hasattr(module.KimiVLMultiModalProcessor._get_mm_fields_config, "__wrapped_upstream__")


def test_field_config_keeps_only_the_grid_on_the_host(stack):
    import torch
    from vllm.multimodal.inputs import MultiModalBatchedField

    processor = stack.modules["Kimi-VL model"].KimiVLMultiModalProcessor
    hf_inputs = {"pixel_values": torch.zeros(20, 3, 14, 14), "image_grid_hws": torch.tensor([[4, 4], [2, 2]])}
    if grid_on_host_upstream():
        # upstream's own: the shim leaves it alone
        assert not hasattr(processor._get_mm_fields_config, "__wrapped_upstream__")
        fields = processor._get_mm_fields_config(None, hf_inputs, {})
        assert type(fields["image_grid_hws"].field) is MultiModalBatchedField
        assert fields["image_grid_hws"].field.keep_on_cpu
        return
    ours = processor._get_mm_fields_config(None, hf_inputs, {})
    theirs = processor._get_mm_fields_config.__wrapped_upstream__(None, hf_inputs, {})
    assert set(ours) == set(theirs) == {"pixel_values", "image_grid_hws"}
    assert type(ours["image_grid_hws"].field) is MultiModalBatchedField
    assert ours["image_grid_hws"].field.keep_on_cpu and not theirs["image_grid_hws"].field.keep_on_cpu
    assert ours["image_grid_hws"].modality == theirs["image_grid_hws"].modality == "image"
    assert ours["pixel_values"] == theirs["pixel_values"]


def test_whole_moonvit_forward_reads_nothing_back(stack, device_class):
    import torch

    from npu_shim.testing import towers

    patched = towers.build_moonvit(stack, stack.attention[device_class])
    upstream = towers.build_moonvit(stack, stack.upstream[device_class])
    sdpa = towers.build_moonvit(stack, None)
    for forward in range(2):
        grid = towers.moonvit_grid(forward)
        x = towers.moonvit_pixel_values(patched, grid, seed=forward)
        out, syncs = run(stack, patched, stack.attention[device_class], x, grid, upstream_fields=False)
        up, up_syncs = run(stack, upstream, stack.upstream[device_class], x, grid, upstream_fields=True)
        sd, _ = run(stack, sdpa, None, x, grid, upstream_fields=False)
        print("Kimi-VL %s forward %d: upstream %s -> shim %s" % (device_class, forward, up_syncs.summary(),
                                                                 syncs.summary()))
        assert syncs.count == 0, [str(e) for e in syncs.events]
        host_grid = grid_on_host_upstream()
        # upstream's grid_hws.tolist() (position embedding, rope, patch_merger) where the grid is on the device
        assert (grid_reads(up_syncs) > 0) != host_grid, [str(e) for e in up_syncs.events]
        assert up_syncs.count > grid_reads(up_syncs), up_syncs.summary()      # and the attention's read(s)
        # a host grid costs one blocking copy: upstream's (h*w).to(device) in MoonVitEncoder.forward
        # (upstream's own from 0.29.0, where the grid is on the host anyway)
        assert syncs.h2d_count == up_syncs.h2d_count + (0 if host_grid else 1), (syncs.summary(),
                                                                                up_syncs.summary())
        assert torch.equal(out, up)
        ref = towers.moonvit_reference_forward(stack, x, grid)
        towers.assert_near_references("tower MoonViT", out, ref, sd, TOWER_TOL)


def test_a_device_grid_runs_upstreams_path(stack):
    """Upstream's field config (the grid on the device): the patched forward hands it to
    upstream's untouched, the same reads as the untouched class with the same attention."""
    import torch

    from npu_shim.testing import count_host_syncs, towers
    from npu_shim.testing.syncs import DEVICE

    tower = towers.build_moonvit(stack, stack.attention["A2"])
    grid = towers.moonvit_grid(0)
    x = towers.moonvit_pixel_values(tower, grid)
    forward = type(tower).forward
    results = []
    for call in (forward, forward.__wrapped_upstream__):
        with torch.inference_mode(), towers.registered(stack.attention["A2"]), \
                count_host_syncs(device_modules=[tower]) as syncs:
            pixels, grid_hws = towers.kimi_vl_batch(stack, x, grid, device=DEVICE, upstream_fields=True)
            if grid_on_host_upstream():
                grid_hws = grid_hws.to(DEVICE, non_blocking=True)    # as vLLM before 0.29.0 places it
            results.append((torch.cat(call(tower, pixels, grid_hws)), syncs.count, syncs.kinds(),
                            grid_reads(syncs)))
    assert results[0][1:] == results[1][1:] and results[0][3] > 0, results
    assert torch.equal(results[0][0], results[1][0])
    assert not any(h._forward_pre_hooks for h in tower.encoder.blocks)          # nothing left behind


@pytest.mark.claimed(PATCH_NAME, per_family=True)
def test_disable_switch(stack):
    from npu_shim.testing import towers

    assert towers.state_with_disabled(PATCH_NAME) == "disabled"
