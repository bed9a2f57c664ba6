"""``npu-shim selftest``: run every patched path that applies here.

For each patch whose target is installed, the runner imports the target (so
the patch applies or records why not), then runs the patch's declared
:class:`~npu_shim.patch.Selftest`: by default ``npu_shim.selftest.<patch
module>.run(device)``. That runs the patched path on a small real upstream
module with random weights against the float64 reference and returns its
error under the key that names the measure (:data:`ERROR_MEASURES`),
``tolerance``, ``host_syncs`` (the device->host reads counted over the patched
call), ``seconds`` and ``detail``.

A row is "ok" only when the error is within its tolerance *and* the reads are
the ones the patch declares (``Selftest.host_syncs``): a host-lengths fix
that reads back again computes the right numbers, so the error alone cannot
tell. Any other row, or a selftest that raises, makes the command exit 1.

On an NPU box the real torch_npu kernels run on device ``npu``. Elsewhere the
ops exist only as the pure-PyTorch emulation, which must be asked for with
NPU_SHIM_EMULATE=1; the table says which ran.
"""
import contextlib
import importlib.util
import json
import sys
import time
import traceback

from npu_shim import _startup
from npu_shim._table import format_table
from npu_shim.patches import BUILTIN_PATCHES

EXIT_OK, EXIT_MISMATCH, EXIT_NO_KERNELS = 0, 1, 2

# The error measures a selftest may report, each under its own key, and what it is
# relative to; ``ref`` is the float64 reference of the same computation.
ERROR_MEASURES = {
    "max_abs_err": "max |out - ref| over every element, in the output's units (absolute; where the "
                   "tolerance scales with max |ref|, the selftest's module says so)",
    "max_rel_err": "max |out - ref| / max |ref|: relative to the reference's largest magnitude",
}


# The patch whose selftest runs on upstream's own code (:func:`run_upstream`), or None.
_ON_UPSTREAM = []


def on_upstream(patch_name):
    """True while :func:`run_upstream` runs ``patch_name``'s selftest with upstream's code in the
    patch's slots: the selftest's checks that the shim's replacement is in place (and took its
    path) do not hold then, and are left out; everything it measures is measured as always."""
    return bool(_ON_UPSTREAM) and _ON_UPSTREAM[-1] == patch_name


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


def _declared(patch_name):
    """The patch's :class:`~npu_shim.patch.Selftest`, or None."""
    return _startup.engine().patch_named(patch_name).selftest


def judge(declared, measured):
    """The verdict fields of one selftest run: ``measured`` (what its ``run`` returned) against
    ``declared`` (the patch's :class:`~npu_shim.patch.Selftest`)."""
    measures = [key for key in ERROR_MEASURES if key in measured]
    if len(measures) != 1:
        raise ValueError("a selftest reports its error under exactly one of %s; got %s"
                         % (sorted(ERROR_MEASURES), sorted(measured)))
    measure = measures[0]
    case = measured.get("case")
    expected = declared.expected(case)
    verdict = {
        "error": float(measured[measure]),
        "error_measure": measure,
        "tolerance": float(measured["tolerance"]),
        "host_syncs": int(measured["host_syncs"]),
        "expected_host_syncs": expected,
        "case": case,
    }
    failed, why = [], []
    if not verdict["error"] <= verdict["tolerance"]:          # NaN fails too
        failed.append("error")
        why.append("%s %.3g over tolerance %.3g" % (measure, verdict["error"], verdict["tolerance"]))
    if expected is None or verdict["host_syncs"] != expected:
        failed.append("reads")
        why.append("counted %d device->host reads, the patch declares %s%s" % (
            verdict["host_syncs"], "none for this case" if expected is None else expected,
            " (case %r)" % case if case is not None else ""))
    verdict.update(failed=failed, ok=not failed,
                   verdict="ok" if not failed else "FAIL (%s): %s" % (", ".join(failed), "; ".join(why)))
    return verdict


def run_one(patch_name, device="cpu"):
    """Run ``patch_name``'s declared selftest and judge it: :func:`judge`'s fields plus
    ``seconds`` and ``detail``. Raises what the selftest raises."""
    declared = _declared(patch_name)
    if declared is None:
        raise LookupError("%s declares no selftest" % patch_name)
    arguments = dict(declared.arguments, patch=patch_name) if declared.arguments else {}
    measured = declared.load()(device=device, **arguments)
    result = judge(declared, measured)
    result.update(seconds=float(measured["seconds"]), detail=measured.get("detail", ""))
    return result


# The emulated SoC of each device class a Defect may name (Defect.on).
_SOC = {"310P": "Ascend310P3"}


