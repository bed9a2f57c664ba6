"""Child process: sglang's real engine, ``sglang.Engine(device="npu", attention_backend="ascend")``, on the
emulated Ascend device, serving a tiny Qwen2.5-VL one image request (tests/lanes/test_engine_sglang_vl.py
runs it).

argv: a model folder (tests/lanes/engine_support/tiny_vl.py saved it), an image file, the prompt (text
with one ``<|vision_start|><|image_pad|><|vision_end|>``), the number of tokens to generate. Prints
``ENGINE_RESULT <json>`` (the greedy tokens, the server arguments resolved) and, from the scheduler
process, one ``TOWER_READS <json>`` line per forward of the vision tower: the device->host transfers
the emulated device counted at dispatch during ``Qwen2_5_VisionTransformer.forward``
(``npu_shim.emulation.device.count_transfers``, opened and closed by module-wide forward hooks that
only count: the tower's call is not touched). The emulation is installed at module top, so sglang's
spawned scheduler and detokenizer (spawn runs this module again as ``__mp_main__``) get it too, the
shim on or off (``NPU_SHIM``) alike.
"""
import json
import os
import sys

import torch

from npu_shim import emulation

emulation.install()
from npu_shim.emulation import sgl_kernels  # noqa: E402

# sglang's own Triton kernels, where the release launches them on an NPU (triton-ascend compiles them
# there): their emulations, before the engine starts (sgl_kernels.install_sglang_kernels)
sgl_kernels.install_sglang_kernels()
from npu_shim.emulation import device, dtypes  # noqa: E402

# float32 engine: the float64 reference then decides every greedy token (see engine_case.py)
_FLOAT32 = dtypes.float32_not_on_hardware()
_FLOAT32.__enter__()

TOWER = "Qwen2_5_VisionTransformer"
_open = []


def _pre(module, args):
    if type(module).__name__ == TOWER:
        ctx = device.count_transfers()
        _open.append((ctx, ctx.__enter__()))


def _post(module, args, output):
    if type(module).__name__ == TOWER and _open:
        ctx, counter = _open.pop()
        ctx.__exit__(None, None, None)
        print("TOWER_READS " + json.dumps({"count": counter.count, "by_kind": counter.by_kind(),
                                          "module": type(module).__module__}), flush=True)


torch.nn.modules.module.register_module_forward_pre_hook(_pre)
torch.nn.modules.module.register_module_forward_hook(_post)


def main(model_dir, image_file, prompt, max_new_tokens):
    import sglang

    engine = sglang.Engine(model_path=model_dir, device="npu", attention_backend="ascend",
                           disable_cuda_graph=True, tp_size=1, context_length=256,
                           mem_fraction_static=0.5, dtype="float32", random_seed=0, log_level="info")
    try:
        args = engine.server_args
        out = engine.generate(prompt=prompt, image_data=[image_file],
                              sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens})
        result = {"tokens": out["output_ids"], "prompt_tokens": out["meta_info"]["prompt_tokens"],
                  "device": args.device,
                  "attention_backend": args.attention_backend, "mm_attention_backend": args.mm_attention_backend}
    finally:
        engine.shutdown()
    print("ENGINE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]))
    os._exit(0)
