"""The core has no import cycle: every ``npu_shim`` module's imports, function-level
ones included, form a directed acyclic graph; and the start-up side never reaches the engine
or the API at module level."""
import ast
import os

import npu_shim

PACKAGE_DIR = os.path.dirname(npu_shim.__file__)


def module_name(path):
    relative = os.path.relpath(path, os.path.dirname(PACKAGE_DIR))[:-3].replace(os.sep, ".")
    return relative[:-len(".__init__")] if relative.endswith(".__init__") else relative


def modules():
    found = {}
    for folder, _, files in os.walk(PACKAGE_DIR):
        if "_site" in folder.split(os.sep):   # the emulated torch_npu tree: not npu_shim's modules
            continue
        for name in files:
            if name.endswith(".py"):
                path = os.path.join(folder, name)
                found[module_name(path)] = path
    return found


def imports_of(name, path, known):
    """npu_shim modules ``name`` imports anywhere in its file (``from npu_shim import x``
    counts as importing ``npu_shim.x`` when that is a module)."""
    package = name if path.endswith("__init__.py") else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(open(path).read())):
        if isinstance(node, ast.Import):
            out.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                parts = package.split(".")
                base = ".".join(parts[:len(parts) - node.level + 1] + ([base] if base else []))
            for alias in node.names:
                out.add(base + "." + alias.name if base + "." + alias.name in known else base)
    return {m for m in out if m in known and m != name}


def graph():
    known = modules()
    return {name: imports_of(name, path, known) for name, path in known.items()}


def find_cycle(edges):
    state, stack = {}, []

    def visit(node):
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(edges[node]):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt):] + [nxt]
            if nxt not in state:
                cycle = visit(nxt)
                if cycle:
                    return cycle
        state[node] = "done"
        stack.pop()
        return None

    for node in sorted(edges):
        if node not in state:
            cycle = visit(node)
            if cycle:
                return cycle
    return None


def test_no_import_cycle_among_npu_shim_modules():
    cycle = find_cycle(graph())
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_the_cycle_finder_finds_one():
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": set()}) is None


def test_the_graph_sees_function_level_imports():
    edges = graph()
    assert "npu_shim.engine.registry" in edges["npu_shim._startup"]   # imported inside a function


def test_layers_engine_never_imports_the_start_up_side_or_the_api():
    edges = graph()
    for name, imported in edges.items():
        if name.startswith("npu_shim.engine"):
            assert not imported & {"npu_shim._startup", "npu_shim.api", "npu_shim.cli"}, (name, imported)
    assert edges["npu_shim._startup"] <= {"npu_shim._config", "npu_shim._fork", "npu_shim.patches",
                                          "npu_shim.emulation", "npu_shim.engine.registry"}
    # The fork registry sits under the start-up side and the engine alike: it imports none of the shim.
    assert not edges.get("npu_shim._fork")


def test_status_imports_no_framework_and_no_torch(run_python, make_env):
    """``npu-shim status`` imports every patch's declaration; none may import torch (or a patched
    framework): in an environment without torch, the README's first command must still run."""
    out = run_python("import json, sys\n"
                     "from npu_shim import cli\n"
                     "cli.main(['status', '--json'])\n"
                     "print(json.dumps(sorted(m for m in ('torch', 'vllm', 'vllm_ascend', 'sglang', "
                     "'transformers') if m in sys.modules)))", env=make_env())
    assert out.stdout.strip().splitlines()[-1] == "[]", out.stdout[-2000:]
