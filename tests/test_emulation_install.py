"""Installing the emulation: only without a real torch_npu, never by default.

Each case runs in a fresh interpreter, since installing changes sys.path and
sys.modules for the life of a process.
"""
import os
import subprocess
import sys
import textwrap

import pytest

import npu_shim

# The directory holding the npu_shim under test (in a lane: the venv's site-packages), put on the
# children's PYTHONPATH so a child that changes sys.path still finds that copy, never the checkout.
PACKAGE_PARENT = os.path.dirname(os.path.dirname(os.path.abspath(npu_shim.__file__)))


def run_python(code, *, extra_path=(), env_updates=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith("NPU_SHIM")}
    env["PYTHONPATH"] = os.pathsep.join([*extra_path, PACKAGE_PARENT])
    env.update(env_updates or {})
    proc = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], env=env,
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    return proc.stdout


@pytest.fixture
def fake_real_torch_npu(tmp_path):
    pkg = tmp_path / "torch_npu"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("REAL = True\n")
    return str(tmp_path)


def test_default_mode_creates_nothing_named_torch_npu():
    out = run_python("""
        import importlib.util, sys
        import npu_shim, npu_shim.kernels, npu_shim.emulation, npu_shim.testing
        assert "torch_npu" not in sys.modules
        assert importlib.util.find_spec("torch_npu") is None
        assert not npu_shim.emulation.is_emulated()
        assert npu_shim.emulation.SITE_DIR not in sys.path
        try:
            npu_shim.kernels.VarlenAttention(4, 64)
        except RuntimeError as exc:
            assert "NPU_SHIM_EMULATE" in str(exc), exc
        else:
            raise AssertionError("VarlenAttention ran without any torch_npu")
        assert "torch_npu" not in sys.modules
        print("ok")
    """)
    assert out.strip() == "ok"


def test_install_resolves_torch_npu_to_a_real_package_with_spec_and_ops():
    out = run_python("""
        import importlib.util, sys
        import torch
        from npu_shim import emulation
        assert emulation.install() is True
        assert emulation.install() is True  # idempotent
        assert sys.path[-1] == emulation.SITE_DIR
        spec = importlib.util.find_spec("torch_npu")
        assert spec is not None and spec.origin.endswith("__init__.py")
        import torch_npu
        assert emulation.is_emulated() and torch_npu.__spec__ is not None
        from torch_npu.npu.streams import Event, Stream  # vllm-ascend 0.13 utils
        assert torch_npu.npu.is_available() is False
        assert not hasattr(torch, "npu")  # transformers must not see an NPU device
        for name in ("npu_fusion_attention", "npu_prompt_flash_attention",
                     "npu_fused_infer_attention_score", "npu_incre_flash_attention",
                     "_npu_flash_attention_unpad", "_npu_reshape_and_cache"):
            assert callable(getattr(torch_npu, name))
            assert hasattr(torch.ops.npu, name)
        print("ok")
    """)
    assert out.strip() == "ok"


def test_a_real_torch_npu_wins(fake_real_torch_npu):
    out = run_python("""
        import sys
        from npu_shim import emulation
        assert emulation.install() is False
        assert emulation.SITE_DIR not in sys.path
        import torch_npu
        assert torch_npu.REAL and not emulation.is_emulated()
        assert emulation.install() is False
        print("ok")
    """, extra_path=[fake_real_torch_npu])
    assert out.strip() == "ok"


def test_real_torch_npu_found_later_on_the_path_still_wins(fake_real_torch_npu):
    out = run_python("""
        import sys
        from npu_shim import emulation
        assert emulation.install() is True
        sys.path.insert(0, %r)
        import torch_npu
        assert torch_npu.REAL and not emulation.is_emulated()
        print("ok")
    """ % fake_real_torch_npu)
    assert out.strip() == "ok"


def test_env_switch_installs_at_startup_and_transformers_check_stays_false():
    out = run_python("""
        import importlib.util
        import npu_shim
        import torch
        assert importlib.util.find_spec("torch_npu") is not None
        import torch_npu
        assert torch_npu.__npu_shim_emulated__
        # transformers' is_torch_npu_available(): find_spec, import, then this:
        assert not (hasattr(torch, "npu") and torch.npu.is_available())
        print("ok")
    """, env_updates={"NPU_SHIM_EMULATE": "1"})
    assert out.strip() == "ok"


def test_uninstall_removes_the_emulation():
    out = run_python("""
        import importlib.util, sys
        from npu_shim import emulation
        emulation.install()
        import torch_npu
        assert emulation.uninstall() is True
        assert "torch_npu" not in sys.modules and emulation.SITE_DIR not in sys.path
        assert importlib.util.find_spec("torch_npu") is None
        assert emulation.uninstall() is False
        print("ok")
    """)
    assert out.strip() == "ok"


def test_register_device_module_gives_torch_npu_with_import_placeholders_only():
    out = run_python("""
        import torch
        from npu_shim import emulation
        from npu_shim.emulation.placeholders import ImportPlaceholderError
        emulation.install()
        import torch_npu
        assert not hasattr(torch, "npu")            # install() alone: no torch.npu
        assert emulation.register_device_module() is torch_npu.npu
        assert torch.npu is torch_npu.npu and torch.npu.is_available() is False
        assert torch.npu.NPUGraph | None            # usable in annotations (vllm-ascend acl_graph)
        assert not isinstance(object(), torch.npu.ExternalEvent)
        for cls in (torch.npu.NPUGraph, torch.npu.ExternalEvent, torch_npu._C._NPUTaskGroupHandle):
            try:
                cls()
            except ImportPlaceholderError as exc:
                assert "import placeholder" in str(exc) and cls.__name__ in str(exc), exc
            else:
                raise AssertionError(cls)
        try:   # imported by name by sglang 0.5.11's npu_communicator; a call refuses, naming it
            torch_npu.npu_dynamic_quant(torch.ones(2, 4), dst_type=torch.int8)
        except ImportPlaceholderError as exc:
            assert "torch_npu.npu_dynamic_quant is an import placeholder" in str(exc), exc
        else:
            raise AssertionError("npu_dynamic_quant computed")
        quant = (torch_npu.float4_e2m1fn_x2, torch_npu.hifloat8, torch_npu.float8_e8m0fnu)
        assert all(d not in quant for d in (torch.float16, torch.bfloat16, torch.int8, 0, 1))
        assert "placeholder" in repr(torch_npu.hifloat8)
        try:
            torch.empty(1, dtype=torch_npu.hifloat8)
        except TypeError:
            pass
        else:
            raise AssertionError("a dtype placeholder was usable as a dtype")
        assert emulation.uninstall() and not hasattr(torch, "npu")
        print("ok")
    """)
    assert out.strip() == "ok"
