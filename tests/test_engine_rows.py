"""Every row of the README's "What it fixes" says whether an engine shows it, and the docs agree.

The README's column "through an engine" and docs/validation.md's table "The README's rows through the
engines" are written by hand beside the engine tests. This check ties them together: each README row
has one line in the docs' table (by its framework cell) and no line names a row the README no longer
has; a line's engine tests exist under tests/lanes/ and are marked ``engine`` (a test renamed, or made
a unit test, leaves the claim without its proof); a README cell says "no" exactly where the docs name
no engine test.
"""
import os
import re

import pytest

pytestmark = pytest.mark.lanes("base")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
README_HEADER = "| framework | releases | fix | through an engine |"
DOCS_HEADING = "## The README's rows through the engines"
DOCS_HEADER = "| README row | engine tests | shown through the engine | not through an engine, and why |"
ENGINE_MARK = re.compile(r"pytest\.mark\.engine\b")


def _read(relative):
    with open(os.path.join(REPO, relative), encoding="utf-8") as handle:
        return handle.read()


def table_after(text, header):
    """The rows (lists of stripped cells) of the markdown table opened by ``header`` in ``text``."""
    if header not in text:
        raise AssertionError("table header not found: %s" % header)
    lines = text.split(header, 1)[1].splitlines()[2:]  # past the header's own line end and the rule
    rows = []
    for line in lines:
        if not line.startswith("|"):
            break
        # a cell may hold `a | b` inside backticks: README cells do not, so plain splitting holds
        rows.append([cell.strip() for cell in line.strip().strip("|").split(" | ")])
    return rows


def readme_rows():
    return {row[0]: row[-1] for row in table_after(_read("README.md"), README_HEADER)}


def docs_rows():
    text = _read(os.path.join("docs", "validation.md"))
    if DOCS_HEADING not in text:
        raise AssertionError("docs/validation.md has no section %r" % DOCS_HEADING)
    section = text.split(DOCS_HEADING, 1)[1]
    return {row[0]: row for row in table_after(section, DOCS_HEADER)}


def engine_tests(cell):
    return [] if cell == "none" else [name.strip() for name in cell.split(",")]


def test_every_readme_row_has_one_line_in_the_docs():
    readme, docs = readme_rows(), docs_rows()
    assert readme and docs, "a table was not found or is empty"
    assert sorted(set(readme) - set(docs)) == [], "README rows with no line in docs/validation.md"
    assert sorted(set(docs) - set(readme)) == [], "docs/validation.md lines for rows the README does not have"


def test_named_engine_tests_exist_and_start_an_engine():
    problems = []
    for row, cells in docs_rows().items():
        for name in engine_tests(cells[1]):
            path = os.path.join(REPO, "tests", "lanes", name)
            if not os.path.isfile(path):
                problems.append("%s: %s is not a file under tests/lanes" % (row, name))
            elif not ENGINE_MARK.search(_read(os.path.relpath(path, REPO))):
                problems.append("%s: %s is not marked engine" % (row, name))
    assert problems == []


def test_readme_says_no_exactly_where_no_engine_test_is_named():
    readme, docs = readme_rows(), docs_rows()
    disagree = []
    for row, cells in docs.items():
        says_no = readme.get(row, "").startswith("no")
        if says_no != (not engine_tests(cells[1])):
            disagree.append("%s: README %r, docs %r" % (row, readme.get(row), cells[1]))
        if not says_no and not cells[2]:
            disagree.append("%s: names engine tests but not what they show" % row)
    assert disagree == []
