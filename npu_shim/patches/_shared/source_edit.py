"""A fix as an edit of upstream's own function: anchors named, counted, compiled at upstream's lines.

A tower patch used to write out upstream's whole method with two lines changed, accepted by a
digest of the body it was copied from. Here the patch names only what it changes::

    rot_pos_emb = edit_function(original, [
        InsertBefore("return rotary_pos_emb_full[pos_ids].flatten(1)",
                     "pos_ids = pos_ids.to(rotary_pos_emb_full.device, non_blocking=True)"),
    ])

:func:`edit_function` reads ``original``'s source, parses it (:mod:`ast`), applies each edit to the
statements or expressions equal to its anchor (compared as syntax trees, so layout and comments do
not matter), and compiles the result under upstream's file name, every untouched statement at its
upstream line (an inserted statement takes its anchor's line), so a traceback points into upstream's
file. Each anchor must be found exactly ``count`` times: missing, or found more often,
:class:`~npu_shim.patch.TargetMismatch` names the function and the anchor. Before editing, the
unedited source is compiled the same way and must give the very code object the interpreter runs
(bytecode, names and constants, nested code objects compared the same way), so an edit never applies
to source that is not the code in use (a file changed after import, a wrapper's source). :class:`AddKeyword` names a
callee instead (``"Pool"``) and adds one keyword argument to each call of it, where upstream's call
leaves an argument out.

The edited function runs in upstream's module globals (the live dict, not a copy) and shares the
original's closure cells, ``__class__`` included (zero-argument ``super()`` works); its defaults,
keyword defaults, annotations and attributes are the original's objects (never re-evaluated).
``names`` hands the inserted code values of the shim's own (a counter, a helper) as closure cells,
never through upstream's globals. Refused with the reason, as :class:`~npu_shim.patch.TargetMismatch`
(this is not the code the edit was written for; an edit text that does not parse is the patch's own
error, ValueError, raised where the edit is declared): a lambda, a function whose source does
not compile to its code (a method using a private ``__name``, which the class body mangles), a
``functools.wraps`` wrapper (edit the function it wraps), a ``names``
entry the original code already uses, an edit whose result does not compile (a ``nonlocal`` of a
name upstream's function does not close over, say), a :class:`ReplaceExpression` anchor that upstream's
function assigns to.

Why the standard library's :mod:`ast` (not libcst, patchy or a diff): the anchors are statements and
expressions, which ``ast`` compares structurally with no dependency; libcst keeps comments and layout
we do not need and is a compiled wheel on the start-up path of every patched process; patchy applies
a unified diff by running the ``patch`` program in a subprocess (not on a minimal server image, and a
process spawn at interpreter start), and a diff's context lines restate upstream's text, the
restating this module exists to avoid.
"""
from __future__ import annotations

import __future__ as _future
import ast
import functools
import inspect
import os
import re
import textwrap
import types
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional

from npu_shim.patch import TargetMismatch
from npu_shim.patches._shared.structure import foreign

__all__ = ["Edit", "Replace", "InsertBefore", "InsertAfter", "ReplaceExpression", "AddKeyword",
           "edit_function", "edited_source"]

_FUTURE_FLAGS = _future.annotations.compiler_flag
_FACTORY = "__npu_shim_edit__"


def _syntax(code: str, mode: str):
    try:
        return ast.parse(textwrap.dedent(code).strip(), mode=mode)
    except SyntaxError as exc:
        raise ValueError("edit text %r does not parse: %s" % (code, exc)) from None


_CONTEXTS = re.compile(r"(Load|Store|Del)\(\)")


def _key(node) -> str:
    """What two nodes share when they are the same code: the tree, without layout or context."""
    return _CONTEXTS.sub("", ast.dump(node, annotate_fields=False))


@dataclass(frozen=True)
class Edit:
    """One named change of a function: ``anchor`` (Python source of a statement, or an expression
    for :class:`ReplaceExpression`) must be found ``count`` times (each kind declares its text,
    then ``count``)."""

    anchor: str

    def __post_init__(self):
        if not isinstance(self.count, int) or self.count < 1:
            raise ValueError("%s: count must be a positive int, not %r" % (type(self).__name__, self.count))
        self._anchor_node()                  # a malformed anchor fails where the patch is declared

    def _anchor_node(self):
        statements = _syntax(self.anchor, "exec").body
        if len(statements) != 1:
            raise ValueError("%s anchor %r: give exactly one statement" % (type(self).__name__, self.anchor))
        return statements[0]

    def describe(self) -> str:
        return "%s(%r)" % (type(self).__name__, self.anchor)


def _new_statements(code: str, at) -> list:
    statements = _syntax(code, "exec").body if code.strip() else []
    for statement in statements:
        _place(statement, at)
    return statements


