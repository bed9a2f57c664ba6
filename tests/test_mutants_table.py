"""lanes/mutants.py: the check that every mutant of ``nox -s mutants`` still applies
(``nox -s mutants_apply``, run by .ci/run) fails naming the mutant, the file and the text when
an edit's text is gone or found twice, or its lane or file is missing; ``apply`` writes the
same edits, in order. The checker is run on small trees here: whether this checkout's own
table applies is the CI step's question (in a mutant's scratch copy its own edit is applied,
so a test of it here would fail every base-lane mutant)."""
import importlib.util
import os

import pytest

pytestmark = pytest.mark.lanes("base")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def table():
    spec = importlib.util.spec_from_file_location("_npu_shim_lanes_mutants", os.path.join(REPO, "lanes", "mutants.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def tree(root, files):
    for path, text in files.items():
        os.makedirs(os.path.dirname(os.path.join(root, path)), exist_ok=True)
        with open(os.path.join(root, path), "w", encoding="utf-8") as handle:
            handle.write(text)
    return str(root)


BASE = {"lanes/base.txt": "# Lane base\n", "pkg/op.py": "x = read(host(t))\ny = 1\n", "tests/t.py": "mark = 1\n"}


def test_a_table_that_applies_has_no_problem_and_apply_writes_every_edit_in_order(table, tmp_path):
    root = tree(tmp_path, BASE)
    entry = table.mutant("a", "the read moves", "base", "host_arg",
                         ("pkg/op.py", "read(host(t))", "read(t)"), ("pkg/op.py", "y = 1\n", "y = 2\n"),
                         ("tests/t.py", "", "more = 2\n"))
    assert table.problems(root, (entry,)) == []
    table.apply(root, entry)
    assert open(os.path.join(root, "pkg/op.py")).read() == "x = read(t)\ny = 2\n"
    assert open(os.path.join(root, "tests/t.py")).read() == "mark = 1\nmore = 2\n"


def test_a_gone_text_names_the_mutant_the_file_and_the_text(table, tmp_path):
    root = tree(tmp_path, dict(BASE, **{"pkg/op.py": "x = read(host_values(t))\n"}))
    entry = table.mutant("a", "the read moves", "base", "host_arg", ("pkg/op.py", "read(host(t))", "read(t)"))
    assert table.problems(root, (entry,)) == [
        "mutant a, edit 1 of 1 (pkg/op.py): 'read(host(t))' occurs 0 times, not once"]
    with pytest.raises(table.AnchorGone, match="mutant a, edit 1 of 1"):
        table.apply(root, entry)
    assert open(os.path.join(root, "pkg/op.py")).read() == "x = read(host_values(t))\n"   # nothing written


def test_a_text_found_twice_a_second_edit_undone_by_the_first_and_a_missing_file_are_refused(table, tmp_path):
    root = tree(tmp_path, dict(BASE, **{"pkg/op.py": "x = read(host(t))\nz = read(host(t))\n"}))
    twice = table.mutant("b", "d", "base", "e", ("pkg/op.py", "read(host(t))", "read(t)"))
    chained = table.mutant("c", "d", "base", "e", ("tests/t.py", "mark = 1", "mark = 2"),
                           ("tests/t.py", "mark = 1", "mark = 3"))
    missing = table.mutant("d", "d", "base", "e", ("pkg/gone.py", "", "x\n"))
    found = table.problems(root, (twice, chained, missing))
    assert found[0] == "mutant b, edit 1 of 1 (pkg/op.py): 'read(host(t))' occurs 2 times, not once"
    assert found[1] == "mutant c, edit 2 of 2 (tests/t.py): 'mark = 1' occurs 0 times, not once"
    assert found[2].startswith("mutant d, edit 1 of 1 (pkg/gone.py): cannot read the file"), found
    assert len(found) == 3


def test_an_undefined_lane_a_missing_expected_text_a_no_op_edit_and_a_reused_id_are_refused(table, tmp_path):
    root = tree(tmp_path, dict(BASE, **{"lanes/_common.txt": ""}))
    entries = (table.mutant("a", "d", "vllm-0.99", "e", ("tests/t.py", "mark", "m")),
               table.mutant("b", "d", "_common", "", ("tests/t.py", "mark", "mark")),
               table.mutant("a", "d", "base", "e"))
    assert table.problems(root, entries) == [
        "mutant a: the id is used 2 times",
        "mutant a: lane 'vllm-0.99' has no pin file lanes/vllm-0.99.txt",
        "mutant b: no expected text (any failure of the lane would count as the catch)",
        "mutant b: lane '_common' has no pin file lanes/_common.txt",
        "mutant b, edit 1 of 1 (tests/t.py): the edit changes nothing",
        "mutant a: no edit"]


def test_the_command_says_which_mutant_no_longer_applies(table, tmp_path, capsys):
    """``python lanes/mutants.py check``: exit status 0 and the count while every mutant applies,
    1 and the mutant's edit and text once one is gone."""
    root = tree(tmp_path, BASE)
    entries = (table.mutant("a", "d", "base", "e", ("pkg/op.py", "read(host(t))", "read(t)")),
               table.mutant("b", "d", "base", "e", ("tests/t.py", "", "x\n")))
    assert table.main(["check"], root, entries) == 0
    assert "mutants: all 2 apply (2 edits" in capsys.readouterr().out
    tree(tmp_path, {"pkg/op.py": "x = read(host_values(t))\n"})
    assert table.main(["check"], root, entries) == 1
    out = capsys.readouterr().out
    assert "MUTANT BROKEN: mutant a, edit 1 of 1 (pkg/op.py): 'read(host(t))' occurs 0 times" in out, out
    assert "mutant b" not in out and "1 problem(s) in the 2 mutants" in out, out
    assert table.main([]) == 2
