"""The emulated 310P aicpu IndexPut defect (npu_shim.emulation.index_put): what it refuses,
and that it refuses nothing else (vllm-ascend #12086; PR #12914's table on 310P)."""
import pytest
import torch

from npu_shim.emulation.index_put import AICPU_ERROR, aicpu_index_put_defect
from npu_shim.testing import count_host_syncs


@pytest.fixture
def on_310p(monkeypatch):
    monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", "Ascend310P3")


def rows():
    x = torch.zeros(8, 4, dtype=torch.float16)
    mask = torch.zeros(8, dtype=torch.bool)
    mask[2:5] = True
    return x, mask, torch.ones(3, 4, dtype=torch.float16)


@pytest.mark.parametrize("mask_on_device", [True, False], ids=["mask on device", "mask on host"])
def test_a_boolean_mask_assignment_on_a_device_tensor_fails_on_310p(on_310p, mask_on_device):
    x, mask, values = rows()
    with count_host_syncs(device_tensors=[x] + ([mask] if mask_on_device else [])) as syncs:
        with aicpu_index_put_defect(syncs.is_device):
            with pytest.raises(RuntimeError, match=str(AICPU_ERROR)):
                x[mask] = values
            with pytest.raises(RuntimeError, match="12086"):
                x.index_put_((mask,), values)


def test_integer_positions_and_host_tensors_work_on_310p(on_310p):
    x, mask, values = rows()
    host = x.clone()
    with count_host_syncs(device_tensors=[x]) as syncs:
        with aicpu_index_put_defect(syncs.is_device):
            x.index_copy_(0, torch.nonzero(mask, as_tuple=True)[0], values)
            host[mask] = values                    # a host tensor: the CPU kernel, not aicpu
    assert torch.equal(x, host)


def test_an_a2_runs_the_assignment(monkeypatch):
    monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", "Ascend910B1")
    x, mask, values = rows()
    with count_host_syncs(device_tensors=[x]) as syncs:
        with aicpu_index_put_defect(syncs.is_device):
            x[mask] = values
    assert torch.equal(x[mask], values)