def _place(tree, at):
    for node in ast.walk(tree):
        if "lineno" in node._attributes:
            node.lineno, node.col_offset = at.lineno, at.col_offset
            node.end_lineno, node.end_col_offset = at.end_lineno, at.end_col_offset


@dataclass(frozen=True)
class Replace(Edit):
    """The statement(s) equal to ``anchor`` become ``by`` (statements; ``""`` deletes)."""

    by: str = ""
    count: int = 1

    def statements(self, found):
        return _new_statements(self.by, found)


@dataclass(frozen=True)
class InsertBefore(Edit):
    """``code`` (statements) runs just before each statement equal to ``anchor``."""

    code: str = ""
    count: int = 1

    def statements(self, found):
        return _new_statements(self.code, found) + [found]


@dataclass(frozen=True)
class InsertAfter(Edit):
    """``code`` (statements) runs just after each statement equal to ``anchor``."""

    code: str = ""
    count: int = 1

    def statements(self, found):
        return [found] + _new_statements(self.code, found)


@dataclass(frozen=True)
class ReplaceExpression(Edit):
    """Each expression equal to ``anchor`` (an expression, read, not assigned) becomes ``by``."""

    by: str = ""
    count: int = 1

    def _anchor_node(self):
        return _syntax(self.anchor, "eval").body

    def expression(self, found):
        replacement = _syntax(self.by, "eval").body
        _place(replacement, found)
        return replacement


@dataclass(frozen=True)
class AddKeyword(Edit):
    """Each call of ``anchor`` (the called expression: ``"Pool"``, ``"self.make"``) gets one more
    keyword argument, ``keyword=value`` (``value`` an expression, evaluated where upstream's call
    is). A call of ``anchor`` that passes ``keyword`` already is refused (TargetMismatch): the
    argument is upstream's there. Other uses of the name (passed as a value, say) are not calls
    and are left alone."""

    keyword: str = ""
    value: str = ""
    count: int = 1

    def __post_init__(self):
        super().__post_init__()
        if not self.keyword.isidentifier():
            raise ValueError("AddKeyword(%r): keyword must be a name, not %r" % (self.anchor, self.keyword))
        _syntax(self.value, "eval")

    def _anchor_node(self):
        return _syntax(self.anchor, "eval").body

    def keyword_node(self, call):
        value = _syntax(self.value, "eval").body
        _place(value, call)
        return ast.keyword(arg=self.keyword, value=value)

    def describe(self) -> str:
        return "AddKeyword(%r, %s=%s)" % (self.anchor, self.keyword, self.value)


class _Calls(ast.NodeTransformer):
    def __init__(self, edit: AddKeyword):
        self.edit, self.key, self.found = edit, _key(edit._anchor_node()), 0

    def visit_Call(self, node):
        self.generic_visit(node)
        if _key(node.func) == self.key:
            if any(keyword.arg == self.edit.keyword for keyword in node.keywords):
                raise TargetMismatch("a call of %s passes %s already" % (self.edit.anchor, self.edit.keyword))
            self.found += 1
            node.keywords.append(self.edit.keyword_node(node))
        return node


class _Statements(ast.NodeTransformer):
    """Applies one statement edit wherever its anchor stands in a statement list."""

    def __init__(self, edit: Edit):
        self.edit, self.key, self.found = edit, _key(edit._anchor_node()), 0

    def generic_visit(self, node):
        for field, value in ast.iter_fields(node):
            if isinstance(value, list) and value and all(isinstance(v, ast.stmt) for v in value):
                rebuilt = []
                for statement in value:
                    if _key(statement) == self.key:
                        self.found += 1
                        rebuilt.extend(self.edit.statements(statement))
                    else:
                        rebuilt.append(self.visit(statement))
                if not rebuilt:
                    rebuilt = [ast.copy_location(ast.Pass(), value[0])]
                setattr(node, field, rebuilt)
            elif isinstance(value, ast.AST):
                setattr(node, field, self.visit(value))
        return node


class _Expressions(ast.NodeTransformer):
    def __init__(self, edit: ReplaceExpression):
        self.edit, self.key, self.found = edit, _key(edit._anchor_node()), 0

    def visit(self, node):
        if isinstance(node, ast.expr) and _key(node) == self.key:
            if not isinstance(getattr(node, "ctx", ast.Load()), ast.Load):
                raise TargetMismatch("ReplaceExpression anchor %r is assigned to in the function (the edit "
                                     "was written for code that reads it)" % self.edit.anchor)
            self.found += 1
            return self.edit.expression(node)
        return super().visit(node)


