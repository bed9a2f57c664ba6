"""Bad environment values, faults, threads and fork, each in real interpreters."""
import json
import os
import subprocess
import sys
import textwrap

import pytest

from npu_shim._config import ConfigError, Settings

# PYTHONPATH=REPO: the checkout install path (its root sitecustomize.py), used on purpose where a
# test needs start-up to install the shim; the other subprocesses import the installed package.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)
NPU_SHIM_CLI = os.path.join(BIN, "npu-shim")


def run(argv, env, cwd=None, timeout=120):
    return subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------- 1. no wrapt in a child


def test_child_without_the_shims_dependencies_warns_once_and_imports_unpatched(tmp_path, make_env):
    venv = tmp_path / "other-venv"
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(venv)], check=True)
    python = str(venv / "bin" / "python")
    if run([python, "-c", "import wrapt"], make_env()).returncode == 0:
        pytest.skip("the base interpreter's venvs see a wrapt; cannot make a child without it here")
    pkg = tmp_path / "frameworks" / "sglang"       # a watched name, as a toy package
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text("VALUE = 42\n")
    (pkg / "sub.py").write_text("VALUE = 7\n")
    code = "import sglang, sglang.sub; print(sglang.VALUE, sglang.sub.VALUE)"
    proc = run([python, "-c", code],
               make_env(PYTHONPATH=os.pathsep.join([REPO, str(tmp_path / "frameworks")])))
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.split() == ["42", "7"]
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert len(lines) == 1, proc.stderr
    assert lines[0].startswith("npu-shim: wrapt is not importable") and "nothing is patched" in lines[0]


# ------------------------------------------------- 2. run with a malformed variable


def test_run_with_a_malformed_variable_exits_2_before_launching(make_env):
    proc = run([NPU_SHIM_CLI, "run", "--", sys.executable, "-c", "print('launched')"],
               make_env(NPU_SHIM_STRICT="maybe"))
    assert proc.returncode == 2
    assert "launched" not in proc.stdout
    assert "NPU_SHIM_STRICT='maybe' is not a boolean" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------- 3. python -m pkg whose package imports npu_shim


def test_python_dash_m_of_a_package_importing_the_shim_raises_on_a_bad_variable(tmp_path, make_env):
    pkg = tmp_path / "launcher"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("import npu_shim\n")
    (pkg / "__main__.py").write_text("print('ran without the shim')\n")
    proc = run([sys.executable, "-m", "launcher"], make_env(NPU_SHIM_EMULATE="perhaps"), cwd=tmp_path)
    assert proc.returncode != 0
    assert "ran without the shim" not in proc.stdout
    assert "ConfigError: NPU_SHIM_EMULATE='perhaps' is not a boolean" in proc.stderr


def test_python_dash_m_npu_shim_still_reports_a_usage_error(make_env):
    proc = run([sys.executable, "-m", "npu_shim", "status"], make_env(NPU_SHIM_EMULATE="perhaps"))
    assert proc.returncode == 2
    assert "NPU_SHIM_EMULATE='perhaps' is not a boolean" in proc.stderr
    assert "Traceback" not in proc.stderr


# ------------------------------------------------------------------- 4. fork

FORK_WHILE_APPLYING = textwrap.dedent('''
    import os, sys, threading, time
    sys.path.insert(0, {toy!r})
    import npu_shim
    from npu_shim.patch import Patch
    building = threading.Event()
    def slow_build(module):
        building.set()
        time.sleep(0.5)                 # the shim's lock is held while a patch applies
        return {{"greet": lambda: "patched"}}
    def quick_build(module):
        return {{"greet": lambda: "patched too"}}
    npu_shim.register(Patch(name="toy.slow", target="toy_a", replaces=("greet",), build=slow_build))
    npu_shim.register(Patch(name="toy.quick", target="toy_b", replaces=("greet",), build=quick_build))
    worker = threading.Thread(target=lambda: __import__("toy_a"))
    worker.start()
    building.wait(10)
    pid = os.fork()
    if pid == 0:
        # Child: the patch is either applied or not, never half; the next watched import works.
        import toy_b
        os.write(1, ("child %s %s\\n" % (sys.modules["toy_a"].greet(), toy_b.greet())).encode())
        os._exit(0)
    deadline = time.monotonic() + 20
    while time.monotonic() < deadline:
        done, status = os.waitpid(pid, os.WNOHANG)
        if done:
            break
        time.sleep(0.05)
    else:
        os.kill(pid, 9)
        os.waitpid(pid, 0)
        print("child deadlocked")
        sys.exit(1)
    worker.join()
    print("parent", status)
''')


def test_fork_while_another_thread_applies_a_patch_gives_a_usable_child(tmp_path, run_python):
    for name in ("toy_a", "toy_b"):
        (tmp_path / (name + ".py")).write_text("def greet():\n    return 'upstream'\n")
    out = run_python(FORK_WHILE_APPLYING.format(toy=str(tmp_path)), timeout=60)
    assert out.stdout.split("\n")[:2] == ["child patched patched too", "parent 0"], out.stdout


