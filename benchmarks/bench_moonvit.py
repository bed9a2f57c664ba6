"""Seed 000's Kimi-VL workload through vLLM's real MoonViT layers: upstream sdpa vs the shim's ascend_fa.

The seed served Kimi-VL with vllm 0.10.1.1 on Ascend: at 100 concurrent requests
the vision tower packs 303,548 patch tokens of ~100 images into one sequence,
and MoonViT's ``sdpa`` path builds a (1, S, S) boolean mask for it (85.8 GiB:
OOM). This script runs vLLM's own ``MoonVitEncoderLayer`` (whatever vLLM the
interpreter has; patched by npu-shim, torch_npu emulated) with Kimi-VL's
geometry (hidden 1152, 16 heads x 72, MLP 4304) and prints, side by side:

1. attention-side peak memory -- the peak extra resident memory while the
   layer's dispatched attention function runs (``VL_VISION_ATTENTION_FUNCTIONS
   [name]``, called by upstream's ``attention_qkvpacked``): upstream ``sdpa`` at a
   size that fits this machine, ``ascend_fa`` at the same size and at the full
   303,548 tokens, next to the S^2 bytes of the mask sdpa builds;
2. host syncs per vision-tower forward (27 layers, 100 images): the seed's
   per-image loop, upstream ``sdpa``, the shim;
3. CPU seconds per layer for the three.

Memory is RSS-based (Linux ``VmHWM`` after ``clear_refs``), so it includes
whatever the CPU kernels allocate: torch's CPU SDPA with a boolean mask
materialises N x S x S float scores besides the mask, which an NPU kernel would
not; the mask itself is what the NPU path of the seed could not allocate.
Timings are of the pure-PyTorch emulation on a shared CPU, not of an NPU.

Image grids are synthetic (the seed gives only the packed total): 100 images of
random even (h, w) patch grids whose token counts sum to exactly 303,548.

Reproduce from a fresh clone (makes or reuses the kimi-vl-2025 lane venv):
  nox -s "bench(moonvit)"
"""
import argparse
import contextlib
import os
import platform
import random
import sys
import time

from _memory import PeakRss  # benchmarks/_memory.py (scripts run from this directory)

GIB, MIB = 1 << 30, 1 << 20
SEED_TOKENS = 303_548
FULL_LAYER_BYTES_PER_TOKEN = 32_000   # measured peak of one bf16 layer ~= 9.7 GB at 303,548 tokens


# --------------------------------------------------------------------------- workload


