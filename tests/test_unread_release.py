"""A release newer than every release a family was read in (npu_shim/releases_read.json) gets
the family its code has, and ``npu-shim status`` says that release was not read yet; strict mode
refuses it. Toy patches on installed distributions (packaging, wrapt), the records injected."""
import json
import textwrap

import pytest

pytestmark = pytest.mark.lanes("base")

TOY = textwrap.dedent('''
    import json, sys, types
    sys.path.insert(0, {toy!r})
    import npu_shim
    from npu_shim import evidence
    from npu_shim.patch import Family, Patch
    evidence._loaded[evidence.FILE] = {{"toy.unread": {{"toy-shape": {{r: "by hand" for r in {read!r}}}}}}}
    family = Family(types.SimpleNamespace(check=lambda module, context: None,
                                          build=lambda module, context: {{"greet": lambda: "patched"}}),
                    keeps="", id="toy-shape", fence=">=1.0", dist="packaging")
    npu_shim.register(Patch(name="toy.unread", target="toy_unread", replaces=("greet",),
                            requires={{"wrapt": ">=1"}}, families=(family,)))
    try:
        import toy_unread
    finally:
        row = next(r for r in npu_shim.status() if r["name"] == "toy.unread")
        print(json.dumps({{"state": row["state"], "reason": row["reason"], "family": row["family"]}}))
''')


@pytest.fixture
def toy(tmp_path):
    (tmp_path / "toy_unread.py").write_text("def greet():\n    return 'hi'\n")
    return str(tmp_path)


def versions():
    import importlib.metadata

    return importlib.metadata.version("packaging"), importlib.metadata.version("wrapt")


def test_a_release_newer_than_every_release_read_applies_and_says_so(toy, run_python):
    packaging, wrapt = versions()
    row = json.loads(run_python(TOY.format(toy=toy, read=["1.0", "2.0"])).stdout.splitlines()[-1])
    assert row == {"state": "applied", "family": "toy-shape",
                   "reason": "wrapt %s; packaging %s; applied by structure; packaging %s not read yet "
                             "(newest read for family toy-shape: 2.0)" % (wrapt, packaging, packaging)}


def test_a_release_read_or_older_than_the_newest_read_has_no_note(toy, run_python):
    packaging, wrapt = versions()
    for read in ([packaging], ["1.0", "999.0"]):
        row = json.loads(run_python(TOY.format(toy=toy, read=read)).stdout.splitlines()[-1])
        assert row == {"state": "applied", "family": "toy-shape",
                       "reason": "wrapt %s; packaging %s" % (wrapt, packaging)}, read


def test_strict_mode_refuses_a_release_not_read_yet(toy, run_python, make_env):
    packaging, _ = versions()
    proc = run_python(TOY.format(toy=toy, read=["1.0"]), env=make_env(NPU_SHIM_STRICT="1"), check=False)
    assert proc.returncode != 0
    assert "PatchError: patch 'toy.unread' on toy_unread: family toy-shape accepts the code, but packaging " \
           "%s not read yet (newest read for family toy-shape: 1.0)" % packaging in proc.stderr, proc.stderr
    row = json.loads(proc.stdout.splitlines()[-1])
    assert (row["state"], row["family"]) == ("skipped", None), row
    assert "NPU_SHIM_STRICT=1 applies a family only to releases it was read in or older" in row["reason"]
    proc = run_python(TOY.format(toy=toy, read=[packaging]), env=make_env(NPU_SHIM_STRICT="1"))
    assert json.loads(proc.stdout.splitlines()[-1])["state"] == "applied"
