"""Every way the shim gets into a process, each in real interpreters."""
import importlib.util
import json
import os
import subprocess
import sys
import textwrap

import pytest

# PYTHONPATH=REPO is the checkout install path (README: the root sitecustomize.py): the tests
# that set it run the checkout on purpose. Every other subprocess imports the installed package
# (tests/conftest.py starts them outside the checkout), as does the bootstrap directory below.
REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
INSTALLED_BOOTSTRAP = os.path.join(importlib.util.find_spec("npu_shim").submodule_search_locations[0],
                                   "_bootstrap")
BIN = os.path.dirname(sys.executable)
HEAVY_TOP_LEVEL = ("wrapt", "packaging", "torch", "logging")  # and importlib.metadata

# Printed by a probe: was the shim installed, and was it installed by a
# sitecustomize of ours at start-up (rather than by code the probe ran)?
PROBE = textwrap.dedent('''
    import json, os, sys
    def probe():
        state = None
        if "npu_shim" in sys.modules or any(type(f).__name__ == "NpuShimStart" for f in sys.meta_path):
            from npu_shim import _startup   # adopts the start-up finder; imports nothing heavy
            state = _startup._State
        return {
            "installed": bool(state and state.installed),
            "booted_by": [os.path.basename(os.path.dirname(f)) for f in (state.booted_by if state else [])],
            "heavy": sorted(m for m in sys.modules if m.split(".")[0] in %r or m.startswith("importlib.metadata")),
            "pythonpath": os.environ.get("PYTHONPATH", ""),
        }
''' % (HEAVY_TOP_LEVEL,))

SPAWN_SCRIPT = PROBE + textwrap.dedent('''
    import multiprocessing as mp

    def child(queue):
        queue.put(probe())

    if __name__ == "__main__":
        {preamble}
        out = {"parent": probe()}
        for method in ("spawn", "forkserver"):
            ctx = mp.get_context(method)
            queue = ctx.Queue()
            proc = ctx.Process(target=child, args=(queue,))
            proc.start()
            out[method] = queue.get(timeout=60)
            proc.join()
        print(json.dumps(out))
''')


def run(argv, env, cwd=None):
    proc = subprocess.run(argv, env=env, cwd=cwd, capture_output=True, text=True, timeout=180)
    return proc


def probe_json(proc):
    assert proc.returncode == 0, proc.stderr
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_pythonpath_checkout_installs_without_heavy_imports(make_env):
    proc = run([sys.executable, "-c", PROBE + "print(json.dumps(probe()))"], make_env(PYTHONPATH=REPO))
    got = probe_json(proc)
    assert got["installed"] and got["booted_by"] == [os.path.basename(REPO)]
    assert got["heavy"] == [], "start-up imported %s" % got["heavy"]
    assert proc.stderr == ""


def test_startup_adds_only_the_shims_own_modules(make_env):
    code = "import sys; print(sorted(sys.modules))"
    bare = set(json.loads(run([sys.executable, "-c", code.replace("print(", "import json; print(json.dumps(")
                               + ")"], make_env()).stdout))
    shim = set(json.loads(run([sys.executable, "-c", code.replace("print(", "import json; print(json.dumps(")
                               + ")"], make_env(PYTHONPATH=REPO)).stdout))
    added = sorted(shim - bare)
    assert added and all(m == "sitecustomize" or m.startswith("npu_shim") for m in added), added


def test_import_npu_shim_patches_spawn_and_forkserver_children(tmp_path, make_env):
    script = tmp_path / "launch.py"
    script.write_text(SPAWN_SCRIPT.replace("{preamble}", "import npu_shim"))
    got = probe_json(run([sys.executable, str(script)], make_env(), cwd=tmp_path))
    assert got["parent"]["installed"] and got["parent"]["booted_by"] == []
    for method in ("spawn", "forkserver"):
        assert got[method]["installed"], method
        assert got[method]["booted_by"] == ["_bootstrap"], (method, got[method])


def test_pythonpath_children_are_patched_too(tmp_path, make_env):
    script = tmp_path / "launch.py"
    script.write_text(SPAWN_SCRIPT.replace("{preamble}", "pass"))
    got = probe_json(run([sys.executable, str(script)], make_env(PYTHONPATH=REPO), cwd=tmp_path))
    for who in ("parent", "spawn", "forkserver"):
        assert got[who]["installed"] and got[who]["booted_by"] == [os.path.basename(REPO)], (who, got[who])


def npu_shim_cli():
    path = os.path.join(BIN, "npu-shim")
    assert os.path.exists(path), "npu-shim console script missing: install the package (pip install .)"
    return path


def test_run_installs_in_command_and_its_spawned_children(tmp_path, make_env):
    script = tmp_path / "launch.py"
    script.write_text(SPAWN_SCRIPT.replace("{preamble}", "pass"))
    env = make_env(PYTHONPATH=str(tmp_path / "user-dir"), USER_VAR="kept")
    proc = run([npu_shim_cli(), "run", "--", sys.executable, str(script)], env, cwd=tmp_path)
    got = probe_json(proc)
    for who in ("parent", "spawn", "forkserver"):
        assert got[who]["installed"] and got[who]["booted_by"] == ["_bootstrap"], (who, got[who])
    entries = got["parent"]["pythonpath"].split(os.pathsep)
    assert entries[0].endswith(os.path.join("npu_shim", "_bootstrap"))
    assert entries[1:] == [str(tmp_path / "user-dir")], "user's PYTHONPATH not kept"