@contextlib.contextmanager
def _environment(variables):
    """``variables`` set in os.environ while the block runs, the previous values put back."""
    import os

    saved = {name: os.environ.get(name) for name in variables}
    os.environ.update(variables)
    try:
        yield
    finally:
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value


def run_upstream(patch_name, device="cpu"):
    """Run ``patch_name``'s declared selftest with upstream's own code in the patch's slots
    (:func:`npu_shim.engine.registry.upstream_in_place`) and judge it as :func:`run_one` does:
    what upstream shows there, the defect the patch fixes while upstream has it. Adds ``raised``
    (the exception the run raised, or None; then no other verdict field is measured)."""
    from npu_shim.engine import registry

    declared = _declared(patch_name)
    if declared is None:
        raise LookupError("%s declares no selftest" % patch_name)
    arguments = dict(declared.arguments, patch=patch_name) if declared.arguments else {}
    defect = _startup.engine().patch_named(patch_name).defect
    emulated = {"NPU_SHIM_EMULATE_SOC": _SOC[defect.on]} if defect is not None and defect.on else {}
    with registry.upstream_in_place(patch_name), _environment(emulated):
        _ON_UPSTREAM.append(patch_name)
        try:
            measured = declared.load()(device=device, **arguments)
        except Exception as exc:
            return {"raised": exc, "ok": False, "failed": ["raised"], "host_syncs": None, "error": None,
                    "verdict": "raised %s: %s" % (type(exc).__name__, exc), "detail": ""}
        finally:
            _ON_UPSTREAM.pop()
    result = judge(declared, measured)
    result.update(raised=None, seconds=float(measured["seconds"]), detail=measured.get("detail", ""))
    return result


def retirement(patch_name, device="cpu"):
    """The retirement guard of applied ``patch_name``: ``(message, result)``, ``message`` ""
    while upstream's own code still shows the patch's :class:`~npu_shim.patch.Defect` the
    declared way (``result``: :func:`run_upstream`'s). Where upstream's run is clean (the
    selftest's verdict "ok" on upstream's code), the message is "upstream fixed <what> in
    <release>: close the window (family <name>, fence <spec>)"; where it fails another way than
    declared, it says what it showed instead."""
    from npu_shim import status

    patch = _startup.engine().patch_named(patch_name)
    if patch.defect is None:
        raise LookupError("%s declares no defect (Patch.defect): it has no retirement guard" % patch_name)
    rows = {r["name"]: r for r in status()}
    row = rows[patch_name]
    family = next((f for f in patch.families if f.name == row["family"]), patch.families[0])
    dist = patch.family_dist(family) if (family.dist or patch.requires) else ""
    release = "%s %s" % (dist, row["versions"].get(dist)) if dist else "this release"
    fence = family.fence or ", ".join("%s %s" % kv for kv in patch.requires.items()) or "none"
    hidden = next((why for where, why in patch.defect.hidden.items()
                   if rows.get(where.partition(":")[0], {}).get("family") == where.partition(":")[2]), "")
    result = run_upstream(patch_name, device)
    result["hidden"] = hidden
    if hidden:
        if result["ok"]:
            return "", result
        return ("%s's retirement guard: declared hidden here (%s), but upstream's run in %s fails: %s; the "
                "declaration Defect.hidden is stale" % (patch_name, hidden, release, result["verdict"]), result)
    if result["ok"]:
        return ("upstream fixed %s in %s: close the window (family %s, fence %s); %s's selftest passes on "
                "upstream's own code (%s)" % (patch.defect.what, release, family.name, fence, patch_name,
                                              result["verdict"]), result)
    other = patch.defect.shown_by(result)
    if other:
        return ("%s's retirement guard: upstream's code in %s no longer shows %s the declared way (%s: %s); "
                "%s: read what upstream changed, then close the window (family %s, fence %s) or declare "
                "how the defect shows now" % (patch_name, release, patch.defect.what, " or ".join(patch.defect.ways),
                                              other, result["verdict"], family.name, fence), result)
    return "", result


def _targets_importable(provider):
    """On the emulation, every installed target importable off the NPU as the lanes import them
    (:func:`npu_shim.testing.towers.targets_importable`: vllm-ascend's ops module without its
    package ``__init__``, ``torch.npu`` registered as a real torch_npu registers it); on a real
    torch_npu nothing is needed."""
    if provider != "emulation":
        return contextlib.nullcontext()
    from npu_shim.testing.towers import targets_importable

    return targets_importable()


def run_all(device=None):
    provider = kernel_provider()
    with _targets_importable(provider):
        rows_by_name = {row["name"]: row for row in _startup.engine().status(import_targets=True)}
        device = device or ("npu" if provider == "torch_npu" else "cpu")
        results = _run_patches(rows_by_name, provider, device)
    return results + run_op_reports(provider, device)


