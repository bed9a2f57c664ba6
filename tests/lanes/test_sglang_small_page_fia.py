"""Patch ``sglang.small_page_fia`` on the real sglang wheels (lanes sglang-0.5.12-0.5.22, latest-sglang; 0.5.11 skips).

What is and is not shown here: the emulation computes what the torch_npu
documentation says, so it cannot show the hardware bug of
``_npu_flash_attention_qlens`` at page sizes below 128 (sglang issue #38196,
PR #39905: evidence from CANN 9.0 / A3). What is tested is the dispatch, on
upstream's own ``forward_extend`` (sglang_support/prefill_case.py lists what is
real):

* page sizes 16, 32, 64: the call goes through sglang's FIA prefill branch --
  the same single ``npu_fused_infer_attention_score`` call, with the same
  arguments and a bit-identical result, as upstream's ``forward_extend`` with
  ``ASCEND_USE_FIA=1`` -- and matches the float64 causal reference (cached
  prefixes, GQA, shuffled pages, float16);
* page sizes 128, 256, and 8, 24 (not multiples of 16, which FIA's block_size must be):
  upstream's ``_npu_flash_attention_qlens`` call, with the
  arguments upstream passes (recorded, not run, with ``recorded_not_run``: the
  emulated qlens op refuses block sizes other than 128, as op-plugin's own test
  expects of the op; its math is tested in tests/test_emulation_qlens.py);
* ``ASCEND_USE_FIA`` set explicitly (0 or 1) is respected;
* uninstall restores upstream's method; switched off
  (``NPU_SHIM_SGLANG_SMALL_PAGE_FIA=0``) the patch is "disabled" and the method
  is upstream's; strict mode raises when the check cannot read the method;
* 0.5.11 (outside the window): skipped, and the reason shown -- its own FIA
  prefill branch is right without a cached prefix and wrong with one.
"""
import json
import os

import pytest

import npu_shim

pytestmark = [pytest.mark.claimed("sglang.small_page_fia"),
              pytest.mark.patch("sglang.small_page_fia")]

from sglang_support import prefill_case, shim  # noqa: E402  (tests/lanes/conftest.py)

from npu_shim.testing import cp_case  # noqa: E402
from npu_shim.testing.claims import claimed_family  # noqa: E402

TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
POOL = "sglang.srt.hardware_backend.npu.memory_pool_npu"
NAME = "sglang.small_page_fia"
FIA, QLENS = "npu_fused_infer_attention_score", "_npu_flash_attention_qlens"


@pytest.fixture(scope="module")
def modules():
    return shim.install(TARGET, POOL)


@pytest.fixture(scope="module")
def methods(modules):
    """(upstream's forward_extend, the shim's), upstream's read back through uninstall."""
    import npu_shim

    from npu_shim.patches._shared.structure import replacement_of

    slot = modules[0].AscendAttnBackend.__dict__
    patched = slot["forward_extend"]
    # sglang.npu_decode_v_head_dim wraps this patch's forward_extend (its sink prefill of V != K layers)
    assert replacement_of(patched, NAME) is not None
    npu_shim.uninstall()
    upstream = slot["forward_extend"]
    npu_shim.install()
    assert slot["forward_extend"] is not upstream and replacement_of(slot["forward_extend"], NAME) is not None
    return upstream, slot["forward_extend"]


@pytest.fixture(autouse=True)
def sglang_fia_unset(monkeypatch):
    monkeypatch.delenv("ASCEND_USE_FIA", raising=False)


def _prefill(modules, method, spec, use_fia=None):
    """(output, recorded NPU calls, batch) of one prefill of ``spec`` through ``method``."""
    import torch_npu

    from npu_shim.testing import record_npu_calls, recorded_not_run

    batch = cp_case.make_batch(spec)
    backend, layer, forward_batch, q, k, v = prefill_case.prefill_inputs(*modules, batch)
    if use_fia is not None:
        backend.use_fia = use_fia
    with recorded_not_run(torch_npu, QLENS), record_npu_calls() as calls:
        out = method(backend, q, k, v, layer, forward_batch, save_kv_cache=False)
    return out, calls, batch