def test_run_keeps_environment_and_propagates_exit_code(make_env):
    code = "import os, sys; print(os.environ['USER_VAR']); sys.exit(7)"
    for launcher in ([npu_shim_cli()], [sys.executable, "-m", "npu_shim"]):
        proc = run(launcher + ["run", "--", sys.executable, "-c", code], make_env(USER_VAR="kept"))
        assert (proc.returncode, proc.stdout.strip()) == (7, "kept"), (launcher, proc.stderr)


def test_run_reports_missing_and_absent_commands(make_env):
    proc = run([npu_shim_cli(), "run", "--", "no-such-command-xyz"], make_env())
    assert proc.returncode == 127 and "command not found: no-such-command-xyz" in proc.stderr
    proc = run([npu_shim_cli(), "run"], make_env())
    assert proc.returncode == 2 and "usage: npu-shim run -- CMD" in proc.stderr


def test_vllm_entry_point_installs_without_pythonpath(make_env):
    code = PROBE + textwrap.dedent('''
        from importlib.metadata import entry_points
        (ep,) = [ep for ep in entry_points(group="vllm.general_plugins") if ep.name == "npu_shim"]
        assert ep.value == "npu_shim._vllm_plugin:register", ep.value
        before = probe()
        ep.load()()
        print(json.dumps({"before": before, "after": probe()}))
    ''')
    got = probe_json(run([sys.executable, "-c", code], make_env()))
    assert not got["before"]["installed"]
    assert got["after"]["installed"] and got["after"]["booted_by"] == []
    assert got["after"]["pythonpath"].split(os.pathsep)[0].endswith("_bootstrap"), "children would not be patched"


@pytest.mark.parametrize("first", ["checkout", "bootstrap"])
def test_chains_to_the_next_sitecustomize(tmp_path, make_env, first):
    user = tmp_path / "user"
    user.mkdir()
    (user / "sitecustomize.py").write_text("import os\nos.environ['USER_SITECUSTOMIZE'] = 'ran'\n")
    # Both sitecustomize files of one copy before the user's: the chain skips the second. The
    # checkout's pair is the checkout install path; the installed bootstrap is what `npu-shim run`
    # puts first (then a PYTHONPATH=<checkout> the user kept).
    if first == "checkout":
        path = [REPO, REPO, os.path.join(REPO, "npu_shim", "_bootstrap"), str(user)]
    else:
        path = [INSTALLED_BOOTSTRAP, REPO, INSTALLED_BOOTSTRAP, str(user)]
    path = os.pathsep.join(path)
    code = PROBE + "print(json.dumps([probe()['installed'], os.environ.get('USER_SITECUSTOMIZE')]))"
    proc = run([sys.executable, "-c", code], make_env(PYTHONPATH=path))
    assert probe_json(proc) == [True, "ran"]


def test_malformed_variable_at_startup_is_reported_not_fatal(make_env):
    proc = run([sys.executable, "-c", "print('alive')"], make_env(PYTHONPATH=REPO, NPU_SHIM_EMULATE="perhaps"))
    assert proc.returncode == 0 and proc.stdout.strip() == "alive"
    assert "NPU_SHIM_EMULATE='perhaps' is not a boolean" in proc.stderr
    assert "not installed in this process" in proc.stderr


def test_malformed_variable_makes_import_raise(make_env):
    proc = run([sys.executable, "-c", "import npu_shim"], make_env(NPU_SHIM="sometimes"))
    assert proc.returncode != 0
    assert "ConfigError: NPU_SHIM='sometimes' is not a boolean" in proc.stderr


def test_npu_shim_0_installs_nothing(make_env):
    proc = run([sys.executable, "-c", PROBE + "print(json.dumps(probe()))"], make_env(PYTHONPATH=REPO, NPU_SHIM="0"))
    got = probe_json(proc)
    assert not got["installed"] and got["pythonpath"] == REPO


def test_start_up_hook_watches_the_packages_the_patch_index_names():
    # The start-up hook keeps its own copy (it imports nothing of the package).
    import ast

    from npu_shim.patches import WATCHED_PACKAGES

    source = open(os.path.join(INSTALLED_BOOTSTRAP, "sitecustomize.py")).read()
    (value,) = [node.value for node in ast.parse(source).body
                if isinstance(node, ast.Assign) and node.targets[0].id == "WATCHED"]
    assert set(ast.literal_eval(value)) == set(WATCHED_PACKAGES)


def test_start_up_loads_only_the_hook(make_env, tmp_path):
    # What a process that never imports a watched framework loads: the hook itself (from
    # a checkout also the package it lives in, whose __init__ does nothing at start-up,
    # and the chain helper when another sitecustomize follows on sys.path); never the API.
    code = "import sys; print(sorted(m for m in sys.modules if 'npu' in m))"
    hook = {"npu_shim", "npu_shim._bootstrap", "npu_shim._bootstrap.sitecustomize", "npu_shim._chain"}
    for path in (INSTALLED_BOOTSTRAP, REPO):
        proc = run([sys.executable, "-c", code], make_env(PYTHONPATH=path, PYTHONDONTWRITEBYTECODE="1"))
        assert proc.returncode == 0, proc.stderr
        assert set(eval(proc.stdout)) <= hook, (path, proc.stdout)
