"""Patch ``vllm.mm_merge_310p`` on vLLM's own ``_merge_multimodal_embeddings``.

The defect is reproduced, not assumed: :func:`npu_shim.emulation.index_put.aicpu_index_put_defect`
makes a boolean-mask ``index_put_`` on a device stand-in fail on an emulated 310P, as the
aicpu IndexPut kernel does on the hardware (vllm-ascend #12086; PR #12914's table: mask on
the NPU or on the CPU fails). Upstream's function then fails, the patched one merges, and
its output is ``torch.equal`` to upstream's where upstream runs (an A2: no defect).
Embeddings are float16, the dtype 310P models run; the A2 pass-through runs bfloat16.

On this CPU-only machine the embeddings (and, for a device mask, the mask) stand in for
device tensors (``count_host_syncs(..., follow_placement=True)``): the reads counted are
those an NPU would make.
"""
import sys

import pytest

from npu_shim.patches.vllm.mm_merge_310p import FUNCTION, NAME, PATCH, TARGET

pytestmark = [pytest.mark.claimed(NAME), pytest.mark.patch(NAME)]

SOC_310P = "Ascend310P3"
HIDDEN = 64
SPANS = ((2, 5), (9, 13))          # two items: 3 and 4 placeholder rows in 16
ROWS = 16


@pytest.fixture(scope="module")
def utils():
    from npu_shim.testing import towers

    towers.setup()                  # emulation first, then the shim, then vLLM's modules
    import torch_npu  # noqa: F401  (a vllm-ascend worker has it imported; the patch asks it the SoC)

    return sys.modules[TARGET]


@pytest.fixture
def soc(monkeypatch):
    def set_soc(device_class):
        if device_class == "310P":
            monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", SOC_310P)
        else:
            monkeypatch.delenv("NPU_SHIM_EMULATE_SOC", raising=False)
    return set_soc


def case(dtype, spans=SPANS, rows=ROWS, items=None, seed=0):
    import torch

    gen = torch.Generator().manual_seed(seed)
    mask = torch.zeros(rows, dtype=torch.bool)
    for start, stop in spans:
        mask[start:stop] = True
    sizes = items if items is not None else [stop - start for start, stop in spans]
    embeddings = [torch.randn(n, HIDDEN, generator=gen).to(dtype) for n in sizes]
    inputs = torch.randn(rows, HIDDEN, generator=gen).to(dtype)
    return inputs, embeddings, mask


def run(function, inputs, embeddings, mask, *, mask_on_device, defect):
    """``function`` on a copy of ``inputs``: (result or exception, counter)."""
    from npu_shim.emulation.index_put import aicpu_index_put_defect
    from npu_shim.testing import count_host_syncs

    inputs = inputs.clone()
    stand_ins = [inputs, *embeddings] + ([mask] if mask_on_device else [])
    with count_host_syncs(device_tensors=stand_ins, follow_placement=True) as syncs:
        try:
            if defect:
                with aicpu_index_put_defect(syncs.is_device):
                    out = function(inputs, embeddings, mask)
            else:
                out = function(inputs, embeddings, mask)
        except Exception as exc:         # noqa: BLE001 -- the caller looks at what was raised
            out = exc
    return out, syncs


def upstream_of(utils):
    return getattr(utils, FUNCTION).__wrapped_upstream__


def test_status(utils):
    import npu_shim
    from npu_shim.engine import guards

    row = next(r for r in npu_shim.status() if r["name"] == NAME)
    assert row["state"] == "applied", row
    assert [row["family"]] == guards.admitting_families(PATCH, guards.versions_of(PATCH)), row


@pytest.mark.parametrize("mask_on_device", [False, True], ids=["host mask", "device mask"])
def test_upstream_fails_on_310p_and_the_patch_merges(utils, soc, mask_on_device):
    import torch

    inputs, embeddings, mask = case(torch.float16)
    soc("A2")
    expected, upstream_syncs = run(upstream_of(utils), inputs, embeddings, mask,
                                   mask_on_device=mask_on_device, defect=True)
    assert isinstance(expected, torch.Tensor), expected      # upstream runs on an A2
    soc("310P")
    failed, _ = run(upstream_of(utils), inputs, embeddings, mask, mask_on_device=mask_on_device, defect=True)
    assert isinstance(failed, ValueError) and "507018" in str(failed.__cause__), repr(failed)
    merged, syncs = run(getattr(utils, FUNCTION), inputs, embeddings, mask,
                        mask_on_device=mask_on_device, defect=True)
    assert isinstance(merged, torch.Tensor), repr(merged)
    assert merged.dtype == torch.float16
    assert torch.equal(merged, expected)
    print("device->host reads, %s: upstream (A2) %s -> shim (310P) %s"
          % ("device mask" if mask_on_device else "host mask", upstream_syncs.summary(), syncs.summary()))
    # nonzero of a device mask reads its size back, as upstream's index_put_ does; a host mask: none
    assert syncs.count == upstream_syncs.count == (1 if mask_on_device else 0), syncs.summary()
    assert syncs.h2d_count == 0, syncs.summary()


