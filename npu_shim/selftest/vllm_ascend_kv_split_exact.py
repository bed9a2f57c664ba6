"""Selftest of ``vllm.ascend_kv_split_exact``: vllm-ascend's K/V byte split, exact for head dims that differ.

Calls the patched ``vllm_ascend.utils.calc_split_factor`` for pairs of (K, V) head dims (MiMo-V2-Flash's
192 / 128, DeepSeek's 512 / 64, 128 / 128, 576 / 512) and splits layer byte counts the way vllm-ascend's
model runner does (``int(size // factor)`` for K and for V), for layers of 1 to 4096 blocks of 16 or 128
tokens, 1 to 8 KV heads, bfloat16. The reference is integer arithmetic from the layout: K takes
``size * k_dim / (k_dim + v_dim)`` bytes, V the rest. Error: bytes missed or misplaced over all cases
(0 expected). No device op, nothing read back.
"""
import time

PATCH_NAME = "vllm.ascend_kv_split_exact"
DIMS = ((192, 128), (512, 64), (128, 128), (576, 512))


def run(device=None):
    from npu_shim.selftest import applied_target, on_upstream
    from npu_shim.testing import count_host_syncs

    module = applied_target(PATCH_NAME)
    if not on_upstream(PATCH_NAME) and not hasattr(module.calc_split_factor, "__wrapped_upstream__"):
        raise RuntimeError("%s reports applied but calc_split_factor is not the shim's" % PATCH_NAME)
    started = time.perf_counter()
    missed, cases = 0, 0
    with count_host_syncs(cpu_is_device=True) as syncs:
        for k_dim, v_dim in DIMS:
            k_factor, v_factor = module.calc_split_factor([k_dim, v_dim])
            for blocks in (1, 7, 60, 4096):
                for block_size in (16, 128):
                    for heads in (1, 4, 8):
                        size = blocks * block_size * heads * (k_dim + v_dim) * 2
                        k_bytes, v_bytes = int(size // k_factor), int(size // v_factor)
                        expected = size * k_dim // (k_dim + v_dim)
                        missed += abs(k_bytes - expected) + abs(v_bytes - (size - expected))
                        cases += 1
    return {"max_abs_err": float(missed), "tolerance": 0.0, "host_syncs": syncs.count,
            "seconds": time.perf_counter() - started,
            "detail": "calc_split_factor: %d layer sizes split into K and V as the runner does, (K, V) head dims "
                      "%s; bytes missed or misplaced against the exact split (device %s not used)"
                      % (cases, ", ".join("%d/%d" % d for d in DIMS), device or "cpu")}
