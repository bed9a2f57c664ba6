"""Patch ``sglang.cp_fia`` on the real sglang 0.5.13 wheel (lane sglang-0.5.13).

What runs is upstream code at the pinned version: sglang's
``prepare_context_parallel_metadata`` and ``ContextParallelMetadata``,
``cp_split_and_rebuild_data``, ``RadixAttention``, ``ForwardBatch``,
``ReqToTokenPool``, ``AscendAttnBackend.init_forward_metadata`` and
``do_cp_attn_fia``. What does not run as in production, and why, is listed in
npu_shim/testing/cp_case.py (the backend is made without
``__init__``, which needs an NPU; the KV cache is a plain tensor in the NPU
pool's layout). torch_npu is npu-shim's emulation; ``sgl_kernel_npu`` the import
placeholder in tests/placeholders (never called on this path).

Tests:
1. the shim's replacement, rank by rank for cp_size 2, against the float64
   causal reference (npu_shim.testing.attention_f64) over batch sizes 1, 2, 3, 5
   with uneven lengths, page sizes 16 and 128 with shuffled block tables, MHA
   and GQA, value head dim != key head dim, cached prefixes, half precision;
2. differential: the replacement and 0.5.13's fixed method give identical
   outputs and make the same two FIA calls (same emulated op);
3. host syncs: none (all lengths are host lists);
4. 0.5.13 itself: the patch stays off with reason "fixed upstream";
5. a build in the broken window (0.5.13 module + 0.5.12 method, see
   sglang_support/broken_window.py), in a fresh interpreter: the patch applies
   through the import hook, fixes the AttributeError and is correct, and
   ``npu-shim selftest``'s runner passes there; on 0.5.13 itself the selftest
   module refuses to run (nothing patched).

The two-process (gloo) test is in test_sglang_cp_fia_gloo.py.
"""
import json
import os
import subprocess
import sys

import pytest

from npu_shim.patch import FamilyContext

# the release of the upstream fix (PR 26705), whose module the broken window is built from
pytestmark = [pytest.mark.claimed("sglang.cp_fia", window=True, pinned={"sglang": ("0.5.13",)}),
              pytest.mark.patch("sglang.cp_fia")]

HERE = os.path.dirname(os.path.abspath(__file__))
SUPPORT = os.path.join(HERE, "sglang_support")
REPO = os.path.dirname(os.path.dirname(HERE))
PLACEHOLDERS = os.path.join(REPO, "tests", "placeholders")
TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"


from sglang_support import broken_window, shim  # noqa: E402  (tests/lanes/conftest.py)

from npu_shim.testing import cp_case  # noqa: E402


def _specs():
    import torch

    Spec = cp_case.Spec
    lens = {1: (45,), 2: (33, 70), 3: (17, 64, 29), 5: (9, 40, 23, 130, 11)}
    heads = {"MHA": (4, 4), "GQA": (8, 2)}
    specs = []
    for bs, extend in lens.items():
        for page in (16, 128):
            for kind, (n, nkv) in heads.items():
                specs.append(Spec(extend_lens=extend, page_size=page, num_heads=n, num_kv_heads=nkv,
                                  seed=bs * 100 + page + n))
    specs += [
        # value head dim != key head dim (diff-KV), with GQA
        Spec(extend_lens=(21, 52, 37), page_size=16, num_heads=8, num_kv_heads=2, qk_head_dim=192,
             v_head_dim=128, seed=7),
        Spec(extend_lens=(150, 12), page_size=128, num_heads=4, num_kv_heads=1, qk_head_dim=192,
             v_head_dim=128, seed=8),
        # cached prefixes (radix-cache hits): kv lengths exceed the new tokens
        Spec(extend_lens=(26, 41, 18), prefix_lens=(16, 0, 35), page_size=16, num_heads=4,
             num_kv_heads=2, seed=9),
        # half precision as served
        Spec(extend_lens=(40, 23), page_size=16, num_heads=8, num_kv_heads=2, dtype=torch.float16, seed=10),
        Spec(extend_lens=(31, 58, 12), page_size=128, num_heads=4, num_kv_heads=4, qk_head_dim=192,
             v_head_dim=128, dtype=torch.bfloat16, seed=11),
    ]
    return specs


SPECS = _specs()


@pytest.fixture(scope="module")
def module():
    return shim.install(TARGET)[0]


@pytest.fixture(scope="module")
def replacement(module):
    from npu_shim.patches.sglang import cp_fia as sglang_cp_fia

    return sglang_cp_fia.make_do_cp_attn_fia(module.AscendAttnBackend.__dict__["do_cp_attn_fia"],
                                             FamilyContext(sglang_cp_fia.PATCH.name))