@pytest.mark.parametrize("items", [[3, 5], [2, 4], [1, 1]], ids=["one too many", "one too few", "two rows"])
def test_a_count_mismatch_raises_upstreams_error(utils, soc, items):
    import torch

    inputs, embeddings, mask = case(torch.float16, items=items)
    soc("A2")
    expected, _ = run(upstream_of(utils), inputs, embeddings, mask, mask_on_device=False, defect=False)
    soc("310P")
    got, syncs = run(getattr(utils, FUNCTION), inputs, embeddings, mask, mask_on_device=False, defect=True)
    assert isinstance(expected, ValueError), repr(expected)
    assert type(got) is ValueError and str(got) == str(expected), (repr(got), repr(expected))
    assert syncs.count == 0, syncs.summary()


def test_one_row_broadcasts_as_upstreams_assignment_does(utils, soc):
    import torch

    inputs, embeddings, mask = case(torch.float16, items=[1])
    soc("A2")
    expected, _ = run(upstream_of(utils), inputs, embeddings, mask, mask_on_device=False, defect=False)
    soc("310P")
    got, _ = run(getattr(utils, FUNCTION), inputs, embeddings, mask, mask_on_device=False, defect=True)
    assert isinstance(expected, torch.Tensor) and torch.equal(got, expected)


def test_no_embeddings_leaves_the_input_alone(utils, soc):
    import torch

    inputs, _, mask = case(torch.float16)
    soc("310P")
    got, syncs = run(getattr(utils, FUNCTION), inputs, [], mask, mask_on_device=False, defect=True)
    assert torch.equal(got, inputs) and syncs.count == 0


def test_a2_keeps_upstreams_path(utils, soc):
    import torch

    import npu_shim

    inputs, embeddings, mask = case(torch.bfloat16)
    soc("A2")
    before = npu_shim.stats()[NAME]
    got, _ = run(getattr(utils, FUNCTION), inputs, embeddings, mask, mask_on_device=False, defect=True)
    expected, _ = run(upstream_of(utils), inputs, embeddings, mask, mask_on_device=False, defect=True)
    after = npu_shim.stats()[NAME]
    assert torch.equal(got, expected)
    assert after["upstream_calls"] == before["upstream_calls"] + 1
    assert after["calls"] == before["calls"]


HOLDERS_CODE = """
import json, sys
from npu_shim.testing import towers
towers.setup()                  # as a worker starts: the shim, then vLLM's model modules
utils = sys.modules[%r]
patched = getattr(utils, %r)
holders = {name: vars(module)[%r] is patched for name, module in list(sys.modules.items())
           if name.startswith("vllm.model_executor.models.") and name != %r and %r in vars(module)}
print(json.dumps(holders))
""" % (TARGET, FUNCTION, FUNCTION, TARGET, FUNCTION)


def test_the_models_merge_with_the_patched_function(run_python):
    """vLLM's model modules import the function by name at their top; imported after the
    target, they hold the replacement (Qwen3-VL's deepstack merge among them where it has one).
    In a fresh interpreter: in this one, earlier tests import the models before reinstalling."""
    import json

    holders = json.loads(run_python(HOLDERS_CODE, timeout=600).stdout.strip().splitlines()[-1])
    assert holders, "no vLLM model module imported the function"
    assert all(holders.values()), holders


def test_the_check_says_not_needed_for_masked_scatter(utils):
    """The releases before the window merge with masked_scatter_ (no IndexPut)."""
    import types

    from npu_shim.patch import NotNeeded
    from npu_shim.patches.vllm.mm_merge_310p.families import BOOLEAN_MASK_ASSIGNMENT

    def _merge_multimodal_embeddings(inputs_embeds, multimodal_embeddings, is_multimodal):
        flat = _flatten_embeddings(multimodal_embeddings)  # noqa: F821
        inputs_embeds.masked_scatter_(is_multimodal.unsqueeze(-1), flat)
        return _embedding_count_expression(multimodal_embeddings)  # noqa: F821

    older = types.SimpleNamespace(__name__="older", _merge_multimodal_embeddings=_merge_multimodal_embeddings,
                                  _flatten_embeddings=utils._flatten_embeddings,
                                  _embedding_count_expression=utils._embedding_count_expression)
    with pytest.raises(NotNeeded):
        BOOLEAN_MASK_ASSIGNMENT.check(older)
    BOOLEAN_MASK_ASSIGNMENT.check(types.SimpleNamespace(
        __name__=TARGET, _merge_multimodal_embeddings=upstream_of(utils),
        _flatten_embeddings=utils._flatten_embeddings,
        _embedding_count_expression=utils._embedding_count_expression))

