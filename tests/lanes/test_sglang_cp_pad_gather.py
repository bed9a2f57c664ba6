"""sglang.cp_pad_gather on the real sglang 0.5.16 / 0.5.17 / 0.5.19 wheels: CP-v2 pad rows crash the NPU prefill KV gather.

Two CP ranks as two processes (sglang_support/cp_pad_worker.py, a gloo group
under sglang's own ``GroupCoordinator``) run one attention layer of a CP-v2
prefill through upstream's ``prepare_cp_forward``, ``ForwardBatch``,
``RadixAttention``, ``NPUMHATokenToKVPool`` and
``AscendAttnBackend.forward_extend``: first patched, then, after
``npu_shim.uninstall()``, upstream. Upstream must crash in its KV gather
exactly where the metadata adds pad rows and be bit-identical to the patched
path elsewhere; the patched path must write the KV cache exactly, match the
float64 causal reference on the real rows, give the pad rows zeros and never
hand FIA more query rows than its lengths cover. The rest runs in this process:
how many lengths upstream's own metadata builder pads, the status row, disabled
= upstream, uninstall, strict mode.
"""
import json
import os
import socket
import subprocess
import sys

import pytest

pytestmark = [pytest.mark.claimed("sglang.cp_pad_gather"),
              pytest.mark.patch("sglang.cp_pad_gather")]

HERE = os.path.dirname(os.path.abspath(__file__))
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(HERE, "sglang_support", "cp_pad_worker.py")
TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
TIMEOUT_S = 480
SPLIT_ERROR = "split_with_sizes expects split_sizes to sum exactly to"

# (extend lens, prefixes, heads, kv heads, padded by upstream's metadata at cp_size 2)
CASES = [
    ((37,), (), 4, 4, True),
    ((20,), (), 4, 4, True),
    ((16, 18, 29), (), 4, 4, True),
    ((16, 24), (), 4, 4, False),
    ((37, 20), (9, 4), 8, 2, True),      # cached prefixes, GQA 8:2
    ((40,), (13,), 8, 2, False),         # cached prefix, GQA, no pad rows
]


