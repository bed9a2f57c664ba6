"""sglang's vision towers on the emulated device: device->host reads counted at dispatch
(:func:`npu_shim.emulation.device.count_transfers`) against today's counter
(:func:`npu_shim.testing.sglang_towers.forward`: CPU stand-ins watched by
:func:`npu_shim.testing.count_host_syncs`), shim and upstream, as
:mod:`npu_shim.testing.device_census` does for vLLM's towers.

For each tower of :data:`npu_shim.testing.sglang_towers.TOWERS` and each grid of its spec, the
forward runs four times with the same weights and inputs: upstream's (the shim uninstalled for it)
and the shim's, each once as today and once with the tower and the pixel values moved to ``npu``
(``grid_thw`` stays the host tensor sglang's processor made, as sglang hands it). A row:
``(tower, grid, side, today's count, dispatch count, outputs equal)``; A2, bfloat16. Needs the
emulated device (``NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1``).

    NPU_SHIM_EMULATE=1 NPU_SHIM_EMULATE_DEVICE=1 python -m npu_shim.testing.sglang_device_census [TOWER ...]

prints one JSON row per line; a forward the device cannot run prints a row with ``error``.
tests/lanes/test_sglang_towers_device.py runs it in a lane.
"""
import json
import sys
import traceback

__all__ = ["cross_check", "main"]


def _on_npu(name, tower, x, grid, upstream):
    import torch

    from npu_shim.emulation import device
    from npu_shim.testing import sglang_towers

    tower.to("npu")
    try:
        with sglang_towers.npu(name), sglang_towers._side(upstream), torch.inference_mode():
            with device.count_transfers() as counter:
                out = tower(x.to("npu"), grid_thw=torch.tensor(grid, dtype=torch.long))
        return sglang_towers.tower_output(out).cpu(), counter
    finally:
        tower.to("cpu")


def cross_check(name):
    """Rows (dicts) for tower ``name`` (see the module docstring)."""
    import torch

    from npu_shim.testing import sglang_towers

    tower = sglang_towers.build(name, torch.bfloat16)
    rows = []
    for index, grid in enumerate(sglang_towers.TOWERS[name].grids):
        x = sglang_towers.pixel_values(tower, grid, seed=index)
        for side, upstream in (("upstream", True), ("shim", False)):
            row = {"tower": name, "grid": grid, "side": side}
            try:
                out, today, _ = sglang_towers.forward(name, tower, x, grid, upstream=upstream)
                npu_out, dispatch = _on_npu(name, tower, x, grid, upstream)
            except Exception as error:  # upstream's refusals included (0.5.16's per-image FIA lengths)
                frame = traceback.extract_tb(error.__traceback__)[-1]
                row["error"] = "%s: %s at %s:%d in %s" % (type(error).__name__, str(error)[:300],
                                                           "/".join(frame.filename.split("/")[-2:]),
                                                           frame.lineno, frame.name)
            else:
                row.update(today=today.count, dispatch=dispatch.count, dispatch_kinds=dispatch.by_kind(),
                           today_kinds=sorted(str(e) for e in today.events),
                           equal=bool(torch.equal(sglang_towers.tower_output(out), npu_out)))
            rows.append(row)
    return rows


def main(argv=None):
    from npu_shim.testing import sglang_towers

    names = (sys.argv[1:] if argv is None else argv) or list(sglang_towers.TOWERS)
    unknown = [name for name in names if name not in sglang_towers.TOWERS]
    if unknown:
        raise SystemExit("not sglang towers: %s (known: %s)" % (", ".join(unknown), ", ".join(sglang_towers.TOWERS)))
    sglang_towers.setup()
    for name in names:
        for row in cross_check(name):
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
