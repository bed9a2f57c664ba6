"""Living beside other plugins: a target that another tool has already replaced is refused by
structure, and status names what stands there.

vllm-ascend-split-batch, for one, swaps the ``__code__`` of a vllm-ascend method and proxies a
torch_npu op. Here a stand-in plugin does the same to ``vllm_ascend.utils.calc_split_factor`` (the
target of ``vllm.ascend_kv_split_exact``, an edit of upstream's function) before the shim installs,
in a fresh interpreter on the real wheel: once by swapping the function's ``__code__`` for code of
its own file, once by putting a ``functools.wraps`` wrapper in the module. Either way the edit was
written for upstream's code, not the other tool's: the patch is not applied, and the reason names
the other tool's file or wrapper. Without the stand-in the patch applies (the control).
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

PATCH = "vllm.ascend_kv_split_exact"
# fresh interpreters, 10-40 s each: one lane per family is enough to show the engine refuses by structure
pytestmark = [pytest.mark.claimed(PATCH, per_family=True), pytest.mark.patch(PATCH)]

PLUGIN = '''
import functools

import vllm_ascend.utils as utils


def calc_split_factor(num_list):
    """The other tool's version: the same arithmetic, its own code."""
    total = sum(num_list)
    return [total / num for num in num_list]


def swap_code():
    utils.calc_split_factor.__code__ = calc_split_factor.__code__


def wrap():
    upstream = utils.calc_split_factor

    @functools.wraps(upstream)
    def calc_split_factor_traced(num_list):
        return upstream(num_list)

    utils.calc_split_factor = calc_split_factor_traced
'''

RUN = textwrap.dedent('''
    import json, sys
    import npu_shim
    from npu_shim import emulation
    npu_shim.uninstall()            # the other plugin acts first: the shim installs after it
    emulation.install()
    import other_plugin
    if sys.argv[1] != "none":
        getattr(other_plugin, sys.argv[1])()
    npu_shim.install()
    print(json.dumps(next(row for row in npu_shim.status() if row["name"] == "%s")))
''' % PATCH)


def status_beside(plugin_action, tmp_path):
    (tmp_path / "other_plugin.py").write_text(PLUGIN)
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NPU_SHIM")}
    environ["PYTHONPATH"] = str(tmp_path)
    proc = subprocess.run([sys.executable, "-P", "-c", RUN, plugin_action], env=environ, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_applied_without_another_plugin(tmp_path):
    row = status_beside("none", tmp_path)
    assert row["state"] == "applied", row


def test_code_swapped_by_another_plugin_is_refused_naming_its_file(tmp_path):
    row = status_beside("swap_code", tmp_path)
    assert row["state"] != "applied", row
    assert "calc_split_factor runs code compiled from %s" % (tmp_path / "other_plugin.py") in row["reason"], row
    assert "replaced by another tool" in row["reason"], row


def test_a_wrapper_put_there_by_another_plugin_is_refused_naming_it(tmp_path):
    row = status_beside("wrap", tmp_path)
    assert row["state"] != "applied", row
    assert ("compiled from %s wrapping vllm_ascend.utils.calc_split_factor" % (tmp_path / "other_plugin.py")
            in row["reason"]), row
