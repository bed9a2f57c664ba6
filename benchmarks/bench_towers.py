"""Whole vision-tower forwards: device->host reads, blocking host->device copies and host time,
upstream vs. npu-shim, side by side in one run.

    python benchmarks/bench_towers.py [--repeat N]

Run in a lane venv (vLLM + vllm-ascend installed; npu-shim installed there).
For each tower (vLLM's own Qwen2.5-VL, Qwen3-VL and GLM-4.1V vision classes,
tiny random configs, :mod:`npu_shim.testing.towers`) and each device class (A2,
310P) it builds two towers with the same weights: one whose attention is
vllm-ascend's class as the shim patched it, and "upstream": the same
vllm-ascend file executed untouched, with vLLM's own tower methods
(``towers.upstream_code`` puts back what a tower patch replaced). Both run the
same two grids (each with a multi-frame item) in ``torch.inference_mode()``. The table gives per forward:
device->host reads (upstream -> shim, counted by
``npu_shim.testing.count_host_syncs`` with the tower's parameters and inputs
as device stand-ins), blocking host->device copies (upstream -> shim), and the
host time of a forward without counting (median of ``--repeat``, patched /
upstream). On this CPU-only machine the op is npu-shim's emulation of
torch_npu: the times are host-side Python and emulation, not NPU figures.

Kimi-VL (vLLM's MoonViT, ``towers.build_moonvit``) gets its inputs the way vLLM
hands them to the model: Kimi-VL's processor field config (upstream's on the
upstream side, the shim's -- grid kept on the host -- on the other) and vLLM's
``group_and_batch_mm_kwargs`` to the device stand-in, counted with the forward;
three images, then two. Its host time is the forward alone. Blocking copies
are the most of the two forwards: the first includes the rope table MoonViT
caches on the device (2 copies, both sides).
"""
import argparse
import os
import statistics
import sys
import time

os.environ.setdefault("VLLM_PLUGINS", "")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")   # the table only (vLLM logs temporary file names)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)

    import contextlib
    import importlib.util

    import torch
    from importlib.metadata import version

    if importlib.util.find_spec("vllm") is None and importlib.util.find_spec("sglang") is not None:
        return sglang_main()
    from npu_shim.testing import count_host_syncs, towers

    stack = towers.setup()
    release = "vllm %s + vllm-ascend %s" % (version("vllm"), version("vllm-ascend"))
    rows = []
    for name in towers.TOWERS:
        for device_class in towers.DEVICE_CLASSES:
            towers.emulate_device_class(device_class)
            sides = {}
            for side, cls in (("upstream", stack.upstream[device_class]), ("shim", stack.attention[device_class])):
                tower = towers.build_tower(stack, name, cls)
                reads, copies, times = [], [], []
                for forward in range(2):
                    grid = towers.grids(forward)
                    x = towers.pixel_values(tower, grid, seed=forward)
                    code = towers.upstream_code(stack, name) if side == "upstream" else contextlib.nullcontext()
                    with torch.inference_mode(), towers.registered(cls), code:
                        with count_host_syncs(device_tensors=[x], device_modules=[tower]) as syncs:
                            tower(x, grid_thw=grid)
                        reads.append(syncs.count)
                        copies.append(syncs.h2d_count)
                        for _ in range(args.repeat):
                            started = time.perf_counter()
                            tower(x, grid_thw=grid)
                            times.append(time.perf_counter() - started)
                sides[side] = (max(reads), max(copies), statistics.median(times))
            up, shim = sides["upstream"], sides["shim"]
            rows.append((name, release, device_class, "%d -> %d" % (up[0], shim[0]),
                         "%d -> %d" % (up[1], shim[1]), "%.2f ms / %.2f ms = %.3f"
                         % (shim[2] * 1e3, up[2] * 1e3, shim[2] / up[2])))
    rows += moonvit_rows(stack, release, args.repeat)
    header = ("tower", "release", "class", "d->h reads / forward", "blocking h->d copies",
              "host time / forward (shim / upstream)")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    for row in [header, tuple("-" * w for w in widths)] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    return 0


