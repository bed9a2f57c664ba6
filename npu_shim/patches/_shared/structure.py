"""What the families' checks read of a target's structure, and a class's own function replaced."""
import inspect
import types
import typing

from npu_shim.patch import TargetMismatch


def module_class(module, name):
    """The class ``module.name``; TargetMismatch naming the module and the class otherwise."""
    found = getattr(module, name, None)
    if not isinstance(found, type):
        raise TargetMismatch("%s has no class %s" % (getattr(module, "__name__", module), name))
    return found


def own_function(cls, name):
    """``cls.name`` as a plain function the class itself defines (not inherited, not a wrapper
    object); TargetMismatch naming it, or what stands there instead, otherwise."""
    function = vars(cls).get(name)
    if not inspect.isfunction(function) or type(function) is not types.FunctionType:
        if function is None:
            raise TargetMismatch("%s.%s is not a function defined by the class" % (cls.__name__, name))
        raise TargetMismatch("%s.%s is %s, not upstream's function: another tool's wrapper stands there; the "
                             "patch was written for upstream's code, not for it" % (cls.__name__, name,
                                                                                    foreign(function)))
    return function


def foreign(thing) -> str:
    """What stands where upstream's function was expected, for a refusal's reason: its type, the
    file its code was compiled from (``functools.wraps`` copies the wrapped function's
    ``__module__``, not its file), and what it wraps (``__wrapped__``: functools.wraps, wrapt)."""
    kind = type(thing)
    text = "a %s.%s" % (kind.__module__, kind.__qualname__)
    if kind is types.FunctionType:
        text += " compiled from %s" % thing.__code__.co_filename
    inner = getattr(thing, "__wrapped__", None)
    if inner is not None:
        text += " wrapping %s.%s" % (getattr(inner, "__module__", "?"), getattr(inner, "__qualname__", repr(inner)))
    return text


class Edited(typing.NamedTuple):
    """What a family's check found at one path, upstream's ``original``, and the ``edited`` function
    it made of it. The check returns ``{path: Edited(...)}``; build installs that very edit
    (:func:`edit_of`), so each function is edited once, and build cannot install an edit other than
    the one the check accepted."""

    original: types.FunctionType
    edited: types.FunctionType


def edit_of(context, path):
    """The edited function the family's check made at ``path`` (an :class:`Edited` it returned)."""
    held = context.found.get(path) if isinstance(context.found, dict) else None
    if not isinstance(held, Edited):
        raise TypeError("the check of %s returned no Edited for %s (build installs the check's edit)"
                        % (context.patch, path))
    return held.edited


def found(context, path, look_up):
    """What the family's check found at ``path`` (its ``context.found``, when the check returned
    ``{path: object}``), else ``look_up()``: build replaces the very object the check read."""
    held = context.found if isinstance(context.found, dict) else {}
    return held[path] if path in held else look_up()


def replace_own(module, class_name, name, make, context, what):
    """The replacement of ``class_name.name`` (the class in ``module`` defines it itself):
    ``make(module, original, context)``, presented with ``context.present`` and ``what``.
    The original is the function the check found there (:func:`found`, e.g. returned by
    :func:`expect_own_body`), else looked up."""
    original = found(context, "%s.%s" % (class_name, name),
                     lambda: own_function(module_class(module, class_name), name))
    if isinstance(original, Edited):
        original = original.original
    return context.present(make(module, original, context), original, what)


def body_digest(function):
    """A hash of ``function``'s code: its source parsed, docstring and decorators dropped,
    unparsed (comments and layout do not count); TargetMismatch where there is no source.

    The families that write an upstream body out in full accept only the bodies they were
    written from, by this digest."""
    import ast
    import hashlib
    import textwrap

    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError):
        raise TargetMismatch("%s: no source to read" % getattr(function, "__qualname__", function))
    node = ast.parse(source).body[0]
    body = node.body
    if body and isinstance(body[0], ast.Expr) and isinstance(getattr(body[0], "value", None), ast.Constant) \
            and isinstance(body[0].value.value, str):
        node.body = body[1:] or [ast.Pass()]
    node.decorator_list = []
    return hashlib.sha256(ast.unparse(node).encode()).hexdigest()[:12]


def expect_body(function, digests, what):
    """``function``; TargetMismatch unless its :func:`body_digest` is one of ``digests``."""
    digest = body_digest(function)
    if digest not in digests:
        raise TargetMismatch("%s is not the body %s was written from (digest %s, known %s)"
                             % (function.__qualname__, what, digest, ", ".join(sorted(digests))))
    return function


def expect_own_body(module, class_name, name, digests, what):
    """``{"class_name.name": function}``, the class's own function whose body is one of
    ``digests`` (:func:`expect_body`), for a check to return: :func:`replace_own` then
    replaces that very function (:func:`found`)."""
    function = own_function(module_class(module, class_name), name)
    return {"%s.%s" % (class_name, name): expect_body(function, digests, what)}


def upstream_of(function, limit=16):
    """Upstream's function under the shim's replacements of it: each replacement names the one it
    stands in for (``__wrapped_upstream__``, :meth:`FamilyContext.present`), and patches that
    replace one attribute stack, the later wrapping the earlier."""
    for _ in range(limit):
        inner = getattr(function, "__wrapped_upstream__", None)
        if inner is None:
            break
        function = inner
    return function


def replacement_of(function, patch, limit=16):
    """The replacement made by ``patch`` among ``function`` and the replacements under it, or None."""
    for _ in range(limit):
        if function is None:
            return None
        if getattr(function, "__npu_shim_patch__", None) == patch:
            return function
        function = getattr(function, "__wrapped_upstream__", None)
    return None
