"""Per-op cost of the emulated Ascend device (npu_shim.emulation.device) against plain CPU tensors,
measured side by side in one run.

    NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1 python benchmarks/bench_emulated_device.py [--repeat N]

Run in any lane venv with npu-shim installed (base is enough). For each op and size it times the
same op on CPU tensors and on ``npu`` tensors (median of ``--repeat`` runs of ``--inner`` calls each,
interleaved so both see the same machine load) and prints the time per call, the difference
(the device's overhead per op: one Python ``__torch_function__`` + ``__torch_dispatch__`` round
trip, unwrap and rewrap) and the ratio. Small tensors show the fixed overhead; large ones that
the arithmetic is the CPU's own. Host times on this machine, not NPU figures.
"""
import argparse
import os
import statistics
import sys
import time


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7)
    parser.add_argument("--inner", type=int, default=200)
    args = parser.parse_args(argv)
    if os.environ.get("NPU_SHIM_EMULATE_DEVICE") != "1":
        sys.exit("set NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1 (the emulated device's switch)")
    import torch

    import torch_npu  # noqa: F401  (the emulation: activates the device)

    torch.set_num_threads(1)
    g = torch.Generator().manual_seed(0)
    cases = []
    for n in (8, 256, 1024):
        a, b = torch.randn(n, n, generator=g), torch.randn(n, n, generator=g)
        cases.append(("add %dx%d" % (n, n), lambda x, y: x + y, a, b))
        cases.append(("matmul %dx%d" % (n, n), lambda x, y: x @ y, a, b))
    a = torch.randn(64, 128, generator=g)
    cases.append(("linear 64x128 (F.linear)", lambda x, w: torch.nn.functional.linear(x, w), a,
                  torch.randn(128, 128, generator=g)))
    cases.append(("view+transpose+contiguous 64x128", lambda x, _: x.view(8, 8, 128).transpose(0, 1).contiguous(),
                  a, a))
    print("emulated npu vs CPU, per call (median of %d x %d calls), torch %s, 1 thread"
          % (args.repeat, args.inner, torch.__version__))
    print("%-34s %12s %12s %12s %8s" % ("op", "cpu us", "npu us", "overhead us", "ratio"))
    for name, fn, x, y in cases:
        xn, yn = x.npu(), y.npu()
        cpu_t, npu_t = [], []
        for _ in range(args.repeat):
            for inputs, sink in (((x, y), cpu_t), ((xn, yn), npu_t)):
                start = time.perf_counter()
                for _ in range(args.inner):
                    fn(*inputs)
                sink.append((time.perf_counter() - start) / args.inner * 1e6)
        c, d = statistics.median(cpu_t), statistics.median(npu_t)
        print("%-34s %12.1f %12.1f %12.1f %7.1fx" % (name, c, d, d - c, d / c))


if __name__ == "__main__":
    main()
