"""What the families' checks read of a target's structure, shared by the patches."""
import inspect

from npu_shim.patch import TargetMismatch


def own_function(cls, name):
    """``cls.name`` as a plain function the class itself defines (not inherited, not a wrapper
    object); TargetMismatch naming it otherwise."""
    function = vars(cls).get(name)
    if not inspect.isfunction(function):
        raise TargetMismatch("%s.%s is not a function defined by the class" % (cls.__name__, name))
    return function