def seed_grids(total=SEED_TOKENS, images=100, seed=0):
    """``images`` (h, w) grids with h*w summing to ``total`` (last grid solves the remainder)."""
    for attempt in range(1000):
        rng = random.Random(seed + attempt)
        grids = [(rng.randrange(30, 76, 2), rng.randrange(30, 76, 2)) for _ in range(images - 1)]
        rest = total - sum(h * w for h, w in grids)
        for h in range(2, 513, 2):
            if rest > 0 and rest % h == 0 and (rest // h) % 2 == 0 and rest // h <= 512:
                return grids + [(h, rest // h)]
    raise RuntimeError("no grid layout found for %d tokens" % total)


def scaled_grids(grids, divisor, even=False):
    step = 2 if even else 1
    return [(max(step, h // divisor // step * step), max(step, w // divisor // step * step)) for h, w in grids]


def tokens_of(grids):
    return sum(h * w for h, w in grids)


# --------------------------------------------------------------------------- measuring


def mem_available():
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


@contextlib.contextmanager
def measured_dispatch(module, name, sink, memory=True):
    """Wrap the dispatch-table entry ``name`` to record (peak extra bytes, seconds) per call."""
    table = module.VL_VISION_ATTENTION_FUNCTIONS
    original = table[name]

    def measuring(*args, **kwargs):
        with PeakRss() if memory else contextlib.nullcontext() as peak:
            started = time.perf_counter()
            out = original(*args, **kwargs)
            seconds = time.perf_counter() - started
        sink.append((peak.extra if memory else None, seconds))
        return out

    table[name] = measuring
    try:
        yield
    finally:
        table[name] = original


@contextlib.contextmanager
def registered(module, name, function):
    table = module.VL_VISION_ATTENTION_FUNCTIONS
    table[name] = function
    try:
        yield
    finally:
        del table[name]


def seed_per_image_loop(q, k, v, q_cu_seqlens=None, k_cu_seqlens=None):
    """The seed's last working version: one prompt-FA call per image, bounds read with .item()."""
    import torch
    import torch_npu

    total, heads, head_dim = q.shape
    outputs = []
    for i in range(1, len(q_cu_seqlens)):
        q0, q1 = q_cu_seqlens[i - 1].item(), q_cu_seqlens[i].item()
        k0, k1 = k_cu_seqlens[i - 1].item(), k_cu_seqlens[i].item()
        out = torch_npu.npu_prompt_flash_attention(
            q[q0:q1].transpose(0, 1).unsqueeze(0), k[k0:k1].transpose(0, 1).unsqueeze(0),
            v[k0:k1].transpose(0, 1).unsqueeze(0), num_heads=heads, input_layout="BNSD",
            scale_value=head_dim ** -0.5)
        outputs.append(out.squeeze(0).transpose(0, 1))
    return torch.cat(outputs, dim=0).reshape(total, -1)


# --------------------------------------------------------------------------- one layer


def build_layer(module, mv, name, dtype, seed=0):
    """One real MoonVitEncoderLayer with Kimi-VL geometry, dispatching ``name``."""
    import torch

    choice = name if name in ("sdpa", "ascend_fa") else "sdpa"
    with mv.env_choice(choice), mv.vllm_layer_context(module):
        layer = module.MoonVitEncoderLayer(
            mv.KIMI_VL["num_attention_heads"], mv.KIMI_VL["hidden_size"], mv.KIMI_VL["intermediate_size"],
            attn_implementation="sdpa", activation=torch.nn.functional.gelu, attn_bias=True)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for pname, param in sorted(layer.named_parameters()):
            fan_in = param[0].numel() if param.dim() > 1 else 1
            param.copy_(torch.randn(param.shape, generator=gen) * fan_in ** -0.5)
    layer.attn_implementation = name
    return layer.to(dtype).eval()


def layer_inputs(module, grids, dtype, seed=1):
    import torch

    heads, hidden = mv_geometry()
    rope = module.Rope2DPosEmb(hidden // heads, 512, 512, device="cpu")
    grid_hw = torch.tensor(grids, dtype=torch.int64)
    freqs = rope.get_freqs_cis_by_seqlens(grid_hw)
    cu_seqlens = torch.cat((torch.zeros(1, dtype=torch.int64), grid_hw[:, 0] * grid_hw[:, 1])).cumsum(
        0, dtype=torch.int32)
    x = torch.randn(tokens_of(grids), hidden, generator=torch.Generator().manual_seed(seed)).to(dtype)
    return x, cu_seqlens, freqs


def mv_geometry():
    from npu_shim.testing.moonvit import KIMI_VL

    return KIMI_VL["num_attention_heads"], KIMI_VL["hidden_size"]


def run_attention(module, layer, name, x, cu_seqlens, freqs):
    """(attention-side peak extra bytes, attention seconds, whole attention_qkvpacked seconds)."""
    import torch

    sink = []
    with measured_dispatch(module, name, sink), torch.no_grad():
        started = time.perf_counter()
        layer.attention_qkvpacked(x, cu_seqlens, rope_freqs_cis=freqs)
        seconds = time.perf_counter() - started
    (peak, attention_seconds), = sink
    return peak, attention_seconds, seconds


def layer_forward_seconds(layer, x, cu_seqlens, freqs):
    import torch

    with torch.no_grad():
        started = time.perf_counter()
        layer(x, cu_seqlens, rope_freqs_cis=freqs)
        return time.perf_counter() - started


# --------------------------------------------------------------------------- main


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--fit-divisor", type=int, default=10,
                        help="divide each image grid side by this for the size upstream sdpa fits")
    parser.add_argument("--full", choices=["auto", "yes", "no"], default="auto",
                        help="run ascend_fa at the full 303,548 tokens (auto: if memory allows)")
    parser.add_argument("--layers", type=int, default=27)
    args = parser.parse_args()

    import npu_shim
    from npu_shim import emulation

    if not emulation.install():
        sys.exit("a real torch_npu is installed: this benchmark measures the emulation")
    npu_shim.install()
    import torch

    from npu_shim.testing import moonvit as mv
    from npu_shim.testing import count_host_syncs, record_npu_calls

    module = mv.applied_module()
    import vllm

    dtype = getattr(torch, args.dtype)
    heads, hidden = mv_geometry()
    grids = seed_grids()
    fit = scaled_grids(grids, args.fit_divisor)
    total, fit_total = tokens_of(grids), tokens_of(fit)

    print("npu-shim MoonViT benchmark: Kimi-VL, 100 concurrent requests")
    print('reproduce: nox -s "bench(moonvit)" -- ' + " ".join(sys.argv[1:]))
    print("stack: vllm %s (real MoonVitEncoderLayer), torch %s, emulated torch_npu; %s, %d torch threads, "
          "load average %.1f (shared cores)" % (vllm.__version__, torch.__version__, platform.machine(),
                                                torch.get_num_threads(), os.getloadavg()[0]))
    print("layer: hidden %d, %d heads x %d, %s; workload: %d images, %d tokens (grids %dx%d .. ); "
          "fit size: grids / %d per side -> %d tokens"
          % (hidden, heads, hidden // heads, args.dtype, len(grids), total, grids[0][0], grids[0][1],
             args.fit_divisor, fit_total))

    # ---------------------------------------------------------------- 1. memory
    print()
    print("1. attention-side peak extra memory (the dispatched attention function inside the layer)")
    print("   S x S bool mask upstream sdpa builds:  S^2 bytes; at S = %d: %.1f GiB  <- the seed's OOM"
          % (SEED_TOKENS, SEED_TOKENS ** 2 / GIB))
    x, cu, freqs = layer_inputs(module, fit, dtype)
    results = {}
    for name in ("sdpa", "ascend_fa"):
        layer = build_layer(module, mv, name, dtype)
        results[name] = run_attention(module, layer, name, x, cu, freqs)
        del layer
    print("   at S = %d tokens (%d images):" % (fit_total, len(fit)))
    print("     upstream sdpa:  %8.1f MiB  (its mask alone: %.1f MiB = S^2 B; CPU SDPA also builds "
          "N x S^2 fp32 scores = %.1f MiB)" % (results["sdpa"][0] / MIB, fit_total ** 2 / MIB,
                                                heads * fit_total ** 2 * 4 / MIB))
    print("     shim ascend_fa: %8.1f MiB  (%.1fx less)" % (results["ascend_fa"][0] / MIB,
                                                            results["sdpa"][0] / max(1, results["ascend_fa"][0])))
    del x, cu, freqs

    need = FULL_LAYER_BYTES_PER_TOKEN * total
    run_full = args.full == "yes" or (args.full == "auto" and mem_available() > need + 2 * GIB)
    full = None
    if run_full:
        x, cu, freqs = layer_inputs(module, grids, dtype)
        layer = build_layer(module, mv, "ascend_fa", dtype)
        full = run_attention(module, layer, "ascend_fa", x, cu, freqs)
        print("   at S = %d tokens (%d images), the seed's full batch:" % (total, len(grids)))
        print("     upstream sdpa:  the mask alone needs %.1f GiB (not run)" % (total ** 2 / GIB))
        print("     shim ascend_fa: %8.1f MiB measured (q, k, v zero-padded 72 -> 128 and the output;"
              " inputs q, k, v %.1f MiB)" % (full[0] / MIB, 3 * total * hidden * x.element_size() / MIB))
        del layer, x, cu, freqs
    else:
        print("   full %d tokens: skipped (needs ~%.1f GiB free, %.1f GiB available; --full yes forces it)"
              % (total, need / GIB, mem_available() / GIB))

    # ---------------------------------------------------------------- 2. host syncs
    print()
    count_grids = scaled_grids(grids, args.fit_divisor * 2, even=True)
    geometry = dict(mv.TINY, num_hidden_layers=args.layers)
    print("2. host syncs per vision-tower forward (MoonVitPretrainedModel, %d layers, %d images of even "
          "grids, %d tokens; counts do not depend on sizes)" % (args.layers, len(count_grids),
                                                              tokens_of(count_grids)))
    pixels, grid_hw = mv.make_inputs(count_grids)
    rows = []
    with registered(module, "seed_per_image_loop", seed_per_image_loop):
        for label, name in (("seed per-image loop", "seed_per_image_loop"), ("upstream sdpa", "sdpa"),
                            ("shim ascend_fa", "ascend_fa")):
            model = mv.build_tower(module, geometry, choice="ascend_fa" if name == "ascend_fa" else "sdpa")
            for block in model.encoder.blocks:
                block.attn_implementation = name
            with count_host_syncs(device_tensors=[pixels, grid_hw]) as syncs, \
                    mv.cu_seqlens_on_device(model, syncs), record_npu_calls() as calls:
                mv.forward(model, pixels, grid_hw)
            attention = mv.attention_syncs(syncs) if name != "seed_per_image_loop" else [
                e for e in syncs.events if e.location.endswith("seed_per_image_loop")]
            rows.append((label, len(attention), syncs.count - len(attention), len(calls)))
    for label, attention, rest, calls in rows:
        print("   %-20s attention path %6d  (%.2f per layer)   rest of the tower %d   torch_npu calls %d"
              % (label, attention, attention / args.layers, rest, calls))
    print("   (rest of the tower, the same in all three: upstream's own grid_hw.tolist() in patch embedding,"
          " rope table and patch merger;\n    on vllm 0.10.2+ also (grid_hw[:, 0] * grid_hw[:, 1])"
          ".to(hidden_states.device), a copy only on this CPU stand-in, none on an NPU)")

    # ---------------------------------------------------------------- 3. seconds
    print()
    print("3. CPU seconds per layer (emulated torch_npu; %d torch threads; load average %.1f)"
          % (torch.get_num_threads(), os.getloadavg()[0]))
    x, cu, freqs = layer_inputs(module, fit, dtype)
    with registered(module, "seed_per_image_loop", seed_per_image_loop):
        for label, name in (("seed per-image loop", "seed_per_image_loop"), ("upstream sdpa", "sdpa"),
                            ("shim ascend_fa", "ascend_fa")):
            layer = build_layer(module, mv, name, dtype)
            layer_forward_seconds(layer, x, cu, freqs)  # warm-up
            sink = []
            with measured_dispatch(module, name, sink, memory=False):
                forward_s = min(layer_forward_seconds(layer, x, cu, freqs) for _ in range(3))
            print("   S = %6d  %-20s layer forward %7.3f s   of which attention function %7.3f s   "
                  "(best of 3)" % (fit_total, label, forward_s, min(s for _, s in sink)))
    if full is not None:
        print("   S = %6d  %-20s attention_qkvpacked %7.1f s   of which attention function %7.1f s"
              % (total, "shim ascend_fa", full[2], full[1]))


if __name__ == "__main__":
    main()