@pytest.fixture(scope="module")
def upstream(module):
    method = module.AscendAttnBackend.__dict__["do_cp_attn_fia"]
    assert not hasattr(method, "__npu_shim_patch__"), "0.5.13's own method must be in place"
    return method


def test_installed_build_is_skipped_as_fixed_upstream(module):
    import npu_shim
    from npu_shim.patch import NotNeeded
    from npu_shim.patches.sglang import cp_fia as sglang_cp_fia

    from npu_shim.engine import guards

    row = next(r for r in npu_shim.status() if r["name"] == sglang_cp_fia.PATCH.name)
    assert row["versions"] == {"sglang": guards.installed_version("sglang")}
    assert (row["state"], row["reason"]) == ("skipped", sglang_cp_fia.FIXED_UPSTREAM)
    with pytest.raises(NotNeeded, match="^fixed upstream$"):
        sglang_cp_fia.check(module, FamilyContext(sglang_cp_fia.PATCH.name))
    names = sglang_cp_fia.code_names(module.AscendAttnBackend.do_cp_attn_fia)
    assert sglang_cp_fia.FIXED_NAMES <= names and "chunk" not in names


def test_layout_helper_matches_sglang_split(module):
    """The test's own zigzag definition agrees with sglang's split of the tokens."""
    import torch
    from sglang.srt.layers.utils.cp_utils import cp_split_and_rebuild_data

    spec = cp_case.Spec(extend_lens=(9, 40, 23, 130, 11), prefix_lens=(0, 3, 0, 8, 1))
    offsets = [sum(spec.extend_lens[:s]) for s in range(spec.bs)]
    ids = torch.arange(sum(spec.extend_lens)).view(-1, 1)
    seen = []
    for rank in range(spec.cp_size):
        fb = cp_case.make_forward_batch(cp_case.make_batch(spec), cp_case.make_metadata(spec, rank))
        local = cp_split_and_rebuild_data(fb, ids).flatten().tolist()
        layout = cp_case.zigzag_layout(spec.extend_lens, spec.cp_size, rank)
        assert local == [offsets[s] + i for s, i in layout]
        meta = fb.attn_cp_metadata
        assert meta.total_q_prev_tokens == sum(meta.actual_seq_q_prev_list)
        seen += local
    assert sorted(seen) == ids.flatten().tolist()


@pytest.mark.parametrize("spec", SPECS, ids=[s.label() for s in SPECS])
def test_replacement_matches_float64_reference(module, replacement, spec):
    batch = cp_case.make_batch(spec)
    reference = batch.reference()
    tokens = 0
    for rank in range(spec.cp_size):
        out = cp_case.run_rank(replacement, module, batch, rank)
        expected = cp_case.rank_expected(batch, reference, rank)
        assert out.shape == (expected.shape[0], spec.num_heads * spec.v_head_dim)
        assert out.dtype == spec.dtype
        err = cp_case.max_abs_err(out, expected)
        assert err <= cp_case.tolerance(spec.dtype), (rank, err)
        tokens += out.shape[0]
    assert tokens == sum(spec.extend_lens)


@pytest.mark.parametrize("spec", SPECS, ids=[s.label() for s in SPECS])
def test_replacement_equals_upstream_fixed_method(module, replacement, upstream, spec):
    import torch
    from npu_shim.testing import record_npu_calls

    batch = cp_case.make_batch(spec)
    for rank in range(spec.cp_size):
        backend, layer, fb, local_q = cp_case.rank_inputs(module, batch, rank)
        with record_npu_calls() as ours:
            out = replacement(backend, local_q, batch.k_cache, batch.v_cache, layer, fb)
        with record_npu_calls() as theirs:
            ref = upstream(backend, local_q, batch.k_cache, batch.v_cache, layer, fb)
        assert torch.equal(out, ref), rank
        fia = [c for c in ours if c.name == "npu_fused_infer_attention_score"]
        up = [c for c in theirs if c.name == "npu_fused_infer_attention_score"]
        assert len(fia) == len(up) == 2 and len(ours) == 2
        meta = fb.attn_cp_metadata
        for call, up_call, q_lens, kv_lens in zip(
                fia, up, (meta.actual_seq_q_prev_list, meta.actual_seq_q_next_list),
                (meta.kv_len_prev_list, meta.kv_len_next_list)):
            cumulative = [sum(q_lens[:i + 1]) for i in range(len(q_lens))]
            kw = call.kwargs
            assert kw["input_layout"] == "TND" and kw["sparse_mode"] == 3 and kw["next_tokens"] == 0
            assert kw["actual_seq_lengths"] == cumulative == up_call.kwargs["actual_seq_lengths"]
            assert kw["actual_seq_lengths_kv"] == list(kv_lens) == up_call.kwargs["actual_seq_lengths_kv"]
            assert all(type(x) is int for x in kw["actual_seq_lengths"] + kw["actual_seq_lengths_kv"])
            assert kw["block_table"] is backend.forward_metadata.block_tables
            assert kw["atten_mask"] is backend.fia_mask
            assert kw["block_size"] == spec.page_size
            assert (kw["num_heads"], kw["num_key_value_heads"]) == (spec.num_heads, spec.num_kv_heads)
            assert kw["scale"] == pytest.approx(layer.scaling)
            assert call.args[0].shape == up_call.args[0].shape == (sum(q_lens), spec.num_heads, spec.qk_head_dim)


