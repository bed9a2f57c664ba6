"""Child process: sglang's real engine, ``sglang.Engine(device="npu", attention_backend="ascend")``,
on the emulated Ascend device (tests/lanes/test_engine_sglang.py runs it).

argv: a model folder (a tiny random-weight Qwen2 the test saved), a JSON file of prompts (token
ids), the number of tokens to generate. The prompts are a list (one batch), or ``{"rounds": [[prompt,
...], ...], "server": {...}}``: each round one batch, generated after the one before it (a later round
can hit the prefix cache an earlier one filled), ``server`` more ``sglang.Engine`` arguments (e.g.
``chunked_prefill_size``, ``context_length``). Prints one line ``ENGINE_RESULT <json>``: the greedy
tokens per prompt, in order over the rounds, and the server arguments the engine resolved (device,
attention backend, page size). With ``ENGINE_CASE_OPS_DIR`` set, each process writes the calls of
each emulated op it made there (:func:`record_ops`). The emulation is installed here, at
module top, so sglang's spawned scheduler and detokenizer (multiprocessing spawn runs this module
again as ``__mp_main__``) get it too, with the shim on or off (``NPU_SHIM``) alike.
"""
import json
import os
import sys

from npu_shim import emulation

emulation.install()
from npu_shim.emulation import sgl_kernels  # noqa: E402

# sglang's own Triton kernels, where the release launches them on an NPU (triton-ascend compiles them
# there): their emulations, before the engine starts (sgl_kernels.install_sglang_kernels)
sgl_kernels.install_sglang_kernels()
# The engine serves float32 (dtype="float32" below): the float64 reference then decides every greedy token,
# which half precision would not on a tiny random model. The attention and KV-cache ops refuse float32 as
# the hardware does, except inside this math-check switch, held open for the life of the process.
from npu_shim.emulation import dtypes  # noqa: E402

_FLOAT32 = dtypes.float32_not_on_hardware()  # kept: a collected context manager would close itself
_FLOAT32.__enter__()


def record_ops(folder):
    """Count the calls of each emulated torch_npu op in this process (the emulation's hook around every
    op body, chained to the one installed before) and write them, with the shim's applied patches and
    their counters, to ``folder/ops-<pid>.json`` at each call: sglang's scheduler is ended by a signal,
    so nothing could be written at its exit. ``{"ops": {name: calls}, "shim": {patch: {"family",
    "calls", "upstream_calls", ...}}}`` (the family and every ``*calls`` counter), the patch counters as
    they stood at the process's last op call."""
    import collections
    import contextlib

    from npu_shim.emulation import _registry

    counts = collections.Counter()
    path = os.path.join(folder, "ops-%d.json" % os.getpid())
    previous = None

    def hook(name, args, kwargs):
        counts[name] += 1
        import npu_shim

        shim = {patch: {key: value for key, value in row.items() if key == "family" or key.endswith("calls")}
                for patch, row in npu_shim.stats().items() if row.get("state") == "applied"}
        with open(path + ".tmp", "w") as f:
            json.dump({"ops": dict(counts), "shim": shim}, f)
        os.replace(path + ".tmp", path)
        return previous(name, args, kwargs) if previous is not None else contextlib.nullcontext()

    # The emulated device sets its own hook when sglang imports torch_npu, replacing the one in place
    # (importing torch_npu here first would change sglang's import-time choices): a hook set after this
    # one is chained inside it.
    set_hook = _registry.set_body_hook

    def set_inside(inner):
        nonlocal previous
        replaced, previous = previous, inner
        return replaced

    previous = set_hook(hook)
    _registry.set_body_hook = set_inside


# ENGINE_CASE_OPS_DIR (set by a test): every process of the engine records its emulated op calls there
if os.environ.get("ENGINE_CASE_OPS_DIR"):
    record_ops(os.environ["ENGINE_CASE_OPS_DIR"])


def main(model_dir, prompts_file, max_new_tokens):
    import sglang

    with open(prompts_file) as f:
        spec = json.load(f)
    if isinstance(spec, list):
        spec = {"rounds": [spec]}
    server = dict(context_length=128)
    server.update(spec.get("server", {}))
    engine = sglang.Engine(model_path=model_dir, device="npu", attention_backend="ascend",
                           disable_cuda_graph=True, skip_tokenizer_init=True, tp_size=1,
                           mem_fraction_static=0.5, dtype="float32", random_seed=0, log_level="info", **server)
    try:
        args = engine.server_args
        tokens = []
        for prompts in spec["rounds"]:
            outs = engine.generate(input_ids=prompts,
                                   sampling_params={"temperature": 0, "max_new_tokens": max_new_tokens})
            tokens.extend(o["output_ids"] for o in outs)
        result = {"tokens": tokens, "device": args.device, "attention_backend": args.attention_backend,
                  "page_size": args.page_size, "chunked_prefill_size": args.chunked_prefill_size,
                  "dtype": args.dtype, "float32_not_on_hardware": dtypes.float32_allowed()}
    finally:
        engine.shutdown()
    print("ENGINE_RESULT " + json.dumps(result), flush=True)


if __name__ == "__main__":
    main(sys.argv[1], sys.argv[2], int(sys.argv[3]))
    os._exit(0)
