"""The reference (docs/reference.md) is generated from the declarations, and CI catches drift."""
import ast
import dataclasses
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import pytest

from npu_shim import _config, evidence, reference
from npu_shim.patches import BUILTIN_PATCHES

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def check(root=REPO):
    return reference.main(SimpleNamespace(root=root, output=reference.OUTPUT, check=True))


def test_the_committed_reference_is_what_the_declarations_give(capsys):
    status = check()
    assert status == 0, capsys.readouterr().out


def test_the_cli_checks_the_reference():
    proc = subprocess.run([sys.executable, "-m", "npu_shim", "reference", "--check", "--root", REPO],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "up to date" in proc.stdout


def test_a_declaration_changed_without_regenerating_fails_with_a_diff(monkeypatch, capsys):
    module = __import__("npu_shim.patches.vllm_ascend.mm_encoder_attn", fromlist=["PATCH"])
    newest = module.PATCH.families[-1]
    grown = dataclasses.replace(newest, fence=newest.fence + ",<0.99")
    monkeypatch.setattr(module, "PATCH", dataclasses.replace(module.PATCH, families=module.PATCH.families[:-1] + (grown,)))
    assert check() == 1
    out = capsys.readouterr().out
    assert re.search(r"^\+.*<0\.99", out, re.M), out
    assert "differs from the declarations" in out


def test_a_release_recorded_as_read_without_regenerating_fails_with_a_diff(monkeypatch, capsys):
    """The reference's "releases read" come from npu_shim/releases_read.json (npu_shim.evidence),
    the one place that states them: a record added there changes the reference."""
    from npu_shim import evidence

    data = {patch: {family: dict(releases) for family, releases in by_family.items()}
            for patch, by_family in evidence.load().items()}
    newest = __import__("npu_shim.patches.vllm_ascend.mm_encoder_attn", fromlist=["PATCH"]).PATCH.families[-1]
    data["vllm.mm_encoder_attn"][newest.name]["0.99.0rc1"] = "probe probe-vllm-ascend-0.99.0rc1"
    monkeypatch.setitem(evidence._loaded, evidence.FILE, data)
    assert check() == 1
    out = capsys.readouterr().out
    assert re.search(r"^\+\| `%s` .*0\.99\.0rc1" % newest.name, out, re.M), out
    assert "differs from the declarations" in out


def test_a_missing_reference_fails(tmp_path, capsys):
    assert check(str(tmp_path)) == 1
    assert "differs from the declarations" in capsys.readouterr().out


@pytest.mark.parametrize("name, module", BUILTIN_PATCHES)
def test_every_patch_says_why_how_upstream_fix_and_remove_when(name, module):
    doc = __import__(module, fromlist=["PATCH"]).__doc__
    sections = reference.docstring_sections(doc)
    assert {"Why", "How", "Upstream fix", "Remove when"} <= set(sections), (name, sorted(sections))


def test_every_npu_shim_variable_the_code_reads_is_declared():
    declared = {row[0] for row in _config.VARIABLES}
    package = os.path.dirname(_config.__file__)
    used = set()
    for folder, _, files in os.walk(package):
        for filename in files:
            if filename.endswith(".py"):
                for node in ast.walk(ast.parse(open(os.path.join(folder, filename)).read())):
                    if isinstance(node, ast.Constant) and isinstance(node.value, str) \
                            and re.fullmatch(r"NPU_SHIM(_[A-Z0-9]+)*", node.value):
                        used.add(node.value)
    used.discard("NPU_SHIM_BOOT")   # the start-up hook's marker attribute, not a variable
    assert used <= declared, sorted(used - declared)


def test_docstring_sections_reads_indented_paragraphs():
    doc = "x — y.\n\nWhy: one\n  two.\nHow: three.\n\nUpstream fix: none.\nRemove when: later\n  on.\nOther."
    assert reference.docstring_sections(doc) == {"Why": "one two.", "How": "three.", "Upstream fix": "none.",
                                                 "Remove when": "later on."}


def test_the_lanes_run_figures_are_a_report_of_their_own_the_readme_links(tmp_path):
    """A CI run rewrites benchmarks/results/ci-lanes.txt; of the generated files only
    docs/lanes.md follows it. The README holds no generated block and no run figure."""
    import shutil

    readme = open(os.path.join(REPO, "README.md")).read()
    assert "](docs/lanes.md)" in readme
    assert "install s" not in readme and "<!-- lanes:" not in readme
    report = reference.render_lanes_report(REPO)
    for path in reference.lane_files(REPO):
        assert "`%s`" % os.path.basename(path)[:-4] in report
    # Another recorded run: the lanes report changes, the reference does not.
    shutil.copytree(os.path.join(REPO, "lanes"), str(tmp_path / "lanes"))
    (tmp_path / "benchmarks" / "results").mkdir(parents=True)
    recorded = open(os.path.join(REPO, reference.CI_LANES)).read()
    rerun = re.sub(r"^(base +\S+ +)\d+( +)\d+", r"\g<1>7\g<2>99", recorded, count=1, flags=re.M)
    assert rerun != recorded
    (tmp_path / reference.CI_LANES).write_text(rerun)
    assert "| `base` | torch" in reference.render_lanes_report(str(tmp_path))
    assert "| 7 | 99 |" in reference.render_lanes_report(str(tmp_path))
    assert "| 7 | 99 |" not in reference.render(str(tmp_path))


def test_the_release_table_says_tested_only_where_a_lane_stands_for_the_release(tmp_path):
    """Defect caught: the release table marking a release proven when no lane runs it (it used
    to list releases read, not releases covered). A release gets 'tested' from a lane's
    '# Stands for:' alone; take the lane away and the same cell says 'read only'."""
    import shutil

    from npu_shim import reference

    declared = reference.patches()
    (tmp_path / "lanes").mkdir()
    shutil.copy(os.path.join(REPO, "lanes", "vllm-0.18.txt"), str(tmp_path / "lanes"))

    def cell(root, dist, release, patch_name):
        lines = reference.render_releases(declared, str(root))
        section = lines[lines.index("### %s" % dist) + 2].splitlines()
        names = [name.strip(" `") for name in section[0].split("|")[2:-1]]
        row = next(r for r in section[2:] if r.split("|")[1].strip().split(" ")[0] == release)
        return row.split("|")[2 + names.index(patch_name)].strip()

    encoder = next(patch for patch, _ in declared if patch.name == "vllm.mm_encoder_attn")
    of_0_18, of_0_13 = (next(f.name for f in encoder.families if release in evidence.read(encoder.name, f.name))
                        for release in ("0.18.0", "0.13.0"))
    assert cell(tmp_path, "vllm-ascend", "0.18.0", "vllm.mm_encoder_attn") == "`%s` tested" % of_0_18
    assert cell(tmp_path, "vllm-ascend", "0.13.0", "vllm.mm_encoder_attn") == "`%s` read only" % of_0_13
    os.remove(str(tmp_path / "lanes" / "vllm-0.18.txt"))
    assert cell(tmp_path, "vllm-ascend", "0.18.0", "vllm.mm_encoder_attn") == "`%s` read only" % of_0_18
    assert cell(tmp_path, "vllm", "0.12.0", "vllm.glm4_1v_host_lengths") == "not served"


def test_benchmark_output_is_a_report_of_its_own_the_reference_links(tmp_path):
    """A benchmark's re-run rewrites docs/benchmarks.md only; the user's reference links each
    result and holds none of its text."""
    import shutil

    shutil.copytree(os.path.join(REPO, "lanes"), str(tmp_path / "lanes"))
    shutil.copytree(os.path.join(REPO, "benchmarks", "results"), str(tmp_path / "benchmarks" / "results"))
    before = reference.render(str(tmp_path)), reference.render_benchmarks_report(str(tmp_path))
    name = sorted(os.listdir(str(tmp_path / "benchmarks" / "results")))[-1]
    assert name.endswith(".txt")
    with open(str(tmp_path / "benchmarks" / "results" / name), "a") as handle:
        handle.write("a figure of another run\n")
    after = reference.render(str(tmp_path)), reference.render_benchmarks_report(str(tmp_path))
    assert after[0] == before[0]
    assert "a figure of another run" in after[1] and after[1] != before[1]
    assert "(benchmarks.md#%s)" % reference.anchor(name[:-4]) in after[0]
    assert "## %s" % name[:-4] in after[1]