def test_replacement_reads_nothing_back_from_the_device(module, replacement):
    from npu_shim.testing import count_host_syncs

    spec = cp_case.Spec(extend_lens=(9, 40, 23, 130, 11), page_size=16, num_heads=8, num_kv_heads=2)
    batch = cp_case.make_batch(spec)
    for rank in range(spec.cp_size):
        backend, layer, fb, local_q = cp_case.rank_inputs(module, batch, rank)
        device = [local_q, batch.k_cache, batch.v_cache, backend.forward_metadata.block_tables,
                  backend.fia_mask]
        with count_host_syncs(device_tensors=device) as syncs:
            replacement(backend, local_q, batch.k_cache, batch.v_cache, layer, fb)
        assert syncs.count == 0, syncs.events


@pytest.fixture(scope="module")
def old_wheel(request, tmp_path_factory):
    """The real sglang 0.5.12 wheel: $NPU_SHIM_TEST_SGLANG_0_5_12_WHEEL, else kept in
    pytest's cache (downloaded once, no dependencies)."""
    cache = getattr(request.config, "cache", None)
    where = cache.mkdir("sglang-0.5.12-wheel") if cache is not None else tmp_path_factory.mktemp("wheel")
    return broken_window.find_or_fetch_old_wheel(str(where))


@pytest.fixture(scope="module")
def broken_window_run(old_wheel):
    """broken_window.py's findings, from one fresh interpreter."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("NPU_SHIM")}
    env.update(NPU_SHIM_EMULATE="1", PYTHONPATH=PLACEHOLDERS)
    proc = subprocess.run([sys.executable, os.path.join(SUPPORT, "broken_window.py"), old_wheel],
                          env=env, capture_output=True, text=True, timeout=400)
    lines = [l for l in proc.stdout.splitlines() if l.startswith("BROKEN_WINDOW_RESULT ")]
    assert proc.returncode == 0 and lines, proc.stdout[-3000:] + proc.stderr[-5000:]
    return json.loads(lines[-1].split(" ", 1)[1])


def test_patch_applies_to_a_broken_window_build(broken_window_run):
    """0.5.13's module with 0.5.12's do_cp_attn_fia (see sglang_support/broken_window.py)."""
    result = broken_window_run
    assert (result["state"], result["reason"]) == ("applied", "sglang 0.5.13"), result
    assert result["patched_is_shim"]
    assert result["original_is_spliced"] and result["original_shape"] == "single-sequence"
    # Without the shim the old method meets the per-sequence metadata: the seed's crash.
    assert result["unpatched_error"].startswith("AttributeError"), result
    assert "actual_seq_q_prev" in result["unpatched_error"]
    assert result["restored_is_original"]
    assert len(result["cases"]) == 3
    for case in result["cases"]:
        assert case["max_abs_err"] <= case["tolerance"], case


def test_selftest_runs_the_patched_path_in_a_broken_window_build(broken_window_run):
    """``npu-shim selftest``'s runner, where the patch applies."""
    row = next(r for r in broken_window_run["selftest"] if r["patch"] == "sglang.cp_fia")
    assert (row["state"], row["ok"], row["kernels"]) == ("applied", True, "emulation"), row
    assert row["host_syncs"] == row["expected_host_syncs"] == 0
    import torch

    from npu_shim.testing import cp_case

    # float16, the dtype the real FIA takes on every device class that has it
    assert row["error_measure"] == "max_abs_err" and 0 <= row["error"] <= row["tolerance"] == cp_case.tolerance(torch.float16)
    assert "do_cp_attn_fia" in row["reason"]


def test_selftest_refuses_an_unpatched_build(module):
    from npu_shim.selftest import sglang_cp_fia as selftest

    with pytest.raises(RuntimeError, match="not applied here .*fixed upstream"):
        selftest.run()