def _same_arguments(a, b):
    """Equal arguments; ``out`` (allocated with torch.empty, filled by the op) by shape and dtype."""
    import torch

    assert sorted(a.kwargs) == sorted(b.kwargs) and len(a.args) == len(b.args)
    out_a, out_b = a.kwargs.get("out"), b.kwargs.get("out")
    if out_a is not None:
        assert (out_a.shape, out_a.dtype) == (out_b.shape, out_b.dtype)
    named = [(a.kwargs[key], b.kwargs[key]) for key in a.kwargs if key != "out"]
    for x, y in list(zip(a.args, b.args)) + named:
        if isinstance(x, torch.Tensor):
            assert isinstance(y, torch.Tensor) and x.shape == y.shape and torch.equal(x, y)
        elif hasattr(x, "tolist"):   # numpy cumulative lengths
            assert list(x.tolist()) == list(y.tolist())
        else:
            assert x == y


def test_applies_with_the_family_of_this_release(modules):
    import npu_shim
    from npu_shim.engine import counters

    row = next(r for r in npu_shim.status() if r["name"] == NAME)
    version = row["versions"]["sglang"]
    assert row["state"] == "applied", row
    assert npu_shim.stats()[NAME]["family"] == claimed_family(NAME).name


@pytest.mark.claimed(NAME, outside="below")   # the release just below the window
def test_skipped_on_0_5_11_whose_fia_prefill_ignores_the_kv_cache(modules):
    """0.5.11 has the qlens/FIA split, but its FIA branch attends to the new tokens only."""
    from npu_shim.testing import record_npu_calls

    row = next(r for r in npu_shim.status() if r["name"] == NAME)
    assert row["state"] == "skipped" and row["reason"].startswith("sglang 0.5.11 is outside >=0.5.12"), row
    assert "ignores the paged KV cache" in row["reason"]
    upstream = modules[0].AscendAttnBackend.__dict__["forward_extend"]
    assert not hasattr(upstream, "__npu_shim_patch__") and upstream.__module__ == TARGET
    errors = []
    for prefixes in ((0, 0), (0, 16)):
        spec = cp_case.Spec(extend_lens=(37, 20), prefix_lens=prefixes, page_size=16, num_heads=8,
                            num_kv_heads=2, qk_head_dim=128, v_head_dim=128, seed=1)
        batch = cp_case.make_batch(spec)
        backend, layer, forward_batch, q, k, v = prefill_case.prefill_inputs(*modules, batch)
        backend.use_fia = True           # upstream's FIA prefill branch, as with ASCEND_USE_FIA=1
        with record_npu_calls() as calls:   # k/v as RadixAttention passes them: (tokens, heads, dim)
            out = upstream(backend, q, k.view(-1, spec.num_kv_heads, spec.qk_head_dim),
                           v.view(-1, spec.num_kv_heads, spec.v_head_dim), layer, forward_batch,
                           save_kv_cache=False)
        assert [c.name for c in calls] == [FIA] * len(spec.extend_lens)      # one BSND call per sequence
        assert all(c.kwargs["input_layout"] == "BSND" and "block_table" not in c.kwargs for c in calls)
        errors.append(cp_case.max_abs_err(out, prefill_case.expected(batch)))
    tolerance = cp_case.tolerance(spec.dtype)
    # right without a cached prefix; with one, off by more than 1 on N(0, 1) data (3.4 measured in
    # bfloat16): attention to the wrong keys, not rounding (the tolerance is 3e-2)
    assert errors[0] <= tolerance and errors[1] > 1.0, errors


SMALL = [
    cp_case.Spec(extend_lens=(37, 20, 29), prefix_lens=(0, 16, 5), page_size=16, num_heads=8,
                 num_kv_heads=2, qk_head_dim=128, v_head_dim=128, seed=1),
    cp_case.Spec(extend_lens=(70, 9), prefix_lens=(33, 0), page_size=32, num_heads=4, num_kv_heads=4,
                 qk_head_dim=128, v_head_dim=128, seed=2),
    cp_case.Spec(extend_lens=(45, 130), prefix_lens=(64, 3), page_size=64, num_heads=8, num_kv_heads=1,
                 qk_head_dim=128, v_head_dim=128, seed=3),
]


