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

from mm_merge_310p_case import HIDDEN, ROWS, SOC_310P, SPANS  # noqa: E402  (tests/lanes/conftest.py)


@pytest.fixture(scope="module")
def utils():
    import mm_merge_310p_case

    return mm_merge_310p_case.setup()


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
    from npu_shim.engine import counters

    before = counters.snapshot().get(NAME, counters.empty_row())
    merged, syncs = run(getattr(utils, FUNCTION), inputs, embeddings, mask,
                        mask_on_device=mask_on_device, defect=True)
    after = counters.snapshot()[NAME]
    assert isinstance(merged, torch.Tensor), repr(merged)
    assert merged.dtype == torch.float16
    assert torch.equal(merged, expected)
    print("device->host reads, %s: upstream (A2) %s -> shim (310P) %s"
          % ("device mask" if mask_on_device else "host mask", upstream_syncs.summary(), syncs.summary()))
    # nonzero of a device mask reads its size back, as upstream's index_put_ does; a host mask: none
    assert syncs.count == upstream_syncs.count == (1 if mask_on_device else 0), syncs.summary()
    assert syncs.h2d_count == 0, syncs.summary()
    # the patch's own counters (npu_shim.stats) say the same: a device mask (the stand-in's
    # cpu:0 is not the host, host_data.is_host) is one read, the shim's and upstream's
    assert [after[e] - before[e] for e in ("host_copies", "upstream_host_copies")] == [syncs.count] * 2, after


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


def by_name_holders(utils):
    """vLLM's model modules, already imported, that imported the function by name."""
    return {name: vars(module)[FUNCTION] for name, module in list(sys.modules.items())
            if name.startswith("vllm.model_executor.models.") and name != TARGET
            and FUNCTION in vars(module)}


def test_the_models_merge_with_the_patched_function(utils, soc):
    """vLLM's model modules import the function by name at their top (Qwen3-VL's deepstack merge
    among them where it has one): what they hold merges on 310P through the shim's path. A module
    imported before an uninstall/install cycle (another test file's) holds the first replacement,
    which defers to the one in place: same rows, counted as the shim's calls."""
    import torch

    import npu_shim

    holders = by_name_holders(utils)
    assert holders, "no vLLM model module imported the function"
    assert all(getattr(f, "__wrapped_upstream__", None) is upstream_of(utils) for f in holders.values()), \
        sorted(name for name, f in holders.items() if not hasattr(f, "__wrapped_upstream__"))
    inputs, embeddings, mask = case(torch.float16)
    soc("A2")
    expected, _ = run(upstream_of(utils), inputs, embeddings, mask, mask_on_device=False, defect=False)
    soc("310P")
    for name, function in sorted(holders.items()):
        before = npu_shim.stats()[NAME]["calls"]
        got, syncs = run(function, inputs, embeddings, mask, mask_on_device=False, defect=True)
        assert isinstance(got, torch.Tensor) and torch.equal(got, expected), (name, got)
        assert npu_shim.stats()[NAME]["calls"] == before + 1 and syncs.count == 0, name


def test_uninstall_reaches_the_modules_that_imported_the_function(utils, soc):
    """After ``npu_shim.uninstall()`` a by-name holder runs upstream's function (on an emulated 310P
    the defect then fails it, as it does upstream); ``install()`` brings the shim's path back."""
    import torch

    import npu_shim

    holders = by_name_holders(utils)
    name, function = sorted(holders.items())[0]
    upstream = upstream_of(utils)
    inputs, embeddings, mask = case(torch.float16)
    soc("310P")
    try:
        npu_shim.uninstall()
        assert getattr(utils, FUNCTION) is upstream
        failed, _ = run(function, inputs, embeddings, mask, mask_on_device=False, defect=True)
        assert isinstance(failed, ValueError) and "507018" in str(failed.__cause__), (name, repr(failed))
    finally:
        npu_shim.install()
    row = next(r for r in npu_shim.status() if r["name"] == NAME)
    assert row["state"] == "applied", row
    merged, _ = run(function, inputs, embeddings, mask, mask_on_device=False, defect=True)
    assert isinstance(merged, torch.Tensor), (name, repr(merged))


