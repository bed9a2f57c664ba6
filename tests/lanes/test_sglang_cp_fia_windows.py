"""Where ``sglang.cp_fia`` applies: the skip reason on each released sglang a lane pins.

The check reads the installed code, not the version (see the patch module's
docstring); these tests import the real target through npu-shim's import hook
and read the outcome from ``npu_shim.status()``:

* 0.5.11, 0.5.12: the method has the single-sequence shape and so does the
  metadata (scalar CP lengths) -- correct for the one sequence its CP admits,
  skipped;
* 0.5.13-0.5.22: fixed upstream (PR 26705), skipped (from 0.5.20 the old
  ContextParallelMetadata is gone from cp_utils; the method is unchanged);
* 0.5.23: the method is a closure run by the CP strategy object, skipped.

The broken window (new metadata, old method), where the patch applies, is
tested in test_sglang_cp_fia.py.
"""
import dataclasses
import importlib

import pytest

from npu_shim.patch import FamilyContext

pytestmark = [pytest.mark.claimed("sglang.cp_fia", window=True),   # every lane inside the window
              pytest.mark.patch("sglang.cp_fia")]

TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"


# Which reason a release's code gives, by the releases that had that code (a test whose subject
# is a release's code names the release in its marker; tests/conftest.py): the single-sequence
# method before PR 26705, the fixed method from its release, the CP strategy from 0.5.23 on.
BY_RELEASE = [
    pytest.param("single-sequence", id="single-sequence",
                 marks=pytest.mark.claimed("sglang.cp_fia", window=True, pinned={"sglang": "<0.5.13"})),
    pytest.param("fixed", id="fixed",
                 marks=pytest.mark.claimed("sglang.cp_fia", window=True, pinned={"sglang": ">=0.5.13,<0.5.23"})),
    pytest.param("strategy", id="strategy",
                 marks=pytest.mark.claimed("sglang.cp_fia", window=True, pinned={"sglang": ">=0.5.23"})),
]


def _reason(shape):
    from npu_shim.patches.sglang import cp_fia as patch

    return {"single-sequence": patch.SINGLE_SEQUENCE_ONLY, "fixed": patch.FIXED_UPSTREAM,
            "strategy": patch.STRATEGY_REWRITE}[shape]


def upstream_method(module):
    """Upstream's do_cp_attn_fia, read back through uninstall where another patch owns the slot
    (sglang.cp_pad_gather on 0.5.16-0.5.19, sglang.cp_fia_host_lengths on 0.5.23)."""
    import npu_shim

    method = module.AscendAttnBackend.__dict__["do_cp_attn_fia"]
    if not hasattr(method, "__npu_shim_patch__"):
        return method
    npu_shim.uninstall()
    try:
        return module.AscendAttnBackend.__dict__["do_cp_attn_fia"]
    finally:
        npu_shim.install()


@pytest.fixture(scope="module")
def module():
    import npu_shim
    from npu_shim import emulation

    emulation.install()
    npu_shim.install()
    return importlib.import_module(TARGET)


@pytest.mark.parametrize("shape", BY_RELEASE)
def test_patch_is_skipped_with_the_reason_for_this_release(module, shape):
    import npu_shim
    from npu_shim.patch import NotNeeded
    from npu_shim.patches.sglang import cp_fia as patch

    row = next(r for r in npu_shim.status() if r["name"] == patch.PATCH.name)
    reason = _reason(shape)
    assert (row["state"], row["reason"]) == ("skipped", reason), row
    method = module.AscendAttnBackend.__dict__["do_cp_attn_fia"]
    # sglang.cp_pad_gather (0.5.16-0.5.19) or sglang.cp_fia_host_lengths (0.5.23) may own the
    # method; sglang.cp_fia never does here. Its check reads upstream's method.
    assert getattr(method, "__npu_shim_patch__", None) in (None, "sglang.cp_pad_gather",
                                                           "sglang.cp_fia_host_lengths")
    upstream = upstream_method(module)
    assert upstream.__module__ == TARGET and not hasattr(upstream, "__npu_shim_patch__")
    npu_shim.uninstall()
    try:
        with pytest.raises(NotNeeded) as raised:
            patch.check(module, FamilyContext(patch.PATCH.name))
    finally:
        npu_shim.install()
    assert str(raised.value) == reason


@pytest.mark.parametrize("shape", BY_RELEASE)
def test_the_check_reads_what_this_release_has(module, shape):
    """The facts behind each reason, read from the installed code."""
    from npu_shim.patches.sglang import cp_fia as patch

    names = patch.code_names(upstream_method(module))
    if shape == "strategy":
        assert names & patch.STRATEGY_NAMES
        assert not names & (patch.SINGLE_SEQUENCE_NAMES - {"chunk"})
        return
    from sglang.srt.layers.utils import cp_utils

    if shape == "fixed":
        assert patch.FIXED_NAMES <= names and "chunk" not in names
        if not hasattr(cp_utils, "ContextParallelMetadata"):     # 0.5.20-0.5.22: cp_utils is stubs
            return
    fields = {f.name for f in dataclasses.fields(cp_utils.ContextParallelMetadata)}
    if shape == "single-sequence":
        assert patch.SINGLE_SEQUENCE_NAMES <= names and not names & patch.FIXED_NAMES
        assert patch.SCALAR_FIELDS <= fields and not fields & patch.PER_SEQUENCE_FIELDS
    else:
        assert patch.FIXED_NAMES <= names and "chunk" not in names
        assert patch.PER_SEQUENCE_FIELDS <= fields and not fields & patch.SCALAR_FIELDS
