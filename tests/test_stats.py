"""npu_shim.stats(): per-process counters, thread-safe, reset in a forked child; the exit summary."""
import os
import re
import textwrap

import pytest
import torch

from npu_shim.engine import counters

TOY_PATCH = textwrap.dedent('''
    import json, os, sys
    sys.path.insert(0, {toy!r})
    import npu_shim
    from npu_shim.engine import counters
    from types import SimpleNamespace
    from npu_shim.patch import Family, Patch
    def build(module, context):
        original = module.greet
        def greet():
            counters.count("toy.counted", "calls")
            counters.count("toy.counted", "upstream_calls")
            return original()
        return {{"greet": greet}}
    family = Family(SimpleNamespace(check=lambda module, context: None, build=build), keeps="greet",
                    id="toy-counted")
    npu_shim.register(Patch(name="toy.counted", target="toy_counted", replaces=("greet",),
                            families=(family,)))
''')


@pytest.fixture
def toy(tmp_path):
    (tmp_path / "toy_counted.py").write_text("def greet():\n    return 'hi'\n")
    return tmp_path


def test_stats_reports_state_reason_family_and_counters(toy, run_python):
    out = run_python(TOY_PATCH.format(toy=str(toy)) + textwrap.dedent('''
        import toy_counted
        for _ in range(3):
            toy_counted.greet()
        print(json.dumps(npu_shim.stats()))
    '''))
    rows = __import__("json").loads(out.stdout)
    assert rows["toy.counted"] == {"state": "applied", "reason": "applied", "family": "toy-counted",
                                   "calls": 3, "upstream_calls": 3, "host_copies": 0,
                                   "upstream_host_copies": 0}
    assert set(rows) >= {"transformers.attn_check", "vllm.moonvit_attn", "sglang.cp_fia"}
    assert rows["sglang.cp_fia"]["calls"] == 0 and rows["sglang.cp_fia"]["state"] == "skipped"


def test_stats_is_lazy(run_python):
    out = run_python("import sys, npu_shim; print('wrapt' in sys.modules, 'npu_shim.engine.counters' in sys.modules)")
    assert out.stdout.split() == ["False", "False"]


def test_counts_from_many_threads_are_all_kept():
    counters.reset()
    import threading

    def work():
        for _ in range(20000):
            counters.count("toy.threads", "calls")

    threads = [threading.Thread(target=work) for _ in range(8)]
    old = __import__("sys").getswitchinterval()
    __import__("sys").setswitchinterval(1e-6)   # switch threads as often as possible
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join()
    finally:
        __import__("sys").setswitchinterval(old)
    assert counters.snapshot()["toy.threads"]["calls"] == 8 * 20000
    counters.reset()


def test_forked_child_counts_from_zero():
    counters.reset()
    counters.count("toy.fork", "calls", 5)
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        row = counters.snapshot().get("toy.fork", {})
        counters.count("toy.fork", "calls")
        os.write(write, ("%s %s" % (row.get("calls"), counters.snapshot()["toy.fork"]["calls"])).encode())
        os._exit(0)
    os.close(write)
    got = os.read(read, 100).decode()
    os.waitpid(pid, 0)
    assert got == "None 1"
    assert counters.snapshot()["toy.fork"]["calls"] == 5      # the parent's own counts stay
    counters.reset()


EXIT_LINE = re.compile(r"^npu-shim\[pid (\d+)\]: toy.counted family=toy-counted calls=(\d+) "
                       r"upstream_calls=(\d+) host_copies=0 upstream_host_copies=0$")


def test_exit_summary_one_line_per_applied_patch_per_process(toy, run_python, make_env):
    code = TOY_PATCH.format(toy=str(toy)) + textwrap.dedent('''
        import multiprocessing as mp
        import toy_counted

        def child():
            toy_counted.greet()

        if __name__ == "__main__":
            toy_counted.greet(); toy_counted.greet()
            proc = mp.get_context("fork").Process(target=child)
            proc.start(); proc.join()
            print(os.getpid(), proc.pid)
    ''')
    quiet = run_python(code, env=make_env())
    assert "npu-shim[" not in quiet.stderr
    out = run_python(code, env=make_env(NPU_SHIM_EXIT_SUMMARY="1"))
    parent, child = out.stdout.split()
    lines = [EXIT_LINE.match(line) for line in out.stderr.splitlines() if line.startswith("npu-shim[")]
    assert all(lines) and len(lines) == 2, out.stderr
    assert {m.group(1): m.group(2) for m in lines} == {parent: "2", child: "1"}


def test_moonvit_patch_counts_calls_and_one_host_copy_per_cu_seqlens(monkeypatch):
    from npu_shim import emulation
    from npu_shim.patch import FamilyContext
    from npu_shim.patches.vllm import moonvit_attn as moonvit

    emulation.install()
    counters.reset()
    q = torch.randn(10, 2, 16, dtype=torch.bfloat16)    # the A2 tower's dtype
    cu = torch.tensor([0, 4, 10], dtype=torch.int32)
    ascend_fa_attention = moonvit.attention_for(FamilyContext.of(moonvit.PATCH, moonvit.PATCH.families[0]))
    for _ in range(3):   # three layers of one forward share cu_seqlens
        ascend_fa_attention(q, q, q, cu, cu)
    row = counters.snapshot()["vllm.moonvit_attn"]
    assert (row["calls"], row["host_copies"]) == (3, 1)
    counters.reset()
