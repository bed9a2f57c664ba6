"""Seed 000's 100-concurrency MoonViT case through VarlenAttention and the emulated NPU op.

The seed built an S x S boolean mask over all packed image tokens and ran out of
NPU memory at 100 concurrent requests (303,548 tokens: 85.8 GiB). This script
runs the same packing through npu_shim.kernels.VarlenAttention -- one
npu_fusion_attention (TND) call per layer, no mask -- on the pure-PyTorch
emulation and prints, in one run:

* the S x S mask size the seed needed;
* the measured peak extra memory (peak RSS above the resident set before the
  call) of the emulated op alone and of the whole layer (which adds the zero
  padding of D=72 to 128), next to the sizes of what they return;
* the torch_npu calls and host syncs per layer, recorded over a 27-layer
  forward (MoonViT depth) that shares one cu_seqlens tensor standing in for a
  device tensor -- on a scaled-down copy of the same 100-segment layout, since
  the counts do not depend on the token count;
* seconds per layer on this CPU.

Segment lengths are synthetic (the seed gives only the total): 100 image
segments drawn uniformly from 1,200-4,900 patches and scaled to sum to 303,548.

Reproduce from a fresh clone: nox -s "bench(varlen_memory)" (the base lane venv)
"""
import argparse
import os
import platform
import sys
import time

import torch
from torch.overrides import TorchFunctionMode

from npu_shim import emulation
from npu_shim.kernels import VarlenAttention
from npu_shim.testing import count_host_syncs, record_npu_calls

from _memory import PeakRss  # benchmarks/_memory.py (scripts run from this directory)

GIB, MIB = 1 << 30, 1 << 20


def segment_lengths(total, count, seed=0):
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(1200, 4901, (count,), generator=g).double()
    lengths = (raw * total / raw.sum()).floor().long().tolist()
    lengths[-1] += total - sum(lengths)
    return lengths


class MeasureOp(TorchFunctionMode):
    """Peak extra memory and time of each emulated torch_npu op call inside."""

    def __init__(self):
        super().__init__()
        self.calls = []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if getattr(func, "__module__", None) != "torch_npu":
            return func(*args, **(kwargs or {}))
        with PeakRss() as peak:
            t0 = time.perf_counter()
            result = func(*args, **(kwargs or {}))
            seconds = time.perf_counter() - t0
        storages = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                    for t in result if isinstance(t, torch.Tensor)}
        returned = sum(storages.values())
        self.calls.append((func.__name__, peak.extra, returned, seconds))
        return result


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--tokens", type=int, default=303_548)
    parser.add_argument("--segments", type=int, default=100)
    parser.add_argument("--heads", type=int, default=16)
    parser.add_argument("--head-dim", type=int, default=72)
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--layers", type=int, default=27, help="depth of the counted forward")
    parser.add_argument("--count-scale", type=int, default=100,
                        help="token scale-down of the 27-layer counting run")
    args = parser.parse_args()

    if not emulation.install():
        sys.exit("a real torch_npu is installed: this benchmark measures the emulation")
    dtype = getattr(torch, args.dtype)
    n, d, t = args.heads, args.head_dim, args.tokens
    lengths = segment_lengths(t, args.segments)
    cu = torch.tensor([0] + torch.tensor(lengths).cumsum(0).tolist(), dtype=torch.int32)
    elem = torch.tensor([], dtype=dtype).element_size()

    print("npu-shim varlen benchmark: 100 concurrent requests (MoonViT, Kimi-VL)")
    print("reproduce: nox -s \"bench(varlen_memory)\" -- " + " ".join(sys.argv[1:]))
    print("machine: %s, %d torch threads, torch %s, emulated torch_npu (SoC %s)"
          % (platform.machine(), torch.get_num_threads(), torch.__version__,
             __import__("torch_npu").npu.get_device_name()))
    print("load average at start: %.1f (other processes share these cores; timings scale with it)"
          % os.getloadavg()[0])
    print("packing: %d tokens in %d segments (%d..%d per segment), N=%d, D=%d, %s"
          % (t, len(lengths), min(lengths), max(lengths), n, d, args.dtype))
    print()
    print("S x S boolean mask the seed built:      %8.1f GiB  (%d^2 bytes)" % (t * t / GIB, t))
    print("largest per-segment score matrix (fp32): %7.1f MiB  (N x Smax^2 x 4, never built whole)"
          % (n * max(lengths) ** 2 * 4 / MIB))

    g = torch.Generator().manual_seed(1)
    q = torch.randn(t, n, d, generator=g).to(dtype)
    k = torch.randn(t, n, d, generator=g).to(dtype)
    v = torch.randn(t, n, d, generator=g).to(dtype)
    layer = VarlenAttention(n, d)
    inputs_bytes = 3 * t * n * d * elem
    padded_bytes = 3 * t * n * layer.qk_pad_dim * elem

    measure = MeasureOp()
    with PeakRss() as layer_peak, measure, record_npu_calls() as calls, \
            count_host_syncs(device_tensors=[cu]) as syncs:
        t0 = time.perf_counter()
        out = layer(q, k, v, cu)
        layer_seconds = time.perf_counter() - t0
    assert out.shape == (t, n, d)
    (op_name, op_extra, op_returned, op_seconds), = measure.calls

    print()
    print("one layer, full size (%s):" % layer)
    print("  inputs q, k, v:                        %8.1f MiB" % (inputs_bytes / MIB))
    print("  emulated %s peak extra:  %8.1f MiB  (returns %.1f MiB: output + softmax stats;"
          % (op_name, op_extra / MIB, op_returned / MIB))
    print("      temporaries %.1f MiB, bound per segment call %d MiB)"
          % ((op_extra - op_returned) / MIB, int(os.environ.get("NPU_SHIM_EMULATE_MEMORY_MIB", 256))))
    print("  whole layer peak extra:                %8.1f MiB  (adds zero-padded q, k, v to D=%d: %.1f MiB)"
          % (layer_peak.extra / MIB, layer.qk_pad_dim, padded_bytes / MIB))
    print("  torch_npu calls in this layer:         %d x %s (input_layout=%s, atten_mask=%s)"
          % (len(calls), calls[0].name, calls[0].kwargs.get("input_layout"),
             calls[0].kwargs.get("atten_mask")))
    print("  host syncs in this (first) layer:      %d (%s)" % (syncs.count, syncs.summary()))
    print("  seconds per layer on this CPU:         %8.1f  (op %.1f; load average now %.1f)"
          % (layer_seconds, op_seconds, os.getloadavg()[0]))
    del out, q, k, v

    small = [max(1, x // args.count_scale) for x in lengths]
    cu_small = torch.tensor([0] + torch.tensor(small).cumsum(0).tolist(), dtype=torch.int32)
    ts = sum(small)
    qs = torch.randn(ts, n, d, generator=g).to(dtype)
    layers = [VarlenAttention(n, d) for _ in range(args.layers)]
    with record_npu_calls() as calls, count_host_syncs(device_tensors=[cu_small]) as syncs:
        for each in layers:
            each(qs, qs, qs, cu_small)
    names = sorted({c.name for c in calls})
    print()
    print("%d-layer forward, same %d segments at 1/%d scale (%d tokens), one shared cu_seqlens"
          % (args.layers, len(small), args.count_scale, ts))
    print("  torch_npu calls: %d (%s) -> %.0f per layer" % (len(calls), ", ".join(names),
                                                        len(calls) / args.layers))
    print("  host syncs:      %d -> %.3f per layer (%s)"
          % (syncs.count, syncs.count / args.layers, ", ".join(str(e) for e in syncs.events)))


if __name__ == "__main__":
    main()
