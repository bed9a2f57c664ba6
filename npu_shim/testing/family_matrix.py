"""Every family's structural check against the upstream code installed here, and the
families the shim applies, for the tests of the family choice (run in a fresh
interpreter: ``python -P -m npu_shim.testing.family_matrix checks|status``, one JSON
object on the last line of stdout).

``checks`` must run with ``NPU_SHIM=0``: the checks are meant for upstream's code, and
an applied patch would show them its own replacement. Targets are imported the way the
lane tests import them (:func:`npu_shim.testing.towers.setup`, vllm-ascend modules
without ``vllm_ascend/ops/__init__.py``), under the torch_npu emulation.

:func:`checks_of_originals` runs the same checks in a process where the shim has applied its
patches (``lanes/report.py`` runs it right after ``npu-shim status --import``, in the same
interpreter, which saves the lane one more import of every target): it uninstalls the shim
first, which restores the original objects the engine kept, and reports any replacement
still in place instead of letting a check look at it.
"""
import importlib
import json
import os
import sys

__all__ = ["checks", "checks_of_originals", "main", "status"]


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


def checks_of_originals():
    """``{"checks": checks(), "problems": [...], "reverted": [...], "rebound": [...]}`` in a
    process where the shim is installed and has applied patches (``npu-shim status --import``
    ran here): upstream's code is checked, not a replacement.

    The shim is uninstalled (every applied patch reverted to the original object the engine
    kept) and kept off (``NPU_SHIM=0``: :func:`towers.setup`'s ``npu_shim.install()`` arms
    nothing). A module imported while a patch was on may have bound a replaced name itself
    (``from ..utils import _merge_multimodal_embeddings`` in vLLM's Qwen3-Omni thinker):
    each such module-level name outside ``npu_shim`` is bound to the original again, as it
    would be in a process where the shim never ran, and listed in ``rebound``. Then, before
    and after the checks, every slot a patch wrote must hold its original, and no replacement
    may be left in any module's namespace outside ``npu_shim`` or in a patch subject's; each
    finding is a problem, and the caller fails."""
    import npu_shim
    from npu_shim import _startup

    written, originals = {}, []
    if _startup._State.engine is not None:
        for name, record in sorted(_startup._State.engine._records.items()):
            for slot, original in record.undo or ():
                value = slot.read_own()
                written[id(value)] = (name, slot.path, value, original)   # the reference keeps the id taken
                originals.append((name, slot, original))
    os.environ["NPU_SHIM"] = "0"
    npu_shim.uninstall()
    rebound = []
    for module_name, space in _upstream_namespaces():
        for key, value in list(space.items()):
            hit = written.get(id(value))
            if hit is not None and hit[2] is value and _present(hit[3]):
                space[key] = hit[3]
                rebound.append("%s.%s (%s: %s)" % (module_name, key, hit[0], hit[1]))
    problems = _left_in_place(written, originals)
    result = checks()
    problems += [p for p in _left_in_place(written, originals) if p not in problems]
    return {"checks": result, "problems": problems, "reverted": sorted({o[0] for o in originals}),
            "rebound": sorted(rebound)}


def _present(original):
    from npu_shim.engine.slots import _MISSING

    return original is not _MISSING


def _upstream_namespaces():
    """``(module name, namespace)`` of every imported module outside ``npu_shim``."""
    for name, module in list(sys.modules.items()):
        space = getattr(module, "__dict__", None)
        if isinstance(space, dict) and name != "npu_shim" and not name.startswith("npu_shim."):
            yield name, space


def _left_in_place(written, originals):
    """Where a replacement the shim wrote is still reachable (see checks_of_originals)."""
    from npu_shim.engine import guards
    from npu_shim.patches import BUILTIN_PATCHES

    problems = ["%s: %s does not hold its original again after npu_shim.uninstall()" % (name, slot.path)
                for name, slot, original in originals if slot.read_own() is not original]
    spaces = list(_upstream_namespaces())
    for _, module_name in BUILTIN_PATCHES:
        patch = importlib.import_module(module_name).PATCH
        module = sys.modules.get(patch.target)
        if module is None:
            continue
        try:
            subject = guards.subject_of(patch, module)
        except Exception:                # noqa: BLE001 -- checks() reports a missing subject
            subject = module
        if subject is not module and hasattr(subject, "__dict__"):
            spaces.append(("%s.%s" % (patch.target, patch.subject), vars(subject)))
    for where, space in spaces:
        for key, value in list(space.items()):
            hit = written.get(id(value))
            if hit is not None and hit[2] is value:
                problems.append("%s.%s is still the replacement %s wrote to %s" % (where, key, hit[0], hit[1]))
    return problems


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
