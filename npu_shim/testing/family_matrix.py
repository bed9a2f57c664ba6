"""Every family's structural check against the upstream code installed here, and the
families the shim applies, for the tests of the family choice (run in a fresh
interpreter: ``python -P -m npu_shim.testing.family_matrix checks|status``, one JSON
object on the last line of stdout).

``checks`` must run with ``NPU_SHIM=0``: the checks are meant for upstream's code, and
an applied patch would show them its own replacement. Targets are imported the way the
lane tests import them (:func:`npu_shim.testing.towers.setup`, vllm-ascend modules
without ``vllm_ascend/ops/__init__.py``), under the torch_npu emulation.
"""
import importlib
import json
import os
import sys

__all__ = ["checks", "main", "status"]


def _targets():
    """Import the towers' stack and every vLLM / vllm-ascend patch target that imports here."""
    os.environ.setdefault("VLLM_PLUGINS", "")
    from npu_shim.patches import BUILTIN_PATCHES
    from npu_shim.testing import towers
    from npu_shim.testing.isolation import import_vllm_ascend_module

    try:
        towers.setup()
    except ModuleNotFoundError:
        # releases older than the towers' stack (vllm-ascend 0.13 has no vllm_ascend._310p):
        # each target below is imported on its own, and one that fails says why
        pass
    patches = [importlib.import_module(module).PATCH for _, module in BUILTIN_PATCHES]
    modules = {}
    for patch in patches:
        if not patch.target.startswith(("vllm.", "vllm_ascend.")):
            continue
        try:
            modules[patch.name] = (import_vllm_ascend_module(patch.target) if patch.target.startswith("vllm_ascend.")
                                   else importlib.import_module(patch.target))
        except Exception as exc:         # noqa: BLE001 -- reported, the caller decides
            modules[patch.name] = "%s: %s" % (type(exc).__name__, exc)
    return patches, modules


def checks():
    """``{patch: {"window": bool, "admitted": [family], "results": {family: outcome}}}``:
    ``outcome`` is ``accept``, ``not needed: ...``, ``mismatch: ...`` or ``error: ...``."""
    from npu_shim.engine import guards
    from npu_shim.patch import FamilyContext, NotNeeded, TargetMismatch

    patches, modules = _targets()
    out = {}
    for patch in patches:
        module = modules.get(patch.name)
        if module is None or isinstance(module, str) or not patch.named_families:
            continue
        versions = guards.versions_of(patch)
        entry = {"window": guards.guard_failure(patch, versions) is None,
                 "admitted": guards.admitting_families(patch, versions), "results": {}}
        try:
            subject = guards.subject_of(patch, module)
        except TargetMismatch as exc:
            entry["results"] = {f.name: "mismatch: %s" % exc for f in patch.families}
            out[patch.name] = entry
            continue
        for family in patch.families:
            try:
                family.load().check(subject, FamilyContext.of(patch, family))
                outcome = "accept"
            except NotNeeded as exc:
                outcome = "not needed: %s" % exc
            except TargetMismatch as exc:
                outcome = "mismatch: %s" % exc
            except Exception as exc:     # noqa: BLE001
                outcome = "error: %s: %s" % (type(exc).__name__, exc)
            entry["results"][family.name] = outcome
        out[patch.name] = entry
    return out


def status():
    """``{patch: {"state", "family", "reason"}}`` after importing the targets with the shim on."""
    import npu_shim

    _targets()
    return {row["name"]: {key: row[key] for key in ("state", "family", "reason")} for row in npu_shim.status()}


def main(argv=None):
    what = (argv or sys.argv[1:] or ["checks"])[0]
    from npu_shim import emulation

    emulation.install()
    result = {"checks": checks, "status": status}[what]()
    sys.stdout.write("\n" + json.dumps(result) + "\n")


if __name__ == "__main__":
    main()
