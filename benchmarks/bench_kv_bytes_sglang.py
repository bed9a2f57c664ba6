"""KV-cache bytes per token of sglang's NPU MHA pool for MiMo-V2-Flash's attention shapes: native vs padded.

Each figure is read off a real ``NPUMHATokenToKVPool`` made by the installed release's own
builder (tests/lanes/sglang_support/v_head_dim_case.py; ``device="cpu"``, emulated torch_npu):
the bytes of one layer's K and V buffers divided by the pool's token slots, per layer kind of
MiMo-V2-Flash (full attention: 4 KV heads; sliding window: 8; K 192 / V 128 both), bfloat16:

* native: the pool the shim's builder makes (``sglang.npu_mha_v_head_dim``): V 128 wide;
* padded: V padded to the key's 192, the width upstream's builder gives V (no ``v_head_dim``),
  and the layout vLLM 0.15 - 0.19 serve MiMo with.

Whole-model per-rank figures follow from the per-layer ones and the layer counts; they are not
printed, as the layer counts are a checkpoint fact this script does not read. The plain pool
holds one layer kind per pool here (a whole MiMo model needs attention TP >= 8 in one plain
pool, or the hybrid SWA pool).

    NPU_SHIM_EMULATE=1 PYTHONPATH=.:tests/placeholders <sglang lane python> -P benchmarks/bench_kv_bytes_sglang.py
"""
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
KINDS = (("full attention", 4), ("sliding window", 8))
K_DIM, V_DIM = 192, 128


def bytes_per_token(pool):
    slots = pool.get_key_buffer(0).numel() // (pool.head_num * pool.head_dim)
    return (pool.get_key_buffer(0).nbytes + pool.get_value_buffer(0).nbytes) / slots


def main():
    sys.path.insert(0, os.path.join(REPO, "tests", "lanes"))
    import torch

    import npu_shim
    from npu_shim import emulation

    emulation.install()
    npu_shim.install()
    from importlib.metadata import version

    from npu_shim.testing import cp_case
    from sglang_support import v_head_dim_case as case

    cp_case.set_cpu_server_args()

    print("sglang %s (pool built %s), bfloat16, KV bytes per token per layer (all KV heads, attention TP 1)"
          % (version("sglang"), "by _build_ascend_mha_kv_pool" if case.builder_kind() == "builder"
             else "inline in _init_pools"))
    print("%-16s %8s %14s %14s %8s" % ("layer kind", "KV heads", "native 192/128", "padded 192/192", "padded/native"))
    for kind, heads in KINDS:
        base = dict(num_attention_heads=64, num_key_value_heads=heads, head_dim=K_DIM)
        native = case.build_pool(case.model_config(v_head_dim=V_DIM, **base), dtype=torch.bfloat16)
        padded = case.build_pool(case.model_config(v_head_dim=K_DIM, **base), dtype=torch.bfloat16)
        assert (native.v_head_dim, padded.v_head_dim) == (V_DIM, K_DIM)
        n, p = bytes_per_token(native), bytes_per_token(padded)
        assert n == heads * (K_DIM + V_DIM) * 2 and p == heads * 2 * K_DIM * 2
        print("%-16s %8d %14.0f %14.0f %8.3f" % (kind, heads, n, p, p / n))


if __name__ == "__main__":
    main()
