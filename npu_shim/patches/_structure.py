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


def present_as(replacement, original, patch_name, what, module):
    """Give ``replacement`` the name, qualified name and signature of ``original``, a docstring
    naming the patch, what it does beside upstream's code (``what``) and the ``module`` that
    explains it, and ``__wrapped_upstream__`` (where the tests and readers find upstream's)."""
    replacement.__name__ = original.__name__
    replacement.__qualname__ = original.__qualname__
    replacement.__doc__ = "npu-shim (%s) replacement of %s.%s: %s; see %s." % (
        patch_name, original.__module__, original.__qualname__, what, module)
    replacement.__signature__ = inspect.signature(original)
    replacement.__wrapped_upstream__ = original
    return replacement
