"""``vllm.moonvit_attn`` where vLLM no longer needs it (lanes vllm-0.15 and latest).

vLLM 0.14.0 rebuilt MoonViT on ``MMEncoderAttention``: ``moonvit.py`` has no
``VL_VISION_ATTENTION_FUNCTIONS`` and no S x S mask (on Ascend the encoder
attention is vllm-ascend's, see ``vllm.mm_encoder_attn``). The patch must be
skipped there with its reason, and the module must import exactly as without
the shim — even with the emulated torch_npu present, so the NPU requirement is
not what stops it.
"""
import json
import textwrap

import pytest

from npu_shim.testing import moonvit as mv

# the first lane past the window and the newest (tests/conftest.py: claimed(..., outside=...))
pytestmark = [pytest.mark.claimed("vllm.moonvit_attn", outside=("above", "newest")),
              pytest.mark.patch("vllm.moonvit_attn")]

FINGERPRINT = textwrap.dedent("""
    import inspect, json
    from npu_shim.testing import moonvit as mv

    def fingerprint(module):
        '''Every global of the module; for its own functions and classes, where their code lives.'''
        out = {}
        for name, value in sorted(vars(module).items()):
            if name.startswith("__"):
                continue
            entry = type(value).__name__
            if inspect.isfunction(value):
                entry = value.__code__.co_filename
            elif inspect.isclass(value) and value.__module__ == module.__name__:
                entry = {k: v.__code__.co_filename for k, v in sorted(vars(value).items())
                         if inspect.isfunction(v)}
            out[name] = entry
        return out
""")



@pytest.fixture(scope="module")
def moonvit():
    import npu_shim
    from npu_shim import emulation

    emulation.install()
    npu_shim.install()
    return mv.moonvit_module()


def test_skipped_with_reason(moonvit, lane_pins):
    import importlib.util

    import npu_shim

    assert importlib.util.find_spec("torch_npu") is not None   # not stopped by a missing NPU
    row = next(r for r in npu_shim.status() if r["name"] == "vllm.moonvit_attn")
    assert row["state"] == "skipped", row
    assert row["reason"] == ("vllm %s is outside >=0.8.5,<0.14 (above the window vLLM runs MoonViT attention "
                             "through MMEncoderAttention)" % row["versions"]["vllm"])
    assert row["versions"] == lane_pins("vllm")


def test_this_moonvit_has_no_dispatch_table(moonvit):
    """What the skip relies on: the rewritten module (read from the real wheel)."""
    assert not hasattr(moonvit, "VL_VISION_ATTENTION_FUNCTIONS")
    assert "MMEncoderAttention" in vars(moonvit)
    for method in vars(moonvit.MoonVitEncoderLayer).values():
        if callable(method) and hasattr(method, "__code__"):
            assert method.__code__.co_filename == moonvit.__file__


# Two fresh interpreters importing vLLM (16 s a lane): on the first release after the fence
# and on the newest; the in-process tests above run on every lane.
@pytest.mark.claimed("vllm.moonvit_attn", outside=("above", "newest"))
def test_module_imports_unchanged(moonvit, run_python, make_env):
    """Same globals, same code, with the shim (and emulated torch_npu) as with NPU_SHIM=0.

    Both sides in a fresh interpreter that imports moonvit only: once ``kimi_vl``
    is imported (by another test in this process), ``vllm.kimi_vl_host_grid``
    replaces ``MoonVitPretrainedModel.forward`` by design."""
    shim_on = ("from npu_shim import emulation\nimport npu_shim\n"
               "emulation.install()\nnpu_shim.install()\n")
    code = FINGERPRINT + "print(json.dumps(fingerprint(mv.moonvit_module())))\n"
    proc = run_python(shim_on + code, env=make_env(VLLM_PLUGINS=""), timeout=300)
    here = json.loads(proc.stdout.strip().splitlines()[-1])
    proc = run_python(code, env=make_env(NPU_SHIM="0", VLLM_PLUGINS=""), timeout=300)
    upstream = json.loads(proc.stdout.strip().splitlines()[-1])
    assert here == upstream
