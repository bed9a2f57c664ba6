"""The gate of upstream's own unit tests (lanes/upstream_tests.py): its tables agree with the
lanes and the patches, and its verdicts fail the lane where they must. The suites themselves
run in the lanes (lanes/report.py); these checks need no upstream package."""
import hashlib
import importlib.util
import io
import os
import tarfile

import pytest

from npu_shim import reference

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _load():
    spec = importlib.util.spec_from_file_location("_upstream_tests", os.path.join(REPO, "lanes", "upstream_tests.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


U = _load()
SUITE = "vllm-ascend:mm_encoder_attention_310p"
FILE = "tests/ut/_310p/ops/test_mm_encoder_attention_310.py"
GQA = FILE + "::test_mm_encoder_attention_310_forward_oot_with_padding"
REGISTER = FILE + "::test_register_customop_overrides_mm_encoder_attention_for_310p"


def test_tables_are_consistent():
    assert U.table_problems() == []


def test_each_lane_installs_the_release_it_runs_the_tests_of():
    pinned = reference.lane_table(REPO)
    for lane, (dist, version) in U.LANES.items():
        assert lane in pinned, "lanes/upstream_tests.py names lane %s, which has no pin file" % lane
        assert pinned[lane].get(dist) == version, (lane, dist, pinned[lane].get(dist), version)


def test_suites_name_declared_patches():
    names = {patch.name for patch, _ in reference.patches()}
    for suite in U.SUITES:
        assert set(suite.patches) <= names, suite


def test_a_window_may_join_specifiers():
    assert U.in_window("0.18.0", "<0.21.0rc1 | >=0.28.0rc1") and U.in_window("0.30.0rc2", "<0.21.0rc1 | >=0.28.0rc1")
    assert not U.in_window("0.26.0rc1", "<0.21.0rc1 | >=0.28.0rc1")


def test_commits_are_full_where_upstreams_repository_was_read():
    for (dist, version), pin in U.PINS.items():
        assert len(pin.sha256) == 64
        if pin.commit_from != U.SCM:
            assert len(pin.commit) == 40, (dist, version)
        else:
            assert len(pin.commit) >= 7, (dist, version)


def _stats(calls=1, state="applied"):
    return {"vllm.mm_encoder_attn_310p": {"state": state, "family": "some-family", "calls": calls}}


def _judge(tests, version="0.18.0", stats=None):
    suites = U.suites_of("vllm-ascend", version)
    suites = [suite for suite in suites if suite.name == SUITE]
    return U.judge(suites, version, {"tests": tests, "stats": _stats() if stats is None else stats})


def test_declared_differences_are_declared_different():
    rows, problems = _judge({GQA: {"outcome": "failed"}, REGISTER: {"outcome": "failed"}}, version="0.28.0rc1")
    assert problems == []
    assert (rows[0]["passed"], rows[0]["declared"], rows[0]["failed"]) == (0, 2, 0)
    # 0.18.0: the register test is declared only from 0.28.0rc1 (below 0.21.0rc1 it runs on the emulated device)
    rows, problems = _judge({GQA: {"outcome": "failed"}, REGISTER: {"outcome": "passed"}})
    assert problems == []
    assert (rows[0]["passed"], rows[0]["declared"], rows[0]["failed"]) == (1, 1, 0)


def test_an_undeclared_failure_fails_the_lane():
    # 0.21.0rc1: the register test is declared only from 0.28.0rc1
    rows, problems = _judge({GQA: {"outcome": "failed"}, REGISTER: {"outcome": "failed", "message": "boom"}},
                            version="0.21.0rc1")
    assert rows[0]["failed"] == 1
    assert any("without a declared difference: boom" in problem for problem in problems)


def test_a_declared_difference_that_stops_happening_is_stale():
    rows, problems = _judge({GQA: {"outcome": "passed"}, REGISTER: {"outcome": "passed"}})
    assert rows[0]["failed"] == 1
    assert any("a stale declaration" in problem and GQA in problem for problem in problems)


def test_a_declared_difference_whose_test_is_gone_is_stale():
    _, problems = _judge({REGISTER: {"outcome": "failed"}})
    assert any("matched no test that ran: a stale declaration" in problem for problem in problems)


@pytest.mark.parametrize("stats, expected", [({}, "was absent"), (_stats(state="skipped"), "was skipped"),
                                             (_stats(calls=0), "no test reached it")])
def test_a_suite_that_did_not_test_the_shim_fails(stats, expected):
    _, problems = _judge({GQA: {"outcome": "failed"}, REGISTER: {"outcome": "passed"}}, stats=stats)
    assert any(expected in problem for problem in problems)


def _archive(tmp_path, commit="e18643f8a"):
    path = tmp_path / "vllm_ascend-0.18.0.tar.gz"
    files = {FILE: b"def test_x():\n    pass\n", "tests/ut/conftest.py": b"", "tests/ut/base.py": b"",
             "tests/__init__.py": b"", "tests/ut/__init__.py": b"", "tests/ut/other/test_y.py": b"",
             "tests/ut/other/conftest.py": b"", "tests/ut/helpers/golden.py": b"",
             "vllm_ascend/_version.py": ("__commit_id__ = commit_id = 'g%s'\n" % commit).encode()}
    with tarfile.open(path, "w:gz") as archive:
        for name, data in files.items():
            info = tarfile.TarInfo("vllm_ascend-0.18.0/" + name)
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return str(path), hashlib.sha256(path.read_bytes()).hexdigest()


def test_extract_takes_the_suite_and_what_it_imports(tmp_path):
    path, digest = _archive(tmp_path)
    pin = U.Pin(digest, "e18643f8a4d5bd9990727654318ad069ea0b56e2", "test")
    chosen, problems = U.extract(path, pin, [s for s in U.SUITES if s.name == SUITE], str(tmp_path / "x"))
    assert problems == []
    assert sorted(chosen) == sorted([FILE, "tests/__init__.py", "tests/ut/__init__.py", "tests/ut/base.py",
                                     "tests/ut/conftest.py", "tests/ut/helpers/golden.py"])
    assert (tmp_path / "x" / "tests" / "ut" / "_310p" / "ops" / "test_mm_encoder_attention_310.py").exists()
    assert not (tmp_path / "x" / "tests" / "ut" / "other").exists()


def test_extract_refuses_an_archive_that_is_not_the_pinned_one(tmp_path):
    path, digest = _archive(tmp_path)
    chosen, problems = U.extract(path, U.Pin("0" * 64, "e18643f8a", "test"), U.SUITES[1:], str(tmp_path / "x"))
    assert chosen == [] and "but PINS pins" in problems[0]
    _, problems = U.extract(path, U.Pin(digest, "5cb98caaadeff42b", "test"), U.SUITES[1:], str(tmp_path / "y"))
    assert "_version.py names commit e18643f8a" in problems[0]


def test_a_standin_names_a_module_function_or_a_class_method():
    assert U._standin_target("vllm_ascend.utils.adapt_patch") == ("vllm_ascend.utils", "adapt_patch")
    assert U._standin_target("vllm.platforms.interface:Platform.get_global_graph_pool") == (
        "vllm.platforms.interface", "Platform.get_global_graph_pool")


def test_a_class_method_standin_answers_its_declared_value():
    import types

    class Platform:
        def get_global_graph_pool(self):
            return self.graph_pool_handle()    # upstream's: None is not callable on the CPU platform

    module = types.ModuleType("fake_interface")
    module.Platform = Platform
    dotted = "fake_interface:Platform.get_global_graph_pool"
    U.STANDIN_VALUES[dotted] = U.STANDIN_GRAPH_POOL
    try:
        U._install_standins(module, [(dotted, "Platform.get_global_graph_pool")])
        assert Platform().get_global_graph_pool() is U.STANDIN_GRAPH_POOL
        assert U.STANDINS_CALLED[dotted] == 1
    finally:
        U.STANDIN_VALUES.pop(dotted)
    with pytest.raises(RuntimeError, match="has no function"):
        U._install_standins(module, [("fake_interface:Platform.gone", "Platform.gone")])


def test_the_graph_pool_standin_is_declared_where_the_encoder_suite_runs():
    name = "vllm.platforms.interface:Platform.get_global_graph_pool"
    window, why = U.CONFTEST_STANDINS[name]
    assert name in U.STANDIN_VALUES and why
    encoder = next(s for s in U.SUITES if s.name == "vllm-ascend:encoder_acl_graph")
    for dist, version in U.LANES.values():
        if U.in_window(version, encoder.releases):
            assert U.in_window(version, window), version


def test_an_edited_patch_is_reached_by_its_traced_calls():
    suite = next(s for s in U.SUITES if s.name == "vllm-ascend:attention_v1")
    node = suite.files[0] + "::test_x"
    release = next(version for _, version in U.LANES.values() if U.in_window(version, suite.releases))
    stats = {"vllm.ascend_attention_v_head_dim": {"state": "applied", "family": "any-family", "calls": 0}}
    rows, problems = U.judge([suite], release, {"tests": {node: {"outcome": "passed"}}, "stats": stats})
    assert any("no test reached it" in problem for problem in problems)
    rows, problems = U.judge([suite], release, {"tests": {node: {"outcome": "passed"}}, "stats": stats,
                                                 "reached": {"vllm.ascend_attention_v_head_dim": 3}})
    assert problems == [] and rows[0]["reached"] == {"vllm.ascend_attention_v_head_dim": 3}


def test_reach_counts_only_the_installed_replacements_code():
    import sys
    import types

    module = types.ModuleType("npu_shim_fake_target")

    def calc_split_factor(x):
        return x

    module.calc_split_factor = calc_split_factor
    reach = U.Reach.__new__(U.Reach)
    reach.watch = {"calc_split_factor": [("fake.patch", module.__name__, ("calc_split_factor",))]}
    reach.known, reach.calls = {}, __import__("collections").Counter()
    sys.modules[module.__name__] = module
    try:
        def other():
            def calc_split_factor(x):   # same name, another code object
                return x
            return calc_split_factor

        sys.settrace(reach.trace)
        try:
            module.calc_split_factor(1)
            other()(1)
        finally:
            sys.settrace(None)
    finally:
        del sys.modules[module.__name__]
    assert reach.calls == {"fake.patch": 1}


def test_releases_whose_conftest_expects_torch_npu_run_on_the_emulated_device():
    # below 0.21.0rc1 upstream's conftest sets no torch.npu stand-in; from it, its own stand-in replaces torch_npu
    assert U.emulated_device("0.18.0") and U.emulated_device("0.20.2rc1")
    assert not U.emulated_device("0.21.0rc1") and not U.emulated_device("0.30.0rc2")


def test_a_standin_imports_what_the_real_call_imported_in_its_window():
    import sys
    import types

    dotted = "npu_shim_fake_utils.adapt_patch"
    imported = "npu_shim_fake_speculator"
    module = types.ModuleType("npu_shim_fake_utils")
    module.adapt_patch = lambda: None
    window = ">=1.0,<2.0"
    U.STANDIN_IMPORTS[dotted] = ((window, (imported,), "test"),)
    finder = type("Finder", (), {"find_spec": staticmethod(
        lambda name, path=None, target=None: importlib.util.spec_from_loader(name, _EmptyLoader())
        if name == imported else None)})
    sys.meta_path.insert(0, finder)
    old = os.environ.get("NPU_SHIM_UPSTREAM_RELEASE")
    try:
        assert U.standin_imports(dotted, "1.5") == [imported] and U.standin_imports(dotted, "2.0") == []
        U._install_standins(module, [(dotted, "adapt_patch")])
        os.environ["NPU_SHIM_UPSTREAM_RELEASE"] = "2.0"
        module.adapt_patch()
        assert imported not in sys.modules
        os.environ["NPU_SHIM_UPSTREAM_RELEASE"] = "1.5"
        module.adapt_patch()
        assert imported in sys.modules and U.STANDINS_CALLED[dotted] == 2
    finally:
        sys.meta_path.remove(finder)
        sys.modules.pop(imported, None)
        U.STANDIN_IMPORTS.pop(dotted)
        if old is None:
            os.environ.pop("NPU_SHIM_UPSTREAM_RELEASE", None)
        else:
            os.environ["NPU_SHIM_UPSTREAM_RELEASE"] = old


class _EmptyLoader:
    def create_module(self, spec):
        return None

    def exec_module(self, module):
        pass


def test_standin_imports_are_declared_for_a_standin_in_a_suites_window():
    for dotted, entries in U.STANDIN_IMPORTS.items():
        assert dotted in U.CONFTEST_STANDINS, dotted
        for window, modules, why in entries:
            assert modules and why
            assert any(U.in_window(version, window) and U.suites_of(dist, version)
                       for dist, version in U.LANES.values()), (dotted, window)
