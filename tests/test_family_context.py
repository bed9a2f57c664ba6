"""The context the engine hands a family's check and build: the patch's name, its counters,
and the one way to mark a replacement; the Patch(check=, build=) shorthand keeps one-argument
callables."""
import types

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
                  families=(Family(("1.0",), implementation, keeps="", id="toy-shape"),))
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
