"""Two context-parallel ranks as two processes (lane sglang-0.5.13).

sglang runs context parallelism as one process per rank. Here ranks 0 and 1 are
two fresh interpreters in a ``torch.distributed`` gloo group on 127.0.0.1 (a
free port), each running sglang_support/cp_gloo_worker.py: the broken-window
build (0.5.13 module, 0.5.12 ``do_cp_attn_fia``) patched by npu-shim's import
hook, its share of a batch of uneven sequences, the KV all-gather written into
its paged cache, its half of the attention, and the all-gather of the outputs.
Both must match the float64 reference, and the gathered result must equal what
one process computes for both ranks.
"""
import json
import os
import socket
import subprocess
import sys

import pytest

# the release of the upstream fix (PR 26705), whose module the broken window is built from
pytestmark = [pytest.mark.claimed("sglang.cp_fia", window=True, pinned={"sglang": ("0.5.13",)}),
              pytest.mark.patch("sglang.cp_fia")]

HERE = os.path.dirname(os.path.abspath(__file__))
SUPPORT = os.path.join(HERE, "sglang_support")
REPO = os.path.dirname(os.path.dirname(HERE))
WORKER = os.path.join(SUPPORT, "cp_gloo_worker.py")
TIMEOUT_S = 300

# Three sequences of uneven length (one with a cached prefix), GQA, diff-KV.
SPEC_JSON = json.dumps({"extend_lens": [33, 70, 21], "page_size": 16, "num_heads": 8,
                        "num_kv_heads": 2, "qk_head_dim": 192, "v_head_dim": 128,
                        "prefix_lens": [0, 9, 4], "cp_size": 2, "dtype": "bfloat16", "seed": 5})


def free_port():
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


@pytest.fixture(scope="module")
def old_wheel(request, tmp_path_factory):
    cache = getattr(request.config, "cache", None)
    where = cache.mkdir("sglang-0.5.12-wheel") if cache is not None else tmp_path_factory.mktemp("wheel")
    from sglang_support import broken_window

    return broken_window.find_or_fetch_old_wheel(str(where))


def test_two_rank_processes_over_gloo_match_the_reference(old_wheel, make_env, tmp_path):
    env = make_env(NPU_SHIM_EMULATE="1", PYTHONPATH=os.path.join(REPO, "tests", "placeholders"),
                   OMP_NUM_THREADS="1")
    port = free_port()
    outputs = [tmp_path / ("rank%d.json" % rank) for rank in range(2)]
    procs = [
        subprocess.Popen([sys.executable, WORKER, str(rank), "2", str(port), old_wheel, SPEC_JSON,
                          str(outputs[rank])], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for rank in range(2)
    ]
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

    results = [json.loads(path.read_text()) for path in outputs]
    total = 33 + 70 + 21
    assert [r["rank"] for r in results] == [0, 1]
    assert sum(r["local_tokens"] for r in results) == total
    for r in results:
        assert (r["state"], r["patched_is_shim"]) == ("applied", True), r
        assert r["gathered_kv_exact"], r
        assert r["local_max_abs_err"] <= r["tolerance"], r
        assert r["gathered_tokens"] == total
        assert r["gathered_max_abs_err"] <= r["tolerance"], r
        assert r["equals_single_process"], r
