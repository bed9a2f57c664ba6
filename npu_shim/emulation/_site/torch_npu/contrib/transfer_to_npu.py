"""``from torch_npu.contrib import transfer_to_npu`` on the emulated device: CUDA's API answered by the NPU's.

torch_npu documents this import as its automatic migration ("(recommended) automatic migration",
and the ``TORCH_TRANSFER_TO_NPU`` variable): once imported, the ``torch.cuda`` interfaces are
replaced by their ``torch.npu`` counterparts (device creation, tensor placement, memory, streams),
a ``"cuda"`` device given to a tensor factory or a move goes to the NPU, a process group asked for
``nccl`` gets ``hccl``, and ``torch.jit.script`` is turned off (returns its argument). sglang's
``init_npu_backend`` imports it on every NPU start-up.

The emulation does the same on the emulated device, for what it has:
* every public name of ``torch.npu`` that ``torch.cuda`` also has is set on ``torch.cuda``;
* ``Tensor.cuda`` / ``Module.cuda`` are ``.npu``; ``device=`` (keyword, or a ``torch.device`` /
  ``"cuda[:n]"`` / int argument where the call takes one) of the tensor factories and of
  ``Tensor.to`` / ``Module.to`` names ``npu`` instead of ``cuda``;
* ``torch.distributed.init_process_group(backend="nccl")`` opens ``hccl`` (one-rank gloo here);
* ``torch.jit.script`` returns its argument.

Not modelled: ``torch.device("cuda")`` objects themselves (PyTorch's C type; they are rewritten where
they are handed to a function above, elsewhere a CUDA call on this CPU build fails loudly with
"Torch not compiled with CUDA"), and the functions outside the lists below. Requires the emulated
device (``NPU_SHIM_EMULATE_DEVICE=1``): without it there is no ``npu`` to migrate to, and the
import raises naming the switch.
"""
import functools

import torch

import torch_npu

if not torch_npu.npu.is_available():
    raise ImportError("torch_npu.contrib.transfer_to_npu (emulated): no emulated device to migrate CUDA "
                      "calls to; set NPU_SHIM_EMULATE_DEVICE=1 with NPU_SHIM_EMULATE=1")

# Factories whose device= the migration rewrites (torch_npu's list is longer; these are the ones
# a PyTorch serving engine calls).
FACTORIES = ("tensor", "as_tensor", "asarray", "zeros", "ones", "empty", "full", "arange", "range", "linspace",
             "logspace", "eye", "rand", "randn", "randint", "randperm", "zeros_like", "ones_like",
             "empty_like", "full_like", "rand_like", "randn_like", "randint_like", "empty_strided",
             "tril_indices", "triu_indices", "normal")


def _npu_device(device):
    """``device`` with CUDA named as the NPU: ``"cuda"``/``"cuda:n"``/``torch.device("cuda", n)``."""
    if isinstance(device, str) and (device == "cuda" or device.startswith("cuda:")):
        return "npu" + device[len("cuda"):]
    if isinstance(device, torch.device) and device.type == "cuda":
        return torch.device("npu", device.index) if device.index is not None else torch.device("npu")
    return device


def _migrated(function):
    @functools.wraps(function)
    def call(*args, **kwargs):
        if "device" in kwargs:
            kwargs["device"] = _npu_device(kwargs["device"])
        return function(*args, **kwargs)

    call.__npu_shim_transfer_to_npu__ = function
    return call


def _migrated_to(function):
    """``Tensor.to`` / ``Module.to``: the device may also be the first positional argument."""
    @functools.wraps(function)
    def to(self, *args, **kwargs):
        if args:
            args = (_npu_device(args[0]),) + args[1:]
        if "device" in kwargs:
            kwargs["device"] = _npu_device(kwargs["device"])
        return function(self, *args, **kwargs)

    to.__npu_shim_transfer_to_npu__ = function
    return to


def _cuda_to_npu(self, device=None, *args, **kwargs):
    if isinstance(device, int):
        device = torch.device("npu", device)
    return self.npu(_npu_device(device), *args, **kwargs)


def _nccl_is_hccl(init_process_group):
    @functools.wraps(init_process_group)
    def init(*args, **kwargs):
        if kwargs.get("backend") == "nccl":
            kwargs["backend"] = "hccl"
        elif args and args[0] == "nccl":
            args = ("hccl",) + args[1:]
        return init_process_group(*args, **kwargs)

    init.__npu_shim_transfer_to_npu__ = init_process_group
    return init


def _script_off(obj=None, *args, **kwargs):
    return obj


def _migrate():
    # ``with torch.device(...)`` recognises a factory by identity in a set built at its first use:
    # built now, it holds the factories themselves, which the wrappers below call.
    from torch.utils._device import _device_constructors

    _device_constructors()
    for name in dir(torch_npu.npu):
        if not name.startswith("_") and hasattr(torch.cuda, name):
            setattr(torch.cuda, name, getattr(torch_npu.npu, name))
    for name in FACTORIES:
        original = getattr(torch, name)
        if not hasattr(original, "__npu_shim_transfer_to_npu__"):
            setattr(torch, name, _migrated(original))
    for owner in (torch.Tensor, torch.nn.Module):
        if not hasattr(owner.to, "__npu_shim_transfer_to_npu__"):
            owner.to = _migrated_to(owner.to)
        owner.cuda = _cuda_to_npu
    import torch.distributed as dist

    if dist.is_available() and not hasattr(dist.init_process_group, "__npu_shim_transfer_to_npu__"):
        dist.init_process_group = _nccl_is_hccl(dist.init_process_group)
    torch.jit.script = _script_off


_migrate()
