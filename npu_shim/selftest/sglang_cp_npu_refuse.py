"""Selftest of ``sglang.cp_npu_refuse``: NPU prefill CP is refused while resolving server arguments.

Resolves three dummy-model ``ServerArgs`` through the patched
``validate_prefill_cp_platform`` (sglang's own resolution pipeline), on an NPU
platform (``override_platform(is_npu=True)``, sglang's test hook, so the check
also runs where no NPU is present): ``--enable-prefill-cp`` must be refused with
the shim's message; CP off must resolve, and so must CP on a non-NPU platform.
No NPU op is involved (error 0 when every outcome is right).
"""
import time

PATCH_NAME = "sglang.cp_npu_refuse"


def _outcome(cp, npu):
    from sglang.srt.runtime_context import override_platform
    from sglang.srt.server_args import ServerArgs

    extra = dict(enable_prefill_cp=True, cp_strategy="zigzag", attn_cp_size=2, tp_size=2) if cp else {}
    args = ServerArgs(model_path="dummy", device="npu" if npu else "cpu", **extra)
    try:
        with override_platform(is_npu=npu):
            args.resolve_once()
    except ValueError as exc:
        return str(exc)
    return None


def run(device=None):
    from npu_shim.patches.sglang.cp_npu_refuse import MESSAGE
    from npu_shim.selftest import applied_target

    applied_target(PATCH_NAME)
    from npu_shim.testing import count_host_syncs

    started = time.perf_counter()
    # Counted, not assumed: the declared 0 must be what the resolution did.
    with count_host_syncs() as syncs:
        refused = _outcome(cp=True, npu=True)
        others = {(cp, npu): _outcome(cp=cp, npu=npu) for cp, npu in ((False, True), (True, False))}
    expected_start = MESSAGE.split("%s", 1)[1][:40]
    if refused is None or expected_start not in refused:
        raise RuntimeError("NPU + --enable-prefill-cp was not refused with the shim's message: %r" % refused)
    for (cp, npu), other in others.items():
        if other is not None:
            raise RuntimeError("cp=%s npu=%s was refused: %s" % (cp, npu, other))
    return {"max_abs_err": 0.0, "tolerance": 0.0, "host_syncs": syncs.count,
            "seconds": time.perf_counter() - started,
            "detail": "ServerArgs resolution: NPU + --enable-prefill-cp refused; CP off, and CP on a "
                      "non-NPU platform, resolve (device %s not used)" % (device or "cpu")}
