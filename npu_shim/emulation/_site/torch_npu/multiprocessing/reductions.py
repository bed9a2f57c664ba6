"""Emulated ``torch_npu.multiprocessing.reductions``.

torch_npu shares a device tensor with another process by an IPC handle and rebuilds it there
with ``rebuild_npu_tensor``. sglang imports the module and wraps that function at start-up
(``sglang.srt.utils.patch_torch``); the emulated device has no IPC handles, so the rebuild
refuses by name instead of building a wrong tensor.
"""


def rebuild_npu_tensor(*args, **kwargs):
    raise NotImplementedError(
        "torch_npu.multiprocessing.reductions.rebuild_npu_tensor: sharing an npu tensor between "
        "processes is not emulated (npu_shim.emulation: the device lives in one process)")


def reduce_npu_tensor(*args, **kwargs):
    raise NotImplementedError(
        "torch_npu.multiprocessing.reductions.reduce_npu_tensor: sharing an npu tensor between "
        "processes is not emulated (npu_shim.emulation: the device lives in one process)")
