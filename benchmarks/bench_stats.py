"""What counting costs: the patched MoonViT attention with ``counters.count`` live vs a no-op.

Side by side in one process, interleaved: ``vllm_moonvit_attn.ascend_fa_attention``
(the function the patch registers; one fused varlen call on the emulated
torch_npu) over a 27-layer "forward" sharing one ``cu_seqlens``, as MoonViT runs
it, once with the counters live and once with ``npu_shim.counters.count`` replaced
by a function that does nothing. Small images make the host overhead as visible
as it gets. The interleaved difference is within run-to-run noise on a shared
CPU, so the bound (counting adds <= 1 % of host time per forward) is checked on
the measured cost of one ``count()`` call (thread-safe: a lock around the add)
times the counts per forward.

    nox -s "bench(stats)"       (from a fresh clone: the base lane venv)
    python benchmarks/bench_stats.py [--repeats 40] [--images 4] [--tokens 64]
"""
import argparse
import statistics
import sys
import time
import timeit

import torch

from npu_shim import emulation
from npu_shim.engine import counters
from npu_shim.patches.vllm import moonvit_attn as moonvit

LAYERS = 27


def forward(q, k, v, cu):
    for _ in range(LAYERS):
        moonvit.ascend_fa_attention(q, k, v, cu, cu)


def main():
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=40, help="forwards per variant")
    parser.add_argument("--images", type=int, default=4)
    parser.add_argument("--tokens", type=int, default=64, help="patches per image")
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=72)
    args = parser.parse_args()
    torch.set_num_threads(1)
    emulation.install()
    total = args.images * args.tokens
    q, k, v = (torch.randn(total, args.heads, args.head_dim) for _ in range(3))
    cu = torch.arange(0, total + 1, args.tokens, dtype=torch.int32)

    live = counters.count
    variants = {"counting": live, "no-op": lambda patch, event, n=1: None}
    samples = {name: [] for name in variants}
    forward(q, k, v, cu)   # warm-up: allocator, emulation registration
    for i in range(args.repeats):
        for name in (variants if i % 2 == 0 else reversed(list(variants))):
            counters.count = variants[name]
            cu_fresh = cu.clone()       # a new tensor per forward, as vLLM builds one
            started = time.perf_counter()
            forward(q, k, v, cu_fresh)
            samples[name].append(time.perf_counter() - started)
    counters.count = live
    med = {name: statistics.median(values) for name, values in samples.items()}
    share = (med["counting"] - med["no-op"]) / med["no-op"] * 100
    per_call = min(timeit.repeat(lambda: live("bench.stats", "calls"), number=100000, repeat=5)) / 100000
    counters.reset()

    print("counting overhead, %d-layer MoonViT attention forward (%d images x %d patches, %d heads x %d; "
          "emulated torch_npu, 1 thread), median of %d interleaved forwards:"
          % (LAYERS, args.images, args.tokens, args.heads, args.head_dim, args.repeats))
    print("  count() live      %8.3f ms / forward" % (med["counting"] * 1e3))
    print("  count() no-op     %8.3f ms / forward" % (med["no-op"] * 1e3))
    print("  difference        %+8.3f ms  (%+.2f %% of host time, run-to-run noise included)"
          % ((med["counting"] - med["no-op"]) * 1e3, share))
    print("  one count() call  %8.0f ns  (x %d per forward: calls, plus 1 host_copies)"
          % (per_call * 1e9, LAYERS))
    counted = (LAYERS + 1) * per_call / med["no-op"] * 100
    print("  counting's own cost per forward: (%d + 1) x %.0f ns = %.1f us = %.4f %% of the forward "
          "(bound <= 1 %%)  %s" % (LAYERS, per_call * 1e9, (LAYERS + 1) * per_call * 1e6, counted,
                                  "OK" if counted <= 1 else "OVER"))
    print('reproduce: nox -s "bench(stats)" -- ' + " ".join(sys.argv[1:]))
    return 0 if counted <= 1 else 1


if __name__ == "__main__":
    sys.exit(main())
