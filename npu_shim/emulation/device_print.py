"""vllm-ascend's debug print ops, ``torch.ops._C_ascend.device_print`` and ``device_print_tensor``.

vllm-ascend's worker registers them as effectful ops at device start-up
(``vllm_ascend.utils.register_device_print``, called by ``NPUWorker._init_device``) and refuses to
start when custom ops are on and they are missing. Semantics (vllm-ascend 0.30.0rc2,
``csrc/torch_binding.cpp``): ``device_print(str msg) -> ()`` prints the message followed by a new line;
``device_print_tensor(Tensor tensor) -> ()`` copies the tensor (CPU or NPU) to the host on the current
stream and a host callback prints it, then a new line. The callback runs when the stream reaches it;
here streams are synchronous, so it prints at once.
"""
import sys

import torch


def device_print(msg):
    sys.stdout.write(str(msg) + "\n")
    sys.stdout.flush()


def device_print_tensor(tensor):
    if tensor.device.type not in ("cpu", "npu"):
        raise RuntimeError("device_print only supports CPU and NPU tensors, but got device %s" % tensor.device)
    with torch._C.DisableTorchFunctionSubclass():
        host = tensor.contiguous()
    sys.stdout.write("%s\n" % (getattr(host, "_raw", host),))
    sys.stdout.flush()