def test_fork_while_a_thread_holds_wraps_import_hook_lock(tmp_path, run_python):
    (tmp_path / "toy_c.py").write_text("def greet():\n    return 'upstream'\n")
    out = run_python(textwrap.dedent('''
        import os, sys, threading, time
        sys.path.insert(0, %r)
        import npu_shim
        npu_shim.status()                      # loads the machinery (and wrapt)
        import wrapt.importer
        from npu_shim.patch import Patch
        holding = threading.Event()
        def hold():
            with wrapt.importer._post_import_hooks_lock:   # as a thread registering a hook does
                holding.set()
                time.sleep(0.5)
        threading.Thread(target=hold).start()
        holding.wait(10)
        pid = os.fork()
        if pid == 0:
            npu_shim.register(Patch(name="toy.c", target="toy_c", replaces=("greet",),
                                    build=lambda m: {"greet": lambda: "patched"}))
            import toy_c
            os.write(1, ("child " + toy_c.greet() + "\\n").encode())
            os._exit(0)
        deadline = time.monotonic() + 20
        while time.monotonic() < deadline:
            if os.waitpid(pid, os.WNOHANG)[0]:
                break
            time.sleep(0.05)
        else:
            os.kill(pid, 9)
            print("child deadlocked")
    ''' % str(tmp_path)), timeout=60)
    assert out.stdout.splitlines()[0] == "child patched", out.stdout


# --------------------------------------------- 5. variables validated at start-up


@pytest.mark.parametrize("env, words", [
    ({"NPU_SHIM_MOONVIT_ATTN": "flash"}, ["NPU_SHIM_MOONVIT_ATTN='flash'", "auto, ascend_fa, sdpa"]),
    ({"NPU_SHIM_EMULATE": "1", "NPU_SHIM_EMULATE_SOC": "Ascend999"},
     ["NPU_SHIM_EMULATE_SOC='Ascend999'", "Ascend910B1", "Ascend310P3"]),
    ({"NPU_SHIM_EMULATE": "1", "NPU_SHIM_EMULATE_MEMORY_MIB": "inf"},
     ["NPU_SHIM_EMULATE_MEMORY_MIB='inf'", "finite number greater than 0"]),
    ({"NPU_SHIM_EMULATE": "1", "NPU_SHIM_EMULATE_MEMORY_MIB": "nan"}, ["NPU_SHIM_EMULATE_MEMORY_MIB='nan'"]),
    ({"NPU_SHIM_EMULATE": "1", "NPU_SHIM_EMULATE_MEMORY_MIB": "0"}, ["NPU_SHIM_EMULATE_MEMORY_MIB='0'"]),
    ({"NPU_SHIM_EXIT_SUMMARY": "loud"}, ["NPU_SHIM_EXIT_SUMMARY='loud' is not a boolean"]),
])
def test_every_variable_is_validated_at_startup_and_by_status(env, words, make_env):
    with pytest.raises(ConfigError) as info:
        Settings(env)
    for word in words:
        assert word in str(info.value)
    started = run([sys.executable, "-c", "print('alive')"], make_env(PYTHONPATH=REPO, **env))
    assert started.returncode == 0 and started.stdout.strip() == "alive"
    assert words[0] in started.stderr and "not installed in this process" in started.stderr
    status = run([NPU_SHIM_CLI, "status"], make_env(**env))
    assert status.returncode == 2 and words[0] in status.stderr


def test_emulation_variables_are_not_checked_unless_emulating():
    # A typo in a test-only variable must not switch the shim off in production.
    settings = Settings({"NPU_SHIM_EMULATE_SOC": "Ascend999", "NPU_SHIM_EMULATE_MEMORY_MIB": "nan"})
    assert settings.enabled and not settings.emulate


def test_memory_bound_names_the_variable_for_inf_and_nan(monkeypatch):
    from npu_shim.emulation._engine import memory_bound_bytes

    for raw in ("inf", "nan", "-1", "lots"):
        monkeypatch.setenv("NPU_SHIM_EMULATE_MEMORY_MIB", raw)
        with pytest.raises(ConfigError, match="NPU_SHIM_EMULATE_MEMORY_MIB=%r" % raw):
            memory_bound_bytes()
    monkeypatch.setenv("NPU_SHIM_EMULATE_MEMORY_MIB", "0.5")
    assert memory_bound_bytes() == 1 << 19


# ---------------------------------------------- 6. ENABLE and DISABLE contradict

BOTH = {"NPU_SHIM_ENABLE": "vllm.moonvit_attn,sglang.cp_fia", "NPU_SHIM_DISABLE": "sglang.cp_fia"}
CONTRADICTION = "NPU_SHIM_ENABLE and NPU_SHIM_DISABLE both name 'sglang.cp_fia'; DISABLE wins"


def test_a_patch_both_enabled_and_disabled_is_reported_at_startup_status_and_run(make_env):
    assert Settings(BOTH).warnings() == [CONTRADICTION + ", it stays off"]
    started = run([sys.executable, "-c", "pass"], make_env(PYTHONPATH=REPO, **BOTH))
    assert started.stderr.count(CONTRADICTION) == 1, started.stderr
    status = run([NPU_SHIM_CLI, "status", "--json"], make_env(**BOTH))
    assert status.returncode == 0 and status.stderr.count(CONTRADICTION) == 1, status.stderr
    row = next(r for r in json.loads(status.stdout) if r["name"] == "sglang.cp_fia")
    assert row["state"] == "disabled" and "DISABLE wins" in row["reason"]
    launched = run([NPU_SHIM_CLI, "run", "--", "true"], make_env(**BOTH))
    assert launched.returncode == 0 and CONTRADICTION in launched.stderr


def test_no_contradiction_no_line():
    assert Settings({"NPU_SHIM_ENABLE": "a", "NPU_SHIM_DISABLE": "b"}).warnings() == []
