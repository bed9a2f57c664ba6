"""The emulated ``torch_npu._C._weak_ref_tensor`` (npu_shim.emulation.weak_ref): a tensor on the
same memory that does not own it; memory left to weak tensors only counts as released, and
``require_alive`` reports a device write there as ACL error 507011 (vllm-ascend PR #16794).
What the NPU allocator does with released memory cannot be tested here (no NPU)."""
import gc

import pytest

torch = pytest.importorskip("torch")

from npu_shim.emulation import weak_ref  # noqa: E402


def test_aliases_the_memory_without_owning_it():
    owner = torch.arange(6.0).reshape(2, 3)[:, 1:]          # a view with an offset and strides
    weak = weak_ref.weak_ref_tensor(owner)
    assert weak.data_ptr() == owner.data_ptr() and weak.stride() == owner.stride()
    assert weak.shape == owner.shape and weak._base is None and weak_ref.is_weak(weak)
    assert not weak_ref.is_weak(owner) and not weak_ref.released(weak)
    owner.fill_(7.0)
    assert torch.equal(weak, torch.full((2, 2), 7.0))
    del owner
    gc.collect()
    assert weak_ref.released(weak)


def test_any_owner_keeps_it_alive():
    owner = torch.zeros(8)
    view = owner[2:]
    first, second = weak_ref.weak_ref_tensor(owner), weak_ref.weak_ref_tensor(view)
    del owner
    gc.collect()
    assert not weak_ref.released(first) and not weak_ref.released(second)      # the view owns it
    del view
    gc.collect()
    assert weak_ref.released(first) and weak_ref.released(second)
    del second
    gc.collect()
    assert weak_ref.released(first)


def test_require_alive_names_507011():
    owner = torch.ones(4)
    weak = weak_ref.weak_ref_tensor(owner)
    assert weak_ref.require_alive(owner, "owner") is owner
    assert weak_ref.require_alive(weak, "buffer") is weak
    del owner
    gc.collect()
    with pytest.raises(weak_ref.DeviceMemoryError, match=r"507011 \(invalid address\): the output buffer"):
        weak_ref.require_alive(weak, "the output buffer")
    with pytest.raises(TypeError, match="torch.Tensor"):
        weak_ref.weak_ref_tensor([1.0])


def test_reached_as_torch_npu_C(monkeypatch):
    """vllm-ascend calls it as ``torch_npu._C._weak_ref_tensor``."""
    import sys

    from npu_shim import emulation

    if "torch_npu" in sys.modules and not emulation.is_emulated():
        pytest.skip("a real torch_npu is imported")
    emulation.install()
    import torch_npu

    assert torch_npu._C._weak_ref_tensor is weak_ref.weak_ref_tensor
