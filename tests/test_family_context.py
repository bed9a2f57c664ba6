"""The context the engine hands a family's check and build: the patch's name, its counters,
and the one way to mark a replacement; the Patch(check=, build=) shorthand keeps one-argument
callables."""
import types

import pytest

from npu_shim.engine import counters, guards
from npu_shim.patch import Family, FamilyContext, Patch


def toy_module():
    module = types.ModuleType("toy_context_target")

    def greet(name, punctuation="!"):
        """upstream's"""
        return "hi " + name + punctuation

    module.greet = greet
    return module


def test_check_and_build_get_the_patch_name_the_family_and_its_module():
    seen = []

    def check(subject, context):
        seen.append(("check", context.patch, context.family, context.module))

    def build(subject, context):
        seen.append(("build", context.patch, context.family, context.module))
        original = subject.greet

        def greet(*args, **kwargs):
            context.count("calls")
            return original(*args, **kwargs)

        return {"greet": context.present(greet, original, "counted")}

    implementation = types.SimpleNamespace(check=check, build=build, __module__="toy.families")
    patch = Patch(name="toy.context", target="toy_context_target", replaces=("greet",),
                  families=(Family(implementation, keeps="", id="toy-shape"),))
    module = toy_module()
    family, chosen, subject = guards.select_family(patch, module)
    values = guards.build_values(patch, family, chosen, subject)
    assert seen == [("check", "toy.context", "toy-shape", "toy.families"),
                    ("build", "toy.context", "toy-shape", "toy.families")]

    greet = values["greet"]
    assert greet.__npu_shim_patch__ == getattr(greet, FamilyContext.MARK) == "toy.context"
    assert greet.__wrapped_upstream__ is module.greet and not hasattr(greet, "__wrapped__")
    assert (greet.__name__, greet.__qualname__) == (module.greet.__name__, module.greet.__qualname__)
    assert str(greet.__signature__) == "(name, punctuation='!')"
    assert greet.__doc__.startswith("npu-shim (toy.context) replacement of ") and "counted" in greet.__doc__
    counters.reset()
    assert greet("you") == "hi you!"
    assert counters.snapshot()["toy.context"]["calls"] == 1
    counters.reset()


def test_present_wrapped_keeps_functools_convention():
    def original(x):
        return x

    def replacement(x):
        return x

    FamilyContext("toy.context").present(replacement, original, wrapped=True)
    assert replacement.__wrapped__ is original and replacement.__wrapped_upstream__ is original


def test_the_shorthand_takes_one_argument_callables():
    checked = []
    patch = Patch(name="toy.shorthand", target="toy_context_target", replaces=("greet",),
                  check=checked.append, build=lambda module: {"greet": lambda name: "patched"})
    module = toy_module()
    family, implementation, subject = guards.select_family(patch, module)
    values = guards.build_values(patch, family, implementation, subject)
    assert checked == [module] and values["greet"]("you") == "patched"


def test_build_gets_what_the_check_found_on_the_context_the_check_ran_with():
    """A check's return value reaches build as ``context.found`` (guards.Chosen.context);
    a check that returns None leaves it None, as before."""
    module = toy_module()
    found_by_check = {"greet": module.greet}
    seen = []

    def check(subject, context):
        seen.append(context)
        return found_by_check

    def build(subject, context):
        seen.append(context)
        return {"greet": context.present(lambda *a, **k: "patched", context.found["greet"], "found")}

    implementation = types.SimpleNamespace(check=check, build=build, __module__="toy.families")
    patch = Patch(name="toy.found", target="toy_context_target", replaces=("greet",),
                  families=(Family(implementation, keeps="", id="toy-shape"),))
    chosen = guards.select_family(patch, module)
    family, chosen_implementation, subject = chosen
    values = guards.build_values(patch, family, chosen_implementation, subject, chosen.context)
    assert seen[0] is seen[1] is chosen.context and chosen.context.found is found_by_check
    assert values["greet"].__wrapped_upstream__ is module.greet

    quiet = types.SimpleNamespace(check=lambda subject, context: None, build=build, __module__="toy.families")
    patch = Patch(name="toy.quiet", target="toy_context_target", replaces=("greet",),
                  families=(Family(quiet, keeps="", id="toy-shape"),))
    assert guards.select_family(patch, module).context.found is None


