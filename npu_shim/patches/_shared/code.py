"""What a function's code says, read the same way by every patch.

:func:`names_in_code` is the one scanner of the global and attribute names a code object
refers to (``co_names``); with ``nested`` also those of the code nested in it (inner
functions, closures, comprehensions). Names are compared exactly, never as substrings:
``kv_len_prev_list`` is not ``kv_len_prev``.

:func:`source_text` is a function's source with every run of white space folded to one
space, so a check can look for upstream's statements whatever their layout.
"""
import types

from npu_shim.patch import TargetMismatch

__all__ = ["names_in_code", "code_names", "source_text"]


def names_in_code(code, nested=True) -> frozenset:
    """Every global/attribute name ``code`` refers to and, with ``nested``, those of the code
    nested in it."""
    if not nested:
        return frozenset(code.co_names)
    names, pending = set(), [code]
    while pending:
        code = pending.pop()
        names.update(code.co_names)
        pending.extend(const for const in code.co_consts if isinstance(const, types.CodeType))
    return frozenset(names)


def code_names(function, what=None, nested=True) -> frozenset:
    """:func:`names_in_code` of ``function`` (unwrapped: ``functools.wraps`` wrappers are read
    through); TargetMismatch naming ``what`` (default: the function) where it has no Python code."""
    import inspect

    function = inspect.unwrap(function)
    code = getattr(function, "__code__", None)
    if code is None:
        raise TargetMismatch("%s is not a Python function (%s)"
                             % (what or getattr(function, "__qualname__", function), type(function).__name__))
    return names_in_code(code, nested)


def source_text(function, missing=None) -> str:
    """``function``'s source, white space folded to single spaces. Where there is no source:
    TargetMismatch(``missing``), or the error itself where ``missing`` is None."""
    import inspect

    try:
        source = inspect.getsource(function)
    except (OSError, TypeError):
        if missing is None:
            raise
        raise TargetMismatch(missing) from None
    return " ".join(source.split())
