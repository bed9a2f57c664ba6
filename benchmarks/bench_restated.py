"""How much of upstream's code the patches write out again: statements of npu_shim/patches found
verbatim in the installed upstream modules they patch.

Rule: every statement of every module under ``npu_shim/patches/`` (at any depth), compared as
``ast.unparse`` text (layout and comments do not count), against the statements of the installed
files of every patch's target module (read from the files, nothing imported). Left out on both
sides, as too small to be a restatement: docstrings and other lone constants, imports, ``pass``,
``break``, ``continue``, ``return`` of a plain name, constant or nothing. A compound statement
(``if``, ``for``, ``with``...) counts as one statement with its whole body, and each statement in
its body counts again.

    python benchmarks/bench_restated.py [--site SITE_PACKAGES ...] [--out FILE]

``--site``: the site-packages of lane venvs to compare against (default: this interpreter's); the
upstream statements are the union over them, so one run over several lanes' venvs counts what any
of their releases holds. Prints the total and the files with restated statements.
"""
import argparse
import ast
import os
import site
import sys
import sysconfig

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PATCHES = os.path.join(HERE, "npu_shim", "patches")


def statements(tree):
    for node in ast.walk(tree):
        if isinstance(node, ast.stmt) and not trivial(node):
            yield node


def trivial(node):
    if isinstance(node, (ast.Import, ast.ImportFrom, ast.Pass, ast.Break, ast.Continue, ast.Global, ast.Nonlocal)):
        return True
    if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant):
        return True
    if isinstance(node, ast.Return):
        return node.value is None or isinstance(node.value, (ast.Name, ast.Constant))
    return False


def text_of(path):
    with open(path, encoding="utf-8") as handle:
        return handle.read()


def patch_targets():
    sys.path.insert(0, HERE)
    from npu_shim.patches import BUILTIN_PATCHES
    import importlib

    return sorted({importlib.import_module(module).PATCH.target for _, module in BUILTIN_PATCHES})


def module_file(site_dir, dotted):
    base = os.path.join(site_dir, *dotted.split("."))
    for candidate in (base + ".py", os.path.join(base, "__init__.py")):
        if os.path.isfile(candidate):
            return candidate
    return None


def upstream_statements(sites, targets):
    found, files = set(), 0
    for site_dir in sites:
        for target in targets:
            path = module_file(site_dir, target)
            if path is None:
                continue
            files += 1
            found.update(ast.unparse(node) for node in statements(ast.parse(text_of(path))))
    return found, files


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--site", action="append", default=[],
                        help="a site-packages directory holding the upstream releases (repeatable)")
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)
    sites = args.site or [sysconfig.get_paths()["purelib"]] + site.getsitepackages()
    upstream, files = upstream_statements(sites, patch_targets())
    total, per_file = 0, []
    for root, _, names in os.walk(PATCHES):
        for name in sorted(names):
            if not name.endswith(".py"):
                continue
            path = os.path.join(root, name)
            mine = [ast.unparse(node) for node in statements(ast.parse(text_of(path)))]
            total += len(mine)
            restated = [s for s in mine if s in upstream]
            if restated:
                per_file.append((os.path.relpath(path, HERE), len(restated), len(mine)))
    lines = ["statements of npu_shim/patches restated verbatim from upstream: %d of %d "
             "(against %d upstream target files in %d site-packages)"
             % (sum(n for _, n, _ in per_file), total, files, len(sites)), ""]
    lines += ["%4d of %4d  %s" % (n, of, path) for path, n, of in sorted(per_file, key=lambda r: -r[1])]
    report = "\n".join(lines)
    print(report)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(report + "\n")


if __name__ == "__main__":
    main()