def moonvit_rows(stack, release, repeat):
    import torch

    from npu_shim.testing import count_host_syncs, towers
    from npu_shim.testing.syncs import DEVICE

    rows = []
    for device_class in towers.DEVICE_CLASSES:
        towers.emulate_device_class(device_class)
        sides = {}
        for side, cls in (("upstream", stack.upstream[device_class]), ("shim", stack.attention[device_class])):
            tower = towers.build_moonvit(stack, cls)
            reads, copies, times = [], [], []
            for forward in range(2):
                grid = towers.moonvit_grid(forward)
                x = towers.moonvit_pixel_values(tower, grid, seed=forward)
                with torch.inference_mode(), towers.registered(cls):
                    with count_host_syncs(device_modules=[tower]) as syncs:
                        pixels, grid_hws = towers.kimi_vl_batch(stack, x, grid, device=DEVICE,
                                                                upstream_fields=side == "upstream")
                        tower(pixels, grid_hws)
                    reads.append(syncs.count)
                    copies.append(syncs.h2d_count)
                    for _ in range(repeat):
                        started = time.perf_counter()
                        tower(pixels, grid_hws)
                        times.append(time.perf_counter() - started)
            sides[side] = (max(reads), max(copies), statistics.median(times))
        up, shim = sides["upstream"], sides["shim"]
        rows.append(("Kimi-VL", release, device_class, "%d -> %d" % (up[0], shim[0]),
                     "%d -> %d" % (up[1], shim[1]), "%.2f ms / %.2f ms = %.3f"
                     % (shim[2] * 1e3, up[2] * 1e3, shim[2] / up[2])))
    os.environ.pop("NPU_SHIM_EMULATE_SOC", None)
    return rows


def sglang_main():
    """An sglang lane: sglang's own Qwen2.5-VL, Qwen3-VL and GLM-4V towers
    (:mod:`npu_shim.testing.sglang_towers`), A2 (bfloat16) and 310P (float16), each over its two
    grids; per forward (the most of the two): reads upstream -> shim, blocking host->device
    copies upstream -> shim, the outputs vs float64 (max |out - ref| / max |ref|, the worse
    forward; upstream's over the forwards it ran) and whether the shim's equals upstream's bit
    for bit; then where the shim's reads
    remain (file:line, reads per forward)."""
    sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "tests",
                                    "placeholders"))     # sgl_kernel_npu: imported, never called
    from importlib.metadata import version

    import torch

    import npu_shim
    from npu_shim.testing import sglang_towers, towers

    sglang_towers.setup()
    release = "sglang %s" % version("sglang")
    # the patches of the towers' modules and of sglang's vision attention, as applied here
    targets = {spec.module for spec in sglang_towers.TOWERS.values()} | {"sglang.srt.layers.attention.vision"}
    families = ["%s %s" % (r["name"], r["family"]) for r in npu_shim.status()
                if r["target"] in targets and r["state"] == "applied"]
    rows, remain = [], []
    for name in sglang_towers.TOWERS:
        for device_class, dtype in (("A2", torch.bfloat16), ("310P", torch.float16)):
            towers.emulate_device_class(device_class)
            try:
                runs = sglang_towers.side_by_side(name, dtype)
            except ValueError as exc:       # upstream's op where the vendor documents no dtype
                if "not documented for" not in str(exc):
                    raise
                rows.append((name, release, device_class, "-", "-", "-", str(exc).split(":")[0] + ": not on 310P"))
                continue
            ran = [r for r in runs if r.up is not None]
            up = ("%d" % max(r.up_syncs.count for r in ran), "%d" % max(r.up_syncs.h2d_count for r in ran)) \
                if ran else ("fails", "fails")
            shim = max(r.syncs.count for r in runs), max(r.syncs.h2d_count for r in runs)
            equal = all(torch.equal(sglang_towers.tower_output(r.out), sglang_towers.tower_output(r.up))
                        for r in ran)
            failed = ["%d images" % len(r.grid) for r in runs if r.up is None]
            up_error = "%.1e" % max(r.up_error for r in ran) if ran else "-"
            rows.append((name, release, device_class, "%s -> %d" % (up[0], shim[0]),
                         "%s -> %d" % (up[1], shim[1]), "%s -> %.1e" % (up_error, max(r.error for r in runs)),
                         ("yes" if equal and ran else "NO" if ran else "-")
                         + ("; upstream refused with %s (FIA: actual_seq_lengths)"
                                                       % ", ".join(failed) if failed else "")))
            if device_class == "A2":
                for site, count in sorted(max((r.sites() for r in runs), key=len).items()):
                    remain.append("  %s %s: %s (%d)" % (name, release, site, count))
    os.environ.pop("NPU_SHIM_EMULATE_SOC", None)
    header = ("tower", "release", "class", "d->h reads / forward", "blocking h->d copies",
              "vs float64 (rel), upstream -> shim", "shim == upstream")
    widths = [max(len(str(r[i])) for r in rows + [header]) for i in range(len(header))]
    print("applied: %s" % (", ".join(families) or "none"))
    for row in [header, tuple("-" * w for w in widths)] + rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(row, widths)).rstrip())
    print("\nreads that remain with the shim (A2, the forward with the most sites):")
    print("\n".join(remain) if remain else "  none")
    return 0


if __name__ == "__main__":
    sys.exit(main())