def test_replace_own_replaces_the_function_the_check_found():
    """structure.replace_own takes the original from what the check returned
    (structure.expect_own_body's ``{"Class.name": function}``), not from a second look-up."""
    from npu_shim.patches._shared import structure

    class Tower:
        def forward(self, x):
            return x

    module = types.ModuleType("toy_tower")
    module.Tower = Tower
    digest = structure.body_digest(Tower.forward)
    context = FamilyContext("toy.tower")
    context.found = structure.expect_own_body(module, "Tower", "forward", {digest}, "the toy")
    assert context.found == {"Tower.forward": Tower.forward}

    def checked_forward(self, x):     # what the check read, no longer the class's attribute
        return x

    context.found = {"Tower.forward": checked_forward}
    made = structure.replace_own(module, "Tower", "forward", lambda m, original, c: (lambda self, x: original(self, x)),
                                 context, "toy")
    assert made.__wrapped_upstream__ is checked_forward
    context.found = None
    made = structure.replace_own(module, "Tower", "forward", lambda m, original, c: (lambda self, x: original(self, x)),
                                 context, "toy")
    assert made.__wrapped_upstream__ is Tower.forward


VERSIONS_ONCE = '''
import json, sys, types
sys.path.insert(0, {toy!r})
import npu_shim
from npu_shim.engine import guards
from npu_shim.patch import Family, Patch
reads = []
installed_version = guards.installed_version
def counting(dist):
    reads.append(dist)
    return installed_version(dist)
guards.installed_version = counting
found = []
def check(module, context):
    return {{"greet": module.greet}}
def build(module, context):
    found.append(context.found["greet"] is module.greet)
    return {{"greet": lambda: "patched"}}
family = Family(types.SimpleNamespace(check=check, build=build), keeps="", id="toy-shape",
                fence=">=0", dist="wrapt")
npu_shim.register(Patch(name="toy.once", target="toy_once", replaces=("greet",),
                        requires={{"packaging": ">=0"}}, families=(family,)))
del reads[:]
import toy_once
print(json.dumps({{"reads": reads, "found": found, "greet": toy_once.greet()}}))
'''


def test_the_engine_reads_the_installed_versions_once_per_application(tmp_path, run_python):
    """One application (the target imported): each distribution the patch's guard and fences
    read is looked up once, and build gets what check found."""
    import json

    (tmp_path / "toy_once.py").write_text("def greet():\n    return 'hi'\n")
    out = json.loads(run_python(VERSIONS_ONCE.format(toy=str(tmp_path))).stdout.strip().splitlines()[-1])
    assert out == {"reads": ["packaging", "wrapt"], "found": [True], "greet": "patched"}, out


def upstream_forward(self, x, grid_thw, scale=1.0, *, out=None):
    return x


def _refusal(replacement):
    from npu_shim.patch import signature_refusal

    return signature_refusal(replacement, upstream_forward)


def test_a_replacement_that_takes_every_upstream_call_is_presented():
    """Pass-through (wrapt's (*args, **kwargs)) and upstream's parameters typed out both take every
    call; an extra parameter with a default is the replacement's own business."""
    assert _refusal(lambda self, *args, **kwargs: None) == ""
    assert _refusal(lambda self, x, grid_thw, scale=1.0, *, out=None: None) == ""
    assert _refusal(lambda layer, x, grid_thw, scale=2.0, *, out=None, trace=False: None) == ""
    assert _refusal(lambda self, x, *args, **kwargs: None) == ""


@pytest.mark.parametrize("replacement, why", [
    (lambda self, x, grid_thw: None, "'scale' (position 4) is not a parameter of the replacement"),
    (lambda self, x, grid_thw, scale=1.0: None, "keyword 'out' is not a parameter"),
    (lambda self, x, grid_thw, scale, *, out=None: None, "'scale' has a default, the replacement's 'scale' none"),
    (lambda self, x, grid, scale=1.0, *, out=None: None, "takes 'grid' where upstream takes 'grid_thw'"),
    (lambda self, x, grid_thw, scale=1.0, *, out=None, extra: None, "requires extra"),
    (lambda self, x, *args: None, "'grid_thw' cannot be passed to the replacement by name"),
])
def test_a_replacement_that_cannot_take_an_upstream_call_is_not_the_shape(replacement, why):
    """Upstream added a parameter the hand-typed wrapper lacks (or renamed one): the structural
    check fails with "not the shape" instead of a TypeError at the first call."""
    from npu_shim.patch import TargetMismatch

    assert why in _refusal(replacement)
    with pytest.raises(TargetMismatch, match="upstream_forward: "):
        FamilyContext("toy.context").present(replacement, upstream_forward)
