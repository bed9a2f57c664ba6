"""npu_shim/releases_read.json, the releases each family was read in (npu_shim.evidence): the one
place that states them, shipped with the package, consistent with the declarations, and extended
only by ``npu-shim evidence --record`` from what the lanes and probes found applied."""
import json
import os
import re

import pytest
from packaging.specifiers import SpecifierSet
from packaging.version import Version

from npu_shim import evidence, reference

pytestmark = pytest.mark.lanes("base")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def test_the_installed_package_ships_the_file_the_checkout_has():
    """Defect caught: the built package leaves the file out (setup.cfg package_data), and every
    family reads as read in no release."""
    assert os.path.exists(evidence.FILE), evidence.FILE
    with open(evidence.FILE, encoding="utf-8") as shipped, open(os.path.join(REPO, evidence.RELATIVE),
                                                                 encoding="utf-8") as checkout:
        assert shipped.read() == checkout.read()


def test_every_record_names_a_declared_family_and_a_release_its_fence_admits():
    """Defect caught: a record for a family renamed or removed, a family with no release read, a
    between-releases family with one, or a release outside the family's fence or the patch's
    window on that distribution (read for a family that could never apply there)."""
    declared = {patch.name: patch for patch, _ in reference.patches()}
    data = evidence.load()
    assert set(data) <= set(declared), sorted(set(data) - set(declared))
    for name, patch in declared.items():
        families = {family.name: family for family in patch.families}
        assert set(data.get(name, {})) <= set(families), (name, sorted(data.get(name, {})))
        for family in patch.families:
            releases = evidence.read(name, family.name)
            if family.between_releases:
                assert releases == [], (name, family.name, releases)
                continue
            assert releases, "%s: family %s is recorded as read in no release" % (name, family.name)
            dist = patch.family_dist(family)
            for release in releases:
                assert str(Version(release)) == release or Version(release), release
                if family.fence:
                    assert SpecifierSet(family.fence).contains(Version(release), prereleases=True), \
                        (name, family.name, release, family.fence)
                if dist in patch.requires:
                    assert any(SpecifierSet(spec).contains(Version(release), prereleases=True)
                               for spec in patch.window[dist]), (name, family.name, release, patch.window[dist])
            assert set(data[name][family.name].values()) <= {evidence.BY_HAND} | {
                how for how in data[name][family.name].values() if how.startswith(("lane ", "probe "))}


def test_the_file_is_as_the_tool_writes_it():
    """Defect caught: a hand edit (order, layout, an 'about' left stale) the tool would undo."""
    with open(os.path.join(REPO, evidence.RELATIVE), encoding="utf-8") as handle:
        text = handle.read()
    assert text == evidence.render(json.loads(text)["families"])


def test_record_adds_new_findings_upgrades_hand_reads_and_refuses_conflicts():
    families = {"p": {"old": {"1.0": evidence.BY_HAND, "1.1": evidence.BY_HAND}, "new": {"2.0": "lane a"}}}
    merged, lines, conflicts = evidence.merge(families, [
        {"source": "lane b", "found": {"p": {"old": "1.1", "new": "2.1"}, "q": {"only": "3.0"}}},
        {"source": "lane c", "found": {"p": {"new": "1.0"}}},
    ])
    assert merged == {"p": {"old": {"1.0": evidence.BY_HAND, "1.1": "lane b"}, "new": {"2.0": "lane a", "2.1": "lane b"}},
                      "q": {"only": {"3.0": "lane b"}}}
    assert conflicts == ["p: lane c found family new on 1.0, recorded as read for old"]
    assert families["p"]["old"]["1.1"] == evidence.BY_HAND      # the input is left as it was
    assert len(lines) == 3


def test_the_cli_records_the_reports_into_the_checkouts_file(tmp_path, capsys):
    import argparse

    (tmp_path / "npu_shim").mkdir()
    (tmp_path / evidence.RELATIVE).write_text(evidence.render({"p": {"f": {"1.0": evidence.BY_HAND}}}))
    lane = tmp_path / ".nox" / "reports" / "x"
    lane.mkdir(parents=True)
    (lane / "evidence.json").write_text(json.dumps({"source": "lane x", "found": {"p": {"f": "1.2"}}}))
    args = argparse.Namespace(root=str(tmp_path), reports=[], record=False)
    assert evidence.main(args) == 0
    assert "p f 1.2 (lane x): new" in capsys.readouterr().out
    assert json.loads((tmp_path / evidence.RELATIVE).read_text())["families"] == {"p": {"f": {"1.0": "by hand"}}}
    args.record = True
    assert evidence.main(args) == 0
    assert json.loads((tmp_path / evidence.RELATIVE).read_text())["families"] == {
        "p": {"f": {"1.0": "by hand", "1.2": "lane x"}}}
    (lane / "evidence.json").write_text(json.dumps({"source": "lane x", "found": {"p": {"g": "1.0"}}}))
    assert evidence.main(args) == 1
    assert "CONFLICT p: lane x found family g on 1.0, recorded as read for f" in capsys.readouterr().out



RELEASE = re.compile(r"(?<![\w.\-])\d+\.\d+(?!\d)")


def _docstrings_and_fences(tree):
    """Positions of the docstrings and of the string constants in ``fence=`` / ``requires=``."""
    import ast

    found = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found.add((first.value.lineno, first.value.col_offset))
        if isinstance(node, ast.keyword) and node.arg in ("fence", "requires"):
            found.update((sub.lineno, sub.col_offset) for sub in ast.walk(node.value) if isinstance(sub, ast.Constant))
    return found


def releases_named(root):
    """``path:line: token`` for every string or comment in the patch modules that names a release
    (``\\d+.\\d+``), docstrings (prose citing upstream) and fence= / requires= values left out."""
    import ast
    import io
    import tokenize

    hits = []
    for directory, _, files in sorted(os.walk(os.path.join(root, "npu_shim", "patches"))):
        for name in sorted(files):
            if not name.endswith(".py"):
                continue
            path = os.path.join(directory, name)
            with open(path, encoding="utf-8") as handle:
                text = handle.read()
            skip = _docstrings_and_fences(ast.parse(text))
            for token in tokenize.generate_tokens(io.StringIO(text).readline):
                if token.type in (tokenize.STRING, tokenize.COMMENT) and token.start not in skip \
                        and RELEASE.search(token.string):
                    hits.append("%s:%d: %s" % (os.path.relpath(path, root), token.start[0], token.string[:100]))
    return hits


def test_no_patch_module_names_a_release_outside_a_fence(tmp_path):
    """A family's fence is the only version fact in the code: no string or comment of a patch
    module names a release (the releases read are in npu_shim/releases_read.json, the window's
    ends in requires=). Defect caught: a releases list, a digest comment or an outside_window
    note typed into a module again, which the next release read makes stale."""
    assert releases_named(REPO) == []
    planted = tmp_path / "npu_shim" / "patches"
    planted.mkdir(parents=True)
    (planted / "demo.py").write_text('"""Read in 0.5.23 (a docstring may cite it)."""\n'
                                     'X = Family("m", keeps="", fence=">=0.5.11,<0.5.24")\n'
                                     'DIGEST = {"abc"}   # 0.5.11 .. 0.5.23\n'
                                     'NOTE = "releases after 0.5.23 not read"\n')
    assert releases_named(str(tmp_path)) == ["npu_shim/patches/demo.py:3: # 0.5.11 .. 0.5.23",
                                             'npu_shim/patches/demo.py:4: "releases after 0.5.23 not read"']