def _function_node(function):
    """The function's definition parsed at upstream's lines, and its code object."""
    what = getattr(function, "__qualname__", repr(function))
    if not isinstance(function, types.FunctionType):
        raise TargetMismatch("%s is not a Python function (%s): nothing to edit" % (what, type(function).__name__))
    if hasattr(function, "__wrapped__"):
        raise TargetMismatch("%s is %s (__wrapped__): edit the function it wraps" % (what, foreign(function)))
    code = function.__code__
    home = function.__globals__.get("__file__")
    if home and not _same_file(code.co_filename, home):
        # another tool swapped the function's __code__ for code of its own: the edit was written for upstream's
        raise TargetMismatch("%s runs code compiled from %s, not from its module %s (%s): its __code__ was "
                             "replaced by another tool" % (what, code.co_filename, function.__module__, home))
    if code.co_name == "<lambda>":
        raise TargetMismatch("%s is a lambda: nothing to anchor an edit to" % what)
    try:
        lines, first = inspect.getsourcelines(function)
    except (OSError, TypeError) as exc:
        raise TargetMismatch("%s: no source to edit (%s)" % (what, exc)) from None
    source = "".join(lines)
    if source[:1].isspace():
        # an indented definition (a method): parsed as the body of a block, whatever the indentation
        # of the lines inside it (a docstring's continuation lines may stand left of the def)
        tree = ast.parse("if 1:\n" + source)
        ast.increment_lineno(tree, first - 2)
        body = tree.body[0].body
    else:
        tree = ast.parse(source)
        ast.increment_lineno(tree, first - 1)
        body = tree.body
    node = body[0] if body else None
    if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)) or node.name != code.co_name:
        raise TargetMismatch("%s: its source is not the definition of %s" % (what, code.co_name))
    # Defaults, annotations and decorators are taken from the original object, never re-evaluated.
    node.decorator_list = []
    node.returns = None
    arguments = node.args
    arguments.defaults = []
    arguments.kw_defaults = [None] * len(arguments.kwonlyargs)
    for argument in arguments.posonlyargs + arguments.args + arguments.kwonlyargs + \
            [a for a in (arguments.vararg, arguments.kwarg) if a is not None]:
        argument.annotation = None
    return node, code


def _same_file(a: str, b: str) -> bool:
    """``a`` and ``b`` name one source file (a module's ``__file__`` may be its ``.pyc``)."""
    return _source_path(a) == _source_path(b)


def _source_path(path: str) -> str:
    return os.path.realpath(path[:-1] if path.endswith(".pyc") else path)


def _compile(function, node, cell_names: Iterable[str]):
    """The code object of ``node`` compiled as upstream's, inside a factory whose parameters
    ``cell_names`` become its free variables."""
    code = function.__code__
    factory = ast.parse("def %s(%s):\n    return %s" % (_FACTORY, ", ".join(cell_names), node.name)).body[0]
    factory.body.insert(0, node)
    # upstream's module-level imports, compiled (never run) beside it: some CPython versions compile a call
    # on an imported module's attribute (``torch.cat(...)``) differently from one on another global
    module = ast.fix_missing_locations(ast.Module(body=_module_imports(function) + [factory], type_ignores=[]))
    compiled = compile(module, code.co_filename, "exec", flags=code.co_flags & _FUTURE_FLAGS, dont_inherit=True)
    outer = next(c for c in compiled.co_consts if isinstance(c, types.CodeType))
    inner = next(c for c in outer.co_consts if isinstance(c, types.CodeType) and c.co_name == node.name)
    renamed = {"co_name": code.co_name}
    if hasattr(code, "co_qualname"):
        renamed["co_qualname"] = code.co_qualname
    return inner.replace(**renamed)


def _module_imports(function) -> list:
    """The import statements at the top level of ``function``'s module (inside module-level
    ``if``/``try``/``with`` blocks too), as syntax."""
    import copy

    return copy.deepcopy(_imports_in(function.__code__.co_filename))


