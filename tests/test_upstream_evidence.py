"""docs/upstream-evidence.md is hand-written; what it quotes of the code must exist and match
the declarations: every npu_shim path and module, every patch name, every family (in a table
column named "family" or written "family `X`"), every fence (a "fence (<dist>)" column) and
every guard ("Guard: `<dist><specifier>`", which is the patch's ``requires``).

A patch's section starts at a heading naming it, or at a paragraph opening with its name in
bold; families, fences and guards are checked against the patch of the section they are in.
"""
import importlib
import os
import re
import sys

import pytest
from packaging.specifiers import SpecifierSet

from npu_shim import reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join(REPO, "docs", "upstream-evidence.md")

# Upstream modules of two parts that the notes quote, beside the patch names (which have the
# same form): anything else of that form must be a declared patch.
UPSTREAM_MODULES = {"transformers.activations", "transformers.modeling_utils", "vllm.distributed",
                    "vllm.sequence"}


def _declared():
    return {patch.name: patch for patch, _ in reference.patches()}


def _lines():
    with open(DOC, encoding="utf-8") as handle:
        return handle.read().splitlines()


def _sections(patches):
    """``[(line number, line, patch or None)]``: each line with the patch of its section.

    A heading naming a patch opens its section; a deeper heading naming none stays in it.
    """
    current, level = None, 0
    out = []
    for number, line in enumerate(_lines(), 1):
        names = [n for n in re.findall(r"`([\w.]+)`", line) if n in patches]
        heading = re.match(r"(#+) ", line)
        if heading:
            depth = len(heading.group(1))
            if names:
                current, level = patches[names[0]], depth
            elif depth <= level or current is None:
                current, level = None, 0
        else:
            lead = re.match(r"\*\*`([\w.]+)`\*\*", line)
            if lead and lead.group(1) in patches:
                current = patches[lead.group(1)]
        out.append((number, line, current))
    return out


def _text():
    return "\n".join(_lines())


def test_every_npu_shim_path_it_quotes_exists():
    paths = set(re.findall(r"\bnpu_shim/[\w/.]*\w/?", _text()))
    assert paths, "the notes quote no npu_shim path: the pattern no longer matches them"
    missing = sorted(p for p in paths if not os.path.exists(os.path.join(REPO, p)))
    assert missing == []


def _resolves(dotted):
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            obj = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        try:
            for attribute in parts[cut:]:
                obj = getattr(obj, attribute)
        except AttributeError:
            return False
        return True
    return False


def test_every_npu_shim_module_it_quotes_resolves():
    names = set(re.findall(r"`(npu_shim(?:\.\w+)+)(?:\(\))?`", _text()))
    assert names
    assert sorted(n for n in names if not _resolves(n)) == []


def test_every_patch_name_it_quotes_is_declared():
    patches = _declared()
    namespaces = {name.split(".")[0] for name in patches}
    quoted = {n for n in re.findall(r"`(\w+\.\w+)`", _text()) if n.split(".")[0] in namespaces}
    assert quoted & set(patches), "the notes name no patch: the pattern no longer matches them"
    assert sorted(quoted - set(patches) - UPSTREAM_MODULES) == []


def _table_rows(sections):
    """``(line number, patch, {column: cell})`` of every table row, by its header's columns."""
    header = None
    for number, line, patch in sections:
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = cells
        elif not set("".join(cells)) <= set("-: "):
            yield number, patch, dict(zip(header, cells))


def test_every_family_and_fence_it_quotes_is_the_declared_one():
    sections = _sections(_declared())
    checked = 0
    for number, patch, row in _table_rows(sections):
        if "family" not in row:
            continue
        assert patch is not None, "line %d: a family column outside a patch's section" % number
        families = {f.name: f for f in patch.families}
        names = re.findall(r"`([^`]+)`", row["family"])
        assert names, "line %d: the family cell quotes no family: %r" % (number, row["family"])
        for name in names:
            assert name in families, "line %d: %s has no family %r (it has %s)" % (
                number, patch.name, name, ", ".join(families))
            checked += 1
        for column, cell in row.items():
            fence_of = re.fullmatch(r"fence \(([\w-]+)\)", column)
            if fence_of:
                family = families[names[0]]
                assert patch.family_dist(family) == fence_of.group(1), "line %d" % number
                assert re.findall(r"`([^`]+)`", cell) == [family.fence], "line %d: %s fence" % (number, family.name)
    for number, line, patch in sections:
        for name in re.findall(r"\bfamily `([^`]+)`", line):
            assert patch is not None and name in {f.name for f in patch.families}, \
                "line %d: family %r is not one of its patch's" % (number, name)
            checked += 1
    assert checked, "no family checked: the notes' tables no longer have a family column"


def test_every_guard_it_quotes_is_the_patchs_requirement():
    sections = _sections(_declared())
    joined = "\n".join(line for _, line, _ in sections)
    # A guard may wrap over two lines: read it from the text, then find its line's patch.
    starts = [0]
    for _, line, _ in sections:
        starts.append(starts[-1] + len(line) + 1)
    checked = 0
    for match in re.finditer(r"[Gg]uard(?: is)?:?\*{0,2}\s+`([^`]+)`((?:,?\s+or\s+`[^`]+`)*)", joined):
        number = next(i for i, start in enumerate(starts) if start > match.start())
        patch = sections[number - 1][2]
        assert patch is not None, "line %d: a guard outside a patch's section" % number
        dist, spec = re.match(r"([\w-]+)\s*(.*)", match.group(1).replace("\n", "")).groups()
        assert dist in patch.requires, "line %d: %s does not require %s" % (number, patch.name, dist)
        # the window the guard reads (Patch.window: requires, or the families' fences), each
        # alternative quoted ("`dist>=a,<b` or `>=c`")
        quoted = [spec] + re.findall(r"`([^`]+)`", match.group(2) or "")
        assert [SpecifierSet(s) for s in quoted] == [SpecifierSet(s) for s in patch.window[dist]], \
            "line %d: guard %s %s, %s's window is %s" % (number, dist, " or ".join(quoted), patch.name,
                                                       patch.window_text(dist))
        checked += 1
    assert checked, "no guard checked: the pattern no longer matches the notes"


@pytest.mark.parametrize("bad, found", [
    ("`npu_shim/patches/nowhere.py`", "path"),
    ("| family |\n|---|\n| `0.99` |", "family"),
    ("| family | fence (vllm-ascend) |\n|---|---|\n| `0.22.1rc1` | `>=0.22.0rc1` |", "family"),
    ("**Guard:** `vllm-ascend>=0.12`", "guard"),
    ("`vllm.no_such_patch`", "patch"),
])
def test_the_checks_catch_what_they_exist_for(tmp_path, monkeypatch, bad, found):
    """Each check fails on a line that quotes something the code does not have."""
    doc = tmp_path / "evidence.md"
    doc.write_text("## 3. `vllm.mm_encoder_attn` — x\n\n" + bad + "\n", encoding="utf-8")
    monkeypatch.setattr(sys.modules[__name__], "DOC", str(doc))
    check = {"path": test_every_npu_shim_path_it_quotes_exists,
             "family": test_every_family_and_fence_it_quotes_is_the_declared_one,
             "guard": test_every_guard_it_quotes_is_the_patchs_requirement,
             "patch": test_every_patch_name_it_quotes_is_declared}[found]
    with pytest.raises(AssertionError):
        check()
