"""``npu-shim selftest``: run every patched path that applies here.

For each patch whose target is installed, the runner imports the target (so
the patch applies or records why not), then calls the patch's selftest module
``npu_shim.selftest.<patch module>.run(device)``. That runs the patched path on
a small real upstream module with random weights against the float64
reference and returns ``max_abs_err``, ``tolerance``, ``host_syncs``,
``seconds`` and ``detail``. A row whose error exceeds its tolerance, or whose
selftest raises, makes the command exit 1.

On an NPU box the real torch_npu kernels run on device ``npu``. Elsewhere the
ops exist only as the pure-PyTorch emulation, which must be asked for with
NPU_SHIM_EMULATE=1; the table says which ran.
"""
import contextlib
import importlib
import importlib.util
import json
import sys
import time
import traceback

from npu_shim import _startup
from npu_shim._table import format_table
from npu_shim.patches import BUILTIN_PATCHES

EXIT_OK, EXIT_MISMATCH, EXIT_NO_KERNELS = 0, 1, 2


def applied_target(patch_name):
    """The target module of ``patch_name``, once the shim has applied the patch to it.

    Selftests check the patched path only; anything else is an error that says why.
    """
    from npu_shim import status

    row = next(r for r in status() if r["name"] == patch_name)
    module = sys.modules.get(row["target"])
    if row["state"] != "applied" or module is None:
        raise RuntimeError("%s is not applied here (state %s: %s); the selftest runs only the "
                           "patched path" % (patch_name, row["state"], row["reason"]))
    return module


def kernel_provider():
    """'torch_npu' (real), 'emulation', or None when no NPU ops are importable."""
    if importlib.util.find_spec("torch_npu") is None:
        return None
    from npu_shim import emulation

    return "emulation" if emulation.is_emulated() else "torch_npu"


def _selftest_module(patch_name):
    """The selftest module the patch declares (``Patch.selftest``), or None."""
    declared = _startup.engine().patch_named(patch_name).selftest
    return importlib.import_module(declared) if declared else None


def run_all(device=None):
    rows_by_name = {row["name"]: row for row in _startup.engine().status(import_targets=True)}
    provider = kernel_provider()
    device = device or ("npu" if provider == "torch_npu" else "cpu")
    results = []
    for name, _ in BUILTIN_PATCHES:
        row = rows_by_name[name]
        result = {
            "patch": name,
            "target_version": ", ".join("%s %s" % (d, v) for d, v in row["versions"].items() if v) or "-",
            "state": row["state"],
            "reason": row["reason"],
            "kernels": provider,
            "device": device,
            "max_abs_err": None,
            "tolerance": None,
            "host_syncs": None,
            "seconds": None,
            "ok": None,
        }
        results.append(result)
        if row["state"] != "applied":
            continue
        module = _selftest_module(name)
        if module is None:
            result.update(ok=False, reason="applied, but the patch declares no selftest")
            continue
        started = time.perf_counter()
        try:
            measured = module.run(device=device)
        except Exception as exc:
            result.update(ok=False, reason="selftest raised %s: %s" % (type(exc).__name__, exc),
                          traceback=traceback.format_exc())
            continue
        result.update(
            max_abs_err=float(measured["max_abs_err"]),
            tolerance=float(measured["tolerance"]),
            host_syncs=int(measured["host_syncs"]),
            seconds=round(time.perf_counter() - started, 3),
            reason=measured.get("detail", ""),
        )
        result["ok"] = result["max_abs_err"] <= result["tolerance"]
    return results


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def table(results):
    headers = ("patch", "target version", "state", "max abs err", "tol", "host syncs/fwd", "seconds", "result")
    rows = []
    for r in results:
        verdict = "-" if r["ok"] is None else ("ok" if r["ok"] else "MISMATCH" if r["max_abs_err"] is not None else "ERROR")
        rows.append((r["patch"], r["target_version"], r["state"], _fmt(r["max_abs_err"], ".2e"),
                     _fmt(r["tolerance"], ".0e"), _fmt(r["host_syncs"], "d"), _fmt(r["seconds"], ".2f"), verdict))
    notes = ["", "notes:"] + ["  %s: %s" % (r["patch"], r["reason"]) for r in results]
    return "\n".join([format_table(headers, rows)] + notes)


def main(as_json=False):
    provider = kernel_provider()
    if provider is None:
        print("npu-shim selftest: no NPU ops here: torch_npu is not importable. On a machine without an "
              "Ascend NPU, run it with NPU_SHIM_EMULATE=1 to check the patched paths on the pure-PyTorch "
              "emulation of the torch_npu ops.")
        return EXIT_NO_KERNELS
    # Frameworks log to stdout while they import and build models: keep stdout for the results.
    with contextlib.redirect_stdout(sys.stderr):
        results = run_all()
    if as_json:
        print(json.dumps(results, indent=2, sort_keys=True))
    else:
        where = "real torch_npu kernels" if provider == "torch_npu" else "pure-PyTorch emulation of torch_npu (NPU_SHIM_EMULATE=1), not an NPU"
        print("npu-shim selftest — ops: %s; device: %s" % (where, results[0]["device"] if results else "-"))
        print(table(results))
    failed = [r for r in results if r["ok"] is False]
    if not any(r["ok"] is not None for r in results) and not as_json:
        print("\nno patch applies in this environment; nothing to check")
    return EXIT_MISMATCH if failed else EXIT_OK