def test_the_check_says_not_needed_for_masked_scatter(utils):
    """The releases before the window merge with masked_scatter_ (no IndexPut)."""
    import types

    from npu_shim.patch import FamilyContext, NotNeeded
    from npu_shim.patches.vllm.mm_merge_310p.families import BOOLEAN_MASK_ASSIGNMENT

    def _merge_multimodal_embeddings(inputs_embeds, multimodal_embeddings, is_multimodal):
        flat = _flatten_embeddings(multimodal_embeddings)  # noqa: F821
        inputs_embeds.masked_scatter_(is_multimodal.unsqueeze(-1), flat)
        return _embedding_count_expression(multimodal_embeddings)  # noqa: F821

    older = types.SimpleNamespace(__name__="older", _merge_multimodal_embeddings=_merge_multimodal_embeddings,
                                  _flatten_embeddings=utils._flatten_embeddings,
                                  _embedding_count_expression=utils._embedding_count_expression)
    with pytest.raises(NotNeeded):
        BOOLEAN_MASK_ASSIGNMENT.check(older, FamilyContext(NAME))
    BOOLEAN_MASK_ASSIGNMENT.check(types.SimpleNamespace(
        __name__=TARGET, _merge_multimodal_embeddings=upstream_of(utils),
        _flatten_embeddings=utils._flatten_embeddings,
        _embedding_count_expression=utils._embedding_count_expression), FamilyContext(NAME))



def test_selftest_on_310p(utils, soc):
    """The declared selftest, on an emulated 310P: the shim's path, float16, exact against the
    float64 merge, no read back (host mask), the emulated IndexPut defect armed."""
    from npu_shim.selftest import run_one

    soc("310P")
    result = run_one(NAME, device="cpu")
    assert result["ok"], result["verdict"]
    assert (result["case"], result["expected_host_syncs"], result["host_syncs"]) == ("310P", 0, 0), result
    assert result["error"] == 0.0 and result["error_measure"] == "max_abs_err", result
    assert "float16" in result["detail"] and "defect armed" in result["detail"], result["detail"]


def test_selftest_on_a2(utils, soc):
    """On an A2 the selftest runs too (the patch applies on every NPU): upstream's path, same rows."""
    from npu_shim.selftest import run_one

    soc("A2")
    result = run_one(NAME, device="cpu")
    assert result["ok"], result["verdict"]
    assert (result["case"], result["host_syncs"]) == ("A2/A3", 0), result
    assert "upstream's boolean-mask assignment" in result["detail"], result["detail"]


def test_selftest_fails_when_the_310p_path_reads_back(utils, soc, monkeypatch):
    """The verdict is not fooled by right numbers: with the selftest's mask standing for a
    device tensor, the merge reads the positions back (nonzero's size), computes the same
    rows, and the selftest fails on its reads."""
    import npu_shim.testing
    from npu_shim.selftest import run_one, vllm_mm_merge_310p as selftest

    real_case, real_count = selftest.case, npu_shim.testing.count_host_syncs
    masks = []

    def recording_case(device, dtype):
        inputs, embeddings, mask = real_case(device, dtype)
        masks.append(mask)
        return inputs, embeddings, mask

    def mask_on_device(device_tensors=(), **kwargs):
        return real_count(list(device_tensors) + masks[-1:], **kwargs)

    monkeypatch.setattr(selftest, "case", recording_case)
    monkeypatch.setattr(npu_shim.testing, "count_host_syncs", mask_on_device)
    soc("310P")
    result = run_one(NAME, device="cpu")
    assert masks, "the selftest did not build its case through case()"
    assert result["error"] == 0.0 and result["host_syncs"] == 1, result
    assert not result["ok"] and result["failed"] == ["reads"], result
