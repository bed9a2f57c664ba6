"""vllm-ascend's debug print ops as the emulation registers them (npu_shim/emulation/device_print.py):
``torch.ops._C_ascend.device_print(str)`` and ``device_print_tensor(Tensor)`` print to stdout, each
followed by a new line (vllm-ascend 0.30.0rc2, csrc/torch_binding.cpp), and return nothing."""
import pytest
import torch

from npu_shim import emulation

emulation.install()
import torch_npu  # noqa: E402,F401  (registers the ops)


def test_device_print_text_and_tensor(capsys):
    assert torch.ops._C_ascend.device_print("step 3") is None
    assert torch.ops._C_ascend.device_print_tensor(torch.tensor([1.5, -2.0])) is None
    out = capsys.readouterr().out
    assert out.startswith("step 3\n") and "1.5000" in out and "-2.0000" in out and out.endswith("\n")


def test_device_print_tensor_refuses_other_devices():
    with pytest.raises(RuntimeError, match="CPU and NPU tensors"):
        torch.ops._C_ascend.device_print_tensor(torch.empty(2, device="meta"))