def _half(spec):
    import dataclasses

    import torch

    return dataclasses.replace(spec, dtype=torch.float16, seed=spec.seed + 10)


@pytest.mark.parametrize("spec", SMALL + [_half(SMALL[0])], ids=lambda s: s.label())
def test_small_pages_go_through_sglangs_fia_path(modules, methods, spec):
    import torch

    upstream, patched = methods
    out, calls, batch = _prefill(modules, patched, spec)
    assert [c.name for c in calls] == [FIA]
    call = calls[0]
    assert call.kwargs["block_size"] == spec.page_size and call.kwargs["input_layout"] == "TND"
    expected = prefill_case.expected(batch)
    assert cp_case.max_abs_err(out, expected) <= cp_case.tolerance(spec.dtype)
    # exactly what upstream itself does with ASCEND_USE_FIA=1
    fia_out, fia_calls, _ = _prefill(modules, upstream, spec, use_fia=True)
    assert [c.name for c in fia_calls] == [FIA]
    _same_arguments(fia_calls[0], call)
    assert torch.equal(out, fia_out)
    # and what upstream does without it: the legacy op (wrong there on hardware)
    _, up_calls, _ = _prefill(modules, upstream, spec)
    assert [c.name for c in up_calls] == [QLENS]


@pytest.mark.parametrize("page_size", [128, 256])
def test_pages_of_128_and_more_keep_the_qlens_call(modules, methods, page_size):
    upstream, patched = methods
    spec = cp_case.Spec(extend_lens=(37, 200), prefix_lens=(0, 130), page_size=page_size, num_heads=8,
                        num_kv_heads=2, qk_head_dim=128, v_head_dim=128, seed=page_size)
    _, calls, _ = _prefill(modules, patched, spec)
    _, up_calls, _ = _prefill(modules, upstream, spec)
    assert [c.name for c in calls] == [c.name for c in up_calls] == [QLENS]
    _same_arguments(up_calls[0], calls[0])


@pytest.mark.parametrize("page_size", [8, 24])
def test_pages_that_are_not_multiples_of_16_keep_the_qlens_call(modules, methods, page_size):
    """FIA takes the page size as its block_size, a multiple of 16 without quantisation (sglang
    #25169, PR #29815): such pages keep upstream's qlens call, and status says why. Upstream's own
    FIA branch (ASCEND_USE_FIA=1) fails there in the emulated op, as the op does."""
    from npu_shim.testing.claims import status_row

    upstream, patched = methods
    spec = cp_case.Spec(extend_lens=(37, 20), prefix_lens=(0, 16), page_size=page_size, num_heads=8,
                        num_kv_heads=2, qk_head_dim=128, v_head_dim=128, seed=page_size)
    _, calls, _ = _prefill(modules, patched, spec)
    _, up_calls, _ = _prefill(modules, upstream, spec)
    assert [c.name for c in calls] == [c.name for c in up_calls] == [QLENS]
    _same_arguments(up_calls[0], calls[0])
    assert "page size %d is not a multiple of 16: FIA's block_size must be" % page_size in \
        " ".join(status_row(NAME)["notes"])
    with pytest.raises(ValueError, match="block_size should aligned to 16, but got %d" % page_size):
        _prefill(modules, upstream, spec, use_fia=True)


@pytest.mark.parametrize("value, expected_op", [("0", QLENS), ("false", QLENS), ("1", FIA)])
def test_explicit_ascend_use_fia_is_respected(modules, methods, monkeypatch, value, expected_op):
    _, patched = methods
    monkeypatch.setenv("ASCEND_USE_FIA", value)
    _, calls, _ = _prefill(modules, patched, SMALL[0])   # page 16; backend.use_fia read as sglang reads it
    assert [c.name for c in calls] == [expected_op]