@functools.lru_cache(maxsize=64)
def _imports_in(filename: str) -> list:
    import linecache

    try:
        tree = ast.parse("".join(linecache.getlines(filename)) or open(filename, encoding="utf-8").read())
    except (OSError, SyntaxError, UnicodeDecodeError):
        tree = None
    found, pending = [], list(tree.body) if tree is not None else []
    while pending:
        statement = pending.pop(0)
        if isinstance(statement, (ast.Import, ast.ImportFrom)):
            found.append(statement)
        elif not isinstance(statement, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
            for field in ("body", "orelse", "finalbody", "handlers"):
                for child in getattr(statement, field, ()) or ():
                    pending.extend(child.body if isinstance(child, ast.ExceptHandler) else [child])
    return [statement for statement in found
            if not (isinstance(statement, ast.ImportFrom) and statement.module == "__future__")]


_CODE_FIELDS = ("co_code", "co_names", "co_varnames", "co_freevars", "co_argcount", "co_posonlyargcount",
                "co_kwonlyargcount")


def _same_code(a, b, qualnames=("", "")) -> bool:
    """The same code: bytecode, names and argument counts, and the constants, nested code objects
    (an inner function, a lambda, a comprehension) compared the same way. Bytecode alone names a
    constant by its index: ``x + 1`` and ``x + 2``, ``layout="TND"`` and ``"BSND"``, compile alike.
    ``qualnames``: (prefix in ``a``, prefix in ``b``) of a nested function's qualified name, which
    Python before 3.11 keeps as a string constant: ``a`` compiled inside the edit's factory names
    ``<factory>.<locals>.f.<locals>.g`` where ``b`` names ``Class.f.<locals>.g``."""
    return (all(getattr(a, field) == getattr(b, field) for field in _CODE_FIELDS)
            and len(a.co_consts) == len(b.co_consts)
            and all(_same_constant(x, y, qualnames) for x, y in zip(a.co_consts, b.co_consts)))


def _same_constant(a, b, qualnames) -> bool:
    # an int, the float of it and a bool are equal values, not one constant
    if type(a) is not type(b):
        return False
    if isinstance(a, types.CodeType):
        return _same_code(a, b, qualnames)
    if isinstance(a, tuple):
        return len(a) == len(b) and all(_same_constant(x, y, qualnames) for x, y in zip(a, b))
    if isinstance(a, str) and qualnames[0] and a.startswith(qualnames[0]):
        return qualnames[1] + a[len(qualnames[0]):] == b
    if isinstance(a, (float, complex)):         # a signed zero equals the unsigned one, and a NaN equals nothing
        return repr(a) == repr(b)
    if isinstance(a, frozenset):                # a constant set of `in {...}`: its members, typed
        return {(type(m), repr(m)) for m in a} == {(type(m), repr(m)) for m in b}
    return a == b


def _apply(node, edits, what):
    for edit in edits:
        if not isinstance(edit, Edit):
            raise TypeError("%s: edits must be Edit objects (Replace, InsertBefore, ...), not %r" % (what, edit))
        transformer = (_Expressions(edit) if isinstance(edit, ReplaceExpression)
                       else _Calls(edit) if isinstance(edit, AddKeyword) else _Statements(edit))
        node.body = transformer.visit(ast.Module(body=node.body, type_ignores=[])).body
        if transformer.found != edit.count:
            raise TargetMismatch("%s: anchor %r found %d time%s, expected %d"
                                 % (what, edit.anchor, transformer.found, "" if transformer.found == 1 else "s",
                                    edit.count))


def edit_function(function, edits, names: Optional[Mapping[str, object]] = None):
    """``function`` with ``edits`` applied (see the module docstring): a new function object;
    upstream's is left as it is. TargetMismatch names the anchor that is missing or found more
    often than its count, or why the function cannot be edited."""
    names = dict(names or {})
    node, code = _function_node(function)
    what = getattr(function, "__qualname__", code.co_name)
    used = set(code.co_names) | set(code.co_varnames) | set(code.co_freevars) | set(code.co_cellvars)
    clashing = sorted(set(names) & used)
    if clashing:
        raise TargetMismatch("%s: names %s are used by upstream's code (the edit was written for code "
                             "that does not use them)" % (what, ", ".join(clashing)))
    freevars = list(code.co_freevars)
    qualnames = ("%s.<locals>.%s." % (_FACTORY, code.co_name), function.__qualname__ + ".")
    if not _same_code(_compile(function, node, freevars), code, qualnames):
        raise TargetMismatch("%s: its source (%s:%d) does not compile to the code in use; the file "
                             "changed after import, or the source is not this function's"
                             % (what, code.co_filename, code.co_firstlineno))
    _apply(node, edits, what)
    try:
        edited = _compile(function, node, freevars + sorted(names))
    except SyntaxError as exc:
        raise TargetMismatch("%s: the edited function does not compile: %s (line %s)"
                             % (what, exc.msg, exc.lineno)) from None
    cells = dict(zip(code.co_freevars, function.__closure__ or ()))
    closure = tuple(cells[name] if name in cells else types.CellType(names[name]) for name in edited.co_freevars)
    result = types.FunctionType(edited, function.__globals__, code.co_name, function.__defaults__, closure)
    result.__kwdefaults__ = function.__kwdefaults__
    result.__annotations__ = function.__annotations__
    result.__dict__.update(function.__dict__)
    result.__qualname__, result.__module__ = function.__qualname__, function.__module__
    result.__doc__ = function.__doc__
    return result


def edited_source(function, edits) -> str:
    """The edited function's source as it is compiled (for review and docs): ``ast.unparse``."""
    node, code = _function_node(function)
    _apply(node, edits, getattr(function, "__qualname__", code.co_name))
    return ast.unparse(node)