def run_op_reports(provider, device):
    """One row per op call upstream has reported silently wrong (:mod:`.op_reports`), probed here."""
    from npu_shim.selftest import op_reports

    results = []
    for report in op_reports.REPORTS:
        result = {"patch": "report " + report.key, "target_version": report.op, "state": "probe",
                  "reason": report.failure(), "kernels": provider, "device": device, "error": None,
                  "error_measure": None, "tolerance": None, "host_syncs": None, "expected_host_syncs": None,
                  "case": None, "seconds": None, "failed": [], "verdict": None, "ok": None,
                  "issue": report.issue, "op": report.op, "call": report.call, "try": report.try_instead}
        results.append(result)
        try:
            measured = op_reports.run(report, device)
        except Exception as exc:
            result.update(ok=False, failed=["raised"], verdict="ERROR: raised",
                          reason="probe of %s(%s) raised %s: %s" % (report.op, report.call, type(exc).__name__, exc),
                          traceback=traceback.format_exc())
            continue
        result.update(error=measured["max_abs_err"], error_measure="max_abs_err", tolerance=measured["tolerance"],
                      seconds=round(measured["seconds"], 3), ok=measured["ok"], verdict=measured["verdict"],
                      failed=[] if measured["ok"] else ["error"], reason=measured["detail"])
    return results


def _run_patches(rows_by_name, provider, device):
    results = []
    for name, _ in BUILTIN_PATCHES:
        row = rows_by_name[name]
        declared = _declared(name)
        result = {
            "patch": name,
            "target_version": ", ".join("%s %s" % (d, v) for d, v in row["versions"].items() if v) or "-",
            "state": row["state"],
            "reason": row["reason"],
            "kernels": provider,
            "device": device,
            "error": None,
            "error_measure": None,
            "tolerance": None,
            "host_syncs": None,
            "expected_host_syncs": declared.host_syncs if declared is not None else None,
            "case": None,
            "seconds": None,
            "failed": [],
            "verdict": None,
            "ok": None,
        }
        results.append(result)
        if row["state"] != "applied":
            continue
        if declared is None:
            result.update(ok=False, failed=["no selftest"], verdict="ERROR: no selftest",
                          reason="applied, but the patch declares no selftest")
            continue
        started = time.perf_counter()
        try:
            verdict = run_one(name, device)
        except Exception as exc:
            result.update(ok=False, failed=["raised"], verdict="ERROR: raised",
                          reason="selftest raised %s: %s" % (type(exc).__name__, exc),
                          traceback=traceback.format_exc())
            continue
        detail = verdict.pop("detail")
        verdict.pop("seconds")
        result.update(verdict, seconds=round(time.perf_counter() - started, 3), reason=detail)
    return results


def _fmt(value, spec):
    return "-" if value is None else format(value, spec)


def _verdict(r):
    """The table's short verdict; the reason is in the row's ``verdict`` and the notes."""
    if r["ok"] is None:
        return "-"
    if r["ok"]:
        return "ok"
    if r["error"] is None:
        return "ERROR"
    return "FAIL (%s)" % ", ".join(r["failed"])


def _expected(value):
    if value is None:
        return "-"
    if isinstance(value, dict):
        return " or ".join(str(n) for n in value.values())     # per case; the notes name the case run
    return str(value)


def _note(r):
    parts = []
    if r.get("ok") is False and r.get("verdict"):
        parts.append(r["verdict"])
    if r.get("case"):
        parts.append("case: %s" % r["case"])
    return "; ".join(parts + [r["reason"]])


def table(results):
    headers = ("patch", "target version", "state", "error", "measure", "tol", "d2h reads", "expected",
               "seconds", "result")
    rows = []
    for r in results:
        rows.append((r["patch"], r["target_version"], r["state"], _fmt(r["error"], ".2e"),
                     r["error_measure"] or "-", _fmt(r["tolerance"], ".0e"), _fmt(r["host_syncs"], "d"),
                     _expected(r["expected_host_syncs"]), _fmt(r["seconds"], ".2f"), _verdict(r)))
    measures = sorted({r["error_measure"] for r in results if r["error_measure"]})
    legend = ["", "error measures (ref: the float64 reference):"] + [
        "  %s: %s" % (m, ERROR_MEASURES[m]) for m in measures] if measures else []
    reads = ["", "d2h reads: device->host reads counted over the patched call; \"ok\" needs them equal "
                 "to the patch's declared count (expected) and the error within tol."]
    notes = ["", "notes:"] + ["  %s: %s" % (r["patch"], _note(r)) for r in results]
    return "\n".join([format_table(headers, rows)] + legend + reads + notes)


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
