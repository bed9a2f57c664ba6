"""The README's towers and the census towers on the emulated device: device->host reads counted at dispatch
(:func:`npu_shim.emulation.device.count_transfers`) against today's counter
(:func:`npu_shim.testing.count_host_syncs` on CPU stand-ins), shim on and off.

For a tower of :mod:`npu_shim.testing.census` and a device class, each forward runs four times
with the same weights and inputs: the shim's tower and upstream's (vllm-ascend's untouched class,
vLLM's own tower code: the shim off for this tower), each once as today (CPU stand-ins watched by
today's counter, :func:`census.call`) and once moved to ``npu`` (``tower.to("npu")``, the input
and the grid tensors vLLM keeps on the device moved with ``.to("npu")``) with the dispatch
counter. A row: ``(tower, device class, forward, side, today's count, dispatch count, outputs
equal)``. Needs the emulated device (``NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1``).

    NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1 python -m npu_shim.testing.device_census [--forwards N] [TOWER ...]

prints one JSON row per line (N forwards a tower and device class, default 2); a tower the device
cannot run prints one row with ``error``. tests/lanes/test_tower_census_device.py runs it in a lane.
"""
import contextlib
import functools
import json
import sys
import traceback

__all__ = ["cross_check", "main"]


def _on_npu(name, tower, attention_class, x, grid):
    import torch

    from npu_shim.testing import census

    spec = census.CENSUS[name]
    arg = spec.grid_arg(grid)
    placed = {id(t) for t in census.device_args(name, arg)}

    def move(a):
        if isinstance(a, torch.Tensor):
            return a.to("npu") if id(a) in placed else a
        if isinstance(a, tuple):
            return tuple(move(b) for b in a)
        if isinstance(a, list):
            return [move(b) for b in a]
        return a

    return on_npu(tower, attention_class, lambda: spec.call(tower, x.to("npu"), move(arg)))


def on_npu(tower, attention_class, run):
    """``run()`` with ``tower`` moved to ``npu`` (outside inference mode, as a model is moved before it
    serves) and back, ``attention_class`` registered, transfers counted at dispatch: (the output on the
    host, the counter)."""
    import torch

    from npu_shim.emulation import device
    from npu_shim.testing import towers

    tower.to("npu")
    try:
        with torch.inference_mode(), towers.registered(attention_class):
            with device.count_transfers() as counter:
                out = run()
        return out.cpu(), counter
    finally:
        tower.to("cpu")


def cross_check(stack, name, device_class="A2", forwards=2):
    """Rows (dicts) of the four runs of each forward of tower ``name`` (see the module docstring)."""
    from npu_shim.testing import census, towers

    attention, untouched = stack.attention[device_class], stack.upstream[device_class]
    dtype = towers.hardware_dtype(device_class)
    rows = []
    for side, attention_class in (("shim", attention), ("upstream", untouched)):
        tower = census.build(stack, name, attention_class, dtype=dtype)
        for forward in range(forwards):
            grid = census.grids(forward, name)
            x = census.pixel_values(name, tower, grid, seed=forward)
            context = towers.upstream_methods(census._MODULES[name]) if side == "upstream" else contextlib.nullcontext()
            with context:
                out, today = census.call(name, tower, attention_class, x, grid)
                npu_out, dispatch = _on_npu(name, tower, attention_class, x, grid)
            rows.append(_row(name, device_class, forward, side, today, dispatch, out, npu_out))
    return rows


def cross_check_tower(stack, name, device_class="A2", forwards=2):
    """:func:`cross_check` for a tower of :data:`npu_shim.testing.towers.TOWERS` (Qwen2.5-VL, Qwen3-VL,
    GLM-4.1V: the README's towers, called ``tower(x, grid_thw=grid)`` with the grid as a host list,
    as their models hand it). Kimi-VL's MoonViT (its own call convention) is not among them."""
    import torch

    from npu_shim.testing import count_host_syncs, towers

    attention, untouched = stack.attention[device_class], stack.upstream[device_class]
    dtype = towers.hardware_dtype(device_class)
    rows = []
    for side, attention_class in (("shim", attention), ("upstream", untouched)):
        tower = towers.build_tower(stack, name, attention_class, dtype=dtype)
        for forward in range(forwards):
            grid = towers.grids(forward)
            x = towers.pixel_values(tower, grid, seed=forward)
            context = towers.upstream_code(stack, name) if side == "upstream" else contextlib.nullcontext()
            with context:
                with torch.inference_mode(), towers.registered(attention_class):
                    with count_host_syncs(device_tensors=[x], device_modules=[tower]) as today:
                        out = tower(x, grid_thw=grid)
                npu_out, dispatch = on_npu(tower, attention_class, lambda: tower(x.to("npu"), grid_thw=grid))
            rows.append(_row(name, device_class, forward, side, today, dispatch, out, npu_out))
    return rows