def test_calls_it_does_not_route_reach_upstream_unchanged(modules, methods):
    """A head dim above 128 never reaches qlens upstream (native SDPA path): left alone."""
    import dataclasses

    upstream, patched = methods
    spec = dataclasses.replace(SMALL[0], qk_head_dim=192, v_head_dim=192)
    batch = cp_case.make_batch(spec)
    backend, layer, forward_batch, q, k, v = prefill_case.prefill_inputs(*modules, batch)
    family = claimed_family(NAME).load()     # the gate object of the family claimed here
    assert not family.reaches_qlens(backend, layer, forward_batch, None, None)
    assert family.reaches_qlens(backend, cp_case.make_layer(SMALL[0]), forward_batch, None, None)
    assert not family.reaches_qlens(backend, cp_case.make_layer(SMALL[0]), forward_batch, None,
                                     sinks=q.new_zeros(spec.num_heads))


def test_uninstall_restores_upstreams_method(modules, methods):
    import npu_shim

    upstream, _ = methods
    assert not hasattr(upstream, "__npu_shim_patch__") and upstream.__module__ == TARGET
    npu_shim.uninstall()
    try:
        assert modules[0].AscendAttnBackend.__dict__["forward_extend"] is upstream
    finally:
        npu_shim.install()


@pytest.mark.claimed(NAME, per_family=True)
def test_switched_off_is_upstream_and_strict_raises_when_unreadable(modules, run_python, make_env):
    placeholders = os.path.join(os.path.dirname(os.path.dirname(__file__)), "placeholders")
    off = run_python(
        "import json, importlib, npu_shim\n"
        "m = importlib.import_module(%r)\n"
        "f = m.AscendAttnBackend.__dict__['forward_extend']\n"
        "rows = {r['name']: [r['state'], r['reason']] for r in npu_shim.status()}\n"
        "cp = m.AscendAttnBackend.__dict__['do_cp_attn_fia']\n"
        "from npu_shim.patches._shared.structure import replacement_of, upstream_of\n"
        "print(json.dumps([rows[%r], rows['sglang.cp_fia_host_lengths'], replacement_of(f, %r) is not None, "
        "upstream_of(f).__module__, hasattr(cp, '__npu_shim_patch__')]))" % (TARGET, NAME, NAME),
        env=make_env(NPU_SHIM_EMULATE="1", NPU_SHIM_SGLANG_SMALL_PAGE_FIA="0",
                     NPU_SHIM_DISABLE="sglang.cp_fia_host_lengths", PYTHONPATH=placeholders), timeout=600)
    row, host_lengths_row, patched, where, cp_patched = json.loads(off.stdout.strip().splitlines()[-1])
    assert row == ["disabled", "NPU_SHIM_SGLANG_SMALL_PAGE_FIA=0"]
    assert (patched, where) == (False, TARGET)
    # sglang.cp_fia_host_lengths, listed in NPU_SHIM_DISABLE: upstream's do_cp_attn_fia where
    # that patch's families claim the release (no other patch owns the method there)
    assert host_lengths_row == ["disabled", "listed in NPU_SHIM_DISABLE"]
    if claimed_family("sglang.cp_fia_host_lengths") is not None:
        assert cp_patched is False

    strict = run_python(
        "import importlib, inspect, npu_shim\n"
        "readable = inspect.getsource\n"
        "def unreadable(obj):\n"   # as in an install without .py files, for this method only
        "    if getattr(obj, '__name__', '') == 'forward_extend':\n"
        "        raise OSError('source not available')\n"
        "    return readable(obj)\n"
        "inspect.getsource = unreadable\n"
        "importlib.import_module(%r)\n" % TARGET,
        env=make_env(NPU_SHIM_EMULATE="1", NPU_SHIM_STRICT="1", PYTHONPATH=placeholders),
        check=False, timeout=600)
    assert strict.returncode != 0
    assert "PatchError" in strict.stderr and NAME in strict.stderr
    assert "cannot read the source of forward_extend" in strict.stderr
