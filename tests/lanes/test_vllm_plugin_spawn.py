"""vLLM's own plugin loader installs the shim in a process vLLM starts with ``spawn``.

No launcher, no PYTHONPATH, no ``import npu_shim``: the parent only asks vLLM for
its multiprocessing context (``VLLM_WORKER_MULTIPROC_METHOD=spawn``, what vLLM
uses for its engine core and workers) and starts a child with it; the child runs
``vllm.plugins.load_general_plugins()``, the call vLLM makes at the start of
every process it runs models in, which reads the ``vllm.general_plugins`` entry
points of the installed distributions (the shim's: ``npu_shim._vllm_plugin:register``,
from ``pip install``). Then it imports MoonViT and reports what the shim did
there. A whole engine is not started: no model weights exist here, and the
plugin loading above is the part of the engine's start-up under test.
"""
import json
import os
import subprocess
import sys
import textwrap

import pytest

# where no vllm-ascend is installed, whose own general plugins would load too
pytestmark = [pytest.mark.claimed("vllm.moonvit_attn", pinned={"vllm-ascend": None}),
              pytest.mark.patch("vllm.moonvit_attn")]

SCRIPT = textwrap.dedent('''
    import json, os, sys

    def child(queue):
        import multiprocessing
        before = "npu_shim" in sys.modules
        inherited_pythonpath = os.environ.get("PYTHONPATH")
        from vllm.plugins import load_general_plugins
        load_general_plugins()
        import vllm.model_executor.models.moonvit as moonvit
        import npu_shim
        rows = {r["name"]: r for r in npu_shim.status()}
        queue.put({
            "start_method": multiprocessing.get_start_method(),
            "shim_before_plugins": before,
            "pythonpath": inherited_pythonpath,
            "moonvit": [rows["vllm.moonvit_attn"]["state"], rows["vllm.moonvit_attn"]["reason"]],
            "ascend_fa_registered": "ascend_fa" in moonvit.VL_VISION_ATTENTION_FUNCTIONS,
            "pid": os.getpid(),
        })

    if __name__ == "__main__":
        from vllm.utils import get_mp_context
        ctx = get_mp_context()
        queue = ctx.Queue()
        proc = ctx.Process(target=child, args=(queue,))
        proc.start()
        got = queue.get(timeout=600)
        proc.join(60)
        got["parent_has_shim"] = "npu_shim" in sys.modules
        got["parent_pid"] = os.getpid()
        got["context"] = ctx.get_start_method()
        print(json.dumps(got))
''')


def test_general_plugins_entry_point_installs_the_shim_in_a_spawned_vllm_process(tmp_path, make_env):
    script = tmp_path / "start_like_vllm.py"
    script.write_text(SCRIPT)
    env = make_env(VLLM_WORKER_MULTIPROC_METHOD="spawn", VLLM_PLUGINS="npu_shim", NPU_SHIM_EMULATE="1")
    proc = subprocess.run([sys.executable, str(script)], env=env, cwd=tmp_path, capture_output=True,
                          text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-4000:]
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    assert got["context"] == "spawn" and got["start_method"] == "spawn"
    assert got["pid"] != got["parent_pid"]
    # Nothing carried the shim in: not the parent, not PYTHONPATH.
    assert not got["parent_has_shim"] and not got["shim_before_plugins"]
    assert not got["pythonpath"] or "_bootstrap" not in got["pythonpath"]
    assert got["moonvit"][0] == "applied", got["moonvit"]
    assert got["ascend_fa_registered"]