def cross_check_moonvit(stack, device_class="A2", forwards=2):
    """:func:`cross_check` for Kimi-VL's MoonViT: its pixels and ``image_grid_hws`` as vLLM hands
    them (``towers.kimi_vl_batch``: the field config, upstream's on the upstream side, batched and
    placed on the stand-in device or on ``npu``; ``keep_on_cpu`` fields stay on the host)."""
    import torch

    from npu_shim.testing import count_host_syncs, towers
    from npu_shim.testing.syncs import DEVICE

    rows = []
    for side, attention_class in (("shim", stack.attention[device_class]), ("upstream", stack.upstream[device_class])):
        tower = towers.build_moonvit(stack, attention_class, dtype=towers.hardware_dtype(device_class))
        upstream_fields = side == "upstream"
        for forward in range(forwards):
            grid = towers.moonvit_grid(forward)
            x = towers.moonvit_pixel_values(tower, grid, seed=forward)
            with torch.inference_mode(), towers.registered(attention_class):
                with count_host_syncs(device_modules=[tower]) as today:
                    pixels, grid_hws = towers.kimi_vl_batch(stack, x, grid, device=DEVICE,
                                                            upstream_fields=upstream_fields)
                    out = torch.cat(tower(pixels, grid_hws))
            def run():
                pixels, grid_hws = towers.kimi_vl_batch(stack, x, grid, device="npu", upstream_fields=upstream_fields)
                return torch.cat(tower(pixels, grid_hws))

            # the rotary table is computed on its device at first use and kept (a cached_property)
            rope = tower.encoder.rope_2d
            rope_device, rope.device = rope.device, "npu"
            rope.__dict__.pop("precomputed_freqs_cis", None)
            try:
                npu_out, dispatch = on_npu(tower, attention_class, run)
            finally:
                rope.device = rope_device
                rope.__dict__.pop("precomputed_freqs_cis", None)
            rows.append(_row("Kimi-VL", device_class, forward, side, today, dispatch, out, npu_out))
    return rows


def _row(tower, device_class, forward, side, today, dispatch, out, npu_out):
    import torch

    return {"tower": tower, "device_class": device_class, "forward": forward, "side": side,
            "today": today.count, "dispatch": dispatch.count, "dispatch_kinds": dispatch.by_kind(),
            "today_kinds": sorted(str(e) for e in today.events), "equal": bool(torch.equal(out, npu_out))}


def main(argv=None):
    from npu_shim.testing import census, towers

    import argparse

    parser = argparse.ArgumentParser(prog="python -m npu_shim.testing.device_census")
    parser.add_argument("--forwards", type=int, default=2, help="forwards a tower and device class (default 2)")
    parser.add_argument("towers", nargs="*", help="census towers (default: every one this vLLM has)")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.forwards < 1:
        parser.error("--forwards %d: give 1 or more" % args.forwards)
    stack = census.setup()
    known = list(towers.TOWERS) + ["Kimi-VL"] + list(census.CENSUS)
    unknown = [name for name in args.towers if name not in known]
    if unknown:
        parser.error("not towers of the census or the README: %s (known: %s)" % (", ".join(unknown), ", ".join(known)))
    names = args.towers or ([n for n in towers.TOWERS if n in stack.modules] + ["Kimi-VL"] * ("Kimi-VL" in stack.modules)
                            + [n for n in census.CENSUS if n in census._MODULES])
    for name in names:
        if name in towers.TOWERS:
            check = functools.partial(cross_check_tower, stack, name)
        elif name == "Kimi-VL":
            check = functools.partial(cross_check_moonvit, stack)
        else:
            check = functools.partial(cross_check, stack, name)
        for device_class in sorted(stack.attention):
            try:
                for row in check(device_class, forwards=args.forwards):
                    print(json.dumps(row), flush=True)
            except Exception as error:  # a tower the device cannot run: say which, why and where
                frame = traceback.extract_tb(error.__traceback__)[-1]
                print(json.dumps({"tower": name, "device_class": device_class,
                                  "error": "%s: %s at %s:%d in %s" % (
                                      type(error).__name__, str(error)[:300],
                                      "/".join(frame.filename.split("/")[-2:]), frame.lineno, frame.name)}),
                      flush=True)


if __name__ == "__main__":
    main()
