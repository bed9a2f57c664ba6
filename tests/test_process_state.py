"""One way to each piece of process state: the settings (``_config.settings()``), the fork
handlers (``npu_shim._fork``), and the start-up finder adopted by identity."""
import ast
import json
import os
import textwrap

import npu_shim

PACKAGE = os.path.dirname(os.path.abspath(npu_shim.__file__))


def _calls(name):
    """``{relative path: [line, ...]}`` of every call to ``name`` (plain or attribute) in the package."""
    found = {}
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            with open(path, encoding="utf-8") as handle:
                tree = ast.parse(handle.read(), path)
            for node in ast.walk(tree):
                if isinstance(node, ast.Call):
                    func = node.func
                    called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
                    if called == name:
                        found.setdefault(os.path.relpath(path, PACKAGE), []).append(node.lineno)
    return found


def test_fork_handlers_are_registered_in_one_place():
    assert set(_calls("register_at_fork")) == {"_fork.py"}


def test_settings_are_made_only_by_the_accessor():
    """Every reader goes through _config.settings(); a Settings is constructed elsewhere
    only to validate (npu-shim run, before it launches anything) or to derive one choice."""
    assert set(_calls("Settings")) == {
        "_config.py",                       # settings() / read_settings(): the accessor
        "cli.py",                           # npu-shim run: validate the environment the child inherits
        os.path.join("testing", "moonvit.py"),   # env_choice: one choice validated
        os.path.join("testing", "mimo.py"),      # padded(): switches on for a block (use_settings)
    }


def test_the_engine_and_the_patches_name_no_variable():
    """The engine and the patches take NPU_SHIM* values from the settings; only the config
    (and the test-only emulation, selftests and test helpers, which set them) name one."""
    naming = set()
    for folder, _, files in os.walk(PACKAGE):
        for file in files:
            if not file.endswith(".py"):
                continue
            path = os.path.join(folder, file)
            with open(path, encoding="utf-8") as handle:
                tree = ast.parse(handle.read(), path)
            if any(isinstance(node, ast.Constant) and isinstance(node.value, str)
                   and node.value.startswith("NPU_SHIM_") and " " not in node.value
                   for node in ast.walk(tree)):
                naming.add(os.path.relpath(path, PACKAGE).split(os.sep)[0])
    assert naming <= {"_config.py", "__init__.py", "emulation", "selftest", "testing"}
    assert "_config.py" in naming


PROBE = textwrap.dedent('''
    import json, os
    import npu_shim
    from npu_shim import _config
    from npu_shim.patches.vllm import moonvit_attn
    first = _config.settings()
    os.environ["NPU_SHIM_MOONVIT_ATTN"] = "ascend_fa"   # after install: not read again
    os.environ["NPU_SHIM_STRICT"] = "1"
    print(json.dumps({"same": _config.settings() is first, "choice": moonvit_attn.selected_choice(),
                      "strict": _config.settings().strict,
                      "disabled": [r["name"] for r in npu_shim.status() if r["state"] == "disabled"]}))
''')


def test_the_engine_and_the_patches_read_the_settings_validated_at_install(run_python, make_env):
    out = run_python(PROBE, env=make_env(NPU_SHIM_MOONVIT_ATTN="sdpa", NPU_SHIM_DISABLE="sglang.cp_fia"))
    got = json.loads(out.stdout)
    assert got == {"same": True, "choice": "sdpa", "strict": False, "disabled": ["sglang.cp_fia"]}


def test_a_start_without_variables_keeps_the_defaults_and_adopts_the_start_finder(run_python, make_env):
    """Booted by the start-up hook with no NPU_SHIM* variable: the shim takes over its finder
    (the same place in sys.meta_path, no second finder), and variables set later are not read."""
    bootstrap = os.path.join(PACKAGE, "_bootstrap")
    code = textwrap.dedent('''
        import json, os, sys
        import sitecustomize
        start = sitecustomize.start_finder
        at = sys.meta_path.index(start)
        os.environ["NPU_SHIM_MOONVIT_ATTN"] = "sdpa"
        from npu_shim import _config, _startup
        print(json.dumps({"replaced": sys.meta_path[at] is _startup._State.finder,
                          "start_left": any(f is start for f in sys.meta_path),
                          "installed": _startup._State.installed,
                          "choice": _config.settings().moonvit_attn}))
    ''')
    out = run_python(code, env=make_env(PYTHONPATH=bootstrap))
    assert json.loads(out.stdout) == {"replaced": True, "start_left": False, "installed": True,
                                      "choice": "auto"}