def specs():
    from npu_shim.testing.cp_case import Spec

    return [Spec(extend_lens=lens, prefix_lens=prefixes, num_heads=heads, num_kv_heads=kv_heads,
                 seed=index) for index, (lens, prefixes, heads, kv_heads, _) in enumerate(CASES)]


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def ranks(tmp_path_factory):
    """Both ranks' reports (the worker runs every case, patched then upstream)."""
    where = tmp_path_factory.mktemp("cp_pad")
    cases = json.dumps([json.loads(spec.to_json()) for spec in specs()])
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("NPU_SHIM")}
    env.update(NPU_SHIM_EMULATE="1", ASCEND_USE_FIA="1", SGLANG_ENABLE_CP_V2="1",
                               PYTHONPATH=os.path.join(REPO, "tests", "placeholders"), OMP_NUM_THREADS="1")
    port = free_port()
    outputs = [where / ("rank%d.json" % rank) for rank in range(2)]
    procs = [subprocess.Popen([sys.executable, WORKER, str(rank), "2", str(port), cases, str(outputs[rank])],
                              env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for rank in range(2)]
    logs = []
    try:
        for proc in procs:
            out, err = proc.communicate(timeout=TIMEOUT_S)
            logs.append(out[-2000:] + err[-4000:])
    finally:
        for proc in procs:       # bounded: never leave a rank waiting on its peer
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert [p.returncode for p in procs] == [0, 0], "\n----\n".join(logs)
    return [json.loads(path.read_text()) for path in outputs]


def test_patch_applies_in_both_rank_processes_and_uninstall_restores(ranks):
    for report in ranks:
        assert report["state"] == "applied", report
        assert report["restored"], report


@pytest.mark.parametrize("index", range(len(CASES)), ids=[str(c[0]) for c in CASES])
def test_upstream_crashes_exactly_where_pad_rows_exist(ranks, index):
    padded = CASES[index][4]
    for report in ranks:
        case = report["cases"][index]
        upstream = case["upstream"]
        assert upstream["padded"] == padded, upstream
        if padded:
            assert upstream["error"] and SPLIT_ERROR in upstream["error"], upstream
            assert upstream["error_in"] == "split", upstream
        else:
            assert upstream["error"] is None, upstream
            assert case["bit_identical"], case
            assert upstream["kv_exact"] and upstream["max_abs_err"] <= upstream["tolerance"], upstream


@pytest.mark.parametrize("index", range(len(CASES)), ids=[str(c[0]) for c in CASES])
def test_patched_matches_the_float64_reference_and_writes_the_cache_exactly(ranks, index):
    for rank, report in enumerate(ranks):
        patched = report["cases"][index]["patched"]
        assert patched["error"] is None, patched
        assert patched["kv_exact"], patched
        assert patched["max_abs_err"] <= patched["tolerance"], patched
        assert patched["out_rows"] == patched["local_rows"] == patched["physical_rows"][rank]
        assert patched["pad_rows_max_abs"] == 0.0, patched
        # FIA gets the real rows only: each call's query rows == its last cumulative length
        assert len(patched["fia_calls"]) == 2
        assert all(rows == covered for rows, covered in patched["fia_calls"]), patched
        assert sum(rows for rows, _ in patched["fia_calls"]) == patched["logical_rows"][rank]


def test_no_host_syncs_per_layer_patched_or_upstream(ranks):
    for report in ranks:
        for case in report["cases"]:
            assert case["patched"]["host_syncs"] == 0, case
            if case["upstream"]["error"] is None:
                assert case["upstream"]["host_syncs"] == 0, case


# ---- in this process -------------------------------------------------------------------

@pytest.fixture(scope="module")
def module():
    import importlib

    import npu_shim
    from npu_shim import emulation

    emulation.install()
    npu_shim.install()
    return importlib.import_module(TARGET)


def padded_lengths(lengths, cp_size=2):
    """Lengths that upstream's metadata builder pads, one prompt, every rank."""
    from sglang.srt.layers.cp.padding import pad_logical_token_to_physical
    from sglang.srt.layers.cp.zigzag import ZigzagCPStrategy
    from sglang.srt.runtime_context import get_context, get_parallel

    padded = set()
    with get_context().override_server_args(device="cpu", enable_prefill_cp=True, cp_strategy="zigzag",
                                            attn_cp_size=cp_size, enable_prefill_context_parallel=True,
                                            prefill_cp_mode="in-seq-split"):
        for rank in range(cp_size):
            with get_parallel().override(attn_cp_size=cp_size, attn_cp_rank=rank):
                strategy = ZigzagCPStrategy(cp_size=cp_size)
                for length in lengths:
                    metadata = strategy.build_metadata(num_tokens=length, seqs_len=[length],
                                                       extend_seqs_len=[length])
                    pad_logical_token_to_physical(metadata)
                    if metadata.per_rank_logical_token != metadata.per_rank_actual_token:
                        padded.add(length)
    return padded


def test_upstream_metadata_pads_seven_of_eight_lengths(module):
    lengths = range(4, 4100)
    padded = padded_lengths(lengths)
    assert len(padded) == 3584                      # 87.5 % of 4 .. 4,099
    assert padded == {n for n in lengths if n % 8}   # multiples of 2 * cp_size * 2 are not
    assert {37, 20} <= padded and 40 not in padded


@pytest.mark.patch("sglang.cp_fia")   # its skip reason on these releases
def test_status_row_and_cp_fia_skip(module):
    import npu_shim
    from npu_shim.patches.sglang import cp_fia as sglang_cp_fia, cp_pad_gather as patch

    rows = {r["name"]: r for r in npu_shim.status()}
    assert rows[patch.PATCH.name]["state"] == "applied", rows[patch.PATCH.name]
    assert (rows[sglang_cp_fia.PATCH.name]["state"], rows[sglang_cp_fia.PATCH.name]["reason"]) == (
        "skipped", sglang_cp_fia.FIXED_UPSTREAM)
    assert getattr(module.cp_all_gather_rerange_kv_cache, "__npu_shim_patch__", None) == patch.PATCH.name
    assert module.AscendAttnBackend.do_cp_attn_fia.__npu_shim_patch__ == patch.PATCH.name


def test_disabled_leaves_upstream_objects(run_python, make_env):
    code = """
import importlib, json, npu_shim
from npu_shim import emulation
emulation.install(); npu_shim.install()
m = importlib.import_module(%r)
from sglang.srt.layers.utils import cp_utils
row = next(r for r in npu_shim.status() if r["name"] == "sglang.cp_pad_gather")
print(json.dumps([row["state"], m.cp_all_gather_rerange_kv_cache is cp_utils.cp_all_gather_rerange_kv_cache,
                  m.AscendAttnBackend.do_cp_attn_fia.__module__ == m.__name__,
                  hasattr(m.AscendAttnBackend.do_cp_attn_fia, "__npu_shim_patch__")]))
""" % TARGET
    env = make_env(NPU_SHIM_DISABLE="sglang.cp_pad_gather",
                   PYTHONPATH=os.path.join(REPO, "tests", "placeholders"))
    out = run_python(code, env=env, timeout=300).stdout.strip().splitlines()[-1]
    assert json.loads(out) == ["disabled", True, True, False]


STRICT_CODE = """
import dataclasses, importlib, json, npu_shim
from npu_shim import emulation
emulation.install(); npu_shim.install()
from sglang.srt.layers.cp import zigzag

@dataclasses.dataclass
class ZigzagContextParallelMetadata:      # a build of this window without the logical counts
    per_rank_actual_token: list = None
    max_rank_len: list = None

zigzag.ZigzagContextParallelMetadata = ZigzagContextParallelMetadata
m = importlib.import_module(%r)
row = next(r for r in npu_shim.status() if r["name"] == "sglang.cp_pad_gather")
print(json.dumps([row["state"], row["reason"], hasattr(m.AscendAttnBackend.do_cp_attn_fia, "__npu_shim_patch__")]))
""" % TARGET


@pytest.mark.parametrize("strict", ["0", "1"])
def test_a_mismatch_inside_the_window_skips_or_raises_in_strict_mode(run_python, make_env, strict):
    env = make_env(NPU_SHIM_STRICT=strict, PYTHONPATH=os.path.join(REPO, "tests", "placeholders"))
    proc = run_python(STRICT_CODE, env=env, check=False, timeout=300)
    if strict == "1":
        assert proc.returncode != 0
        assert "PatchError" in proc.stderr and "ZigzagContextParallelMetadata lacks" in proc.stderr, proc.stderr[-2000:]
    else:
        assert proc.returncode == 0, proc.stderr[-2000:]
        state, reason, patched = json.loads(proc.stdout.strip().splitlines()[-1])
        assert state != "applied" and "ZigzagContextParallelMetadata lacks" in reason and not patched
