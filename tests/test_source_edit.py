"""npu_shim.patches._shared.source_edit: an edit of upstream's function, anchors counted, compiled at
upstream's lines, refusing what it cannot edit faithfully."""
import functools
import importlib.util
import linecache
import sys
import textwrap
import traceback

import pytest

from npu_shim.patch import TargetMismatch
from npu_shim.patches._shared.source_edit import (AddKeyword, InsertAfter, InsertBefore, Replace,
                                                  ReplaceExpression, edit_function, edited_source)

UPSTREAM = '''
from __future__ import annotations

import math

SCALE = 2


class Base:
    def describe(self, x):
        return "base %s" % x


class Tower(Base):
    """A stand-in for an upstream class."""

    def forward(self, lengths, scale: Undefined = SCALE, *, offset=[]):
        """Docstring lines
at column 0 must not break parsing."""
        total = sum(lengths)
        doubled = total * scale
        return doubled + len(offset)

    def describe(self, x):
        return "tower " + super().describe(x)

    def twice(self, x):
        x = x + 1
        x = x + 1
        return x

    def fails(self, x):
        y = x * 2
        raise ValueError(y)


def make_closures():
    late, own = [], []
    for k in range(3):
        def read():
            return k * 10
        late.append(read)
        own.append(_bound(k))
    return late, own


def _bound(k):
    def read():
        return k * 10
    return read


def counter():
    seen = 0
    def bump():
        nonlocal seen
        seen += 1
        return seen
    def peek():
        return seen
    return bump, peek


def _decorator(function):
    function.tagged = True
    return function


@_decorator
def tagged(x):
    return x + 1


@functools.wraps(tagged)
def wrapper(x):
    return tagged(x)


square = lambda x: x * x
'''


@pytest.fixture
def upstream(tmp_path):
    """A real module imported from a real file, as an upstream wheel's module is."""
    path = tmp_path / "fake_upstream.py"
    path.write_text(UPSTREAM.replace("@functools.wraps", "import functools\n@functools.wraps", 1))
    spec = importlib.util.spec_from_file_location("fake_upstream", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules["fake_upstream"] = module
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("fake_upstream", None)
    linecache.checkcache(str(path))


def test_an_inserted_statement_changes_only_what_it_names(upstream):
    forward = edit_function(upstream.Tower.forward, [InsertAfter("total = sum(lengths)", "total = total + 100")])
    tower = upstream.Tower()
    assert upstream.Tower.forward(tower, [1, 2]) == 6
    assert forward(tower, [1, 2]) == 206
    assert forward.__name__ == "forward" and forward.__qualname__ == "Tower.forward"
    # defaults, keyword defaults and annotations are the original objects, not re-evaluated
    assert forward.__defaults__ is upstream.Tower.forward.__defaults__
    assert forward.__kwdefaults__["offset"] is upstream.Tower.forward.__kwdefaults__["offset"]
    assert forward.__annotations__ == {"scale": "Undefined"}


def test_the_edit_runs_in_upstreams_live_globals(upstream):
    forward = edit_function(upstream.Tower.forward, [Replace("doubled = total * scale", "doubled = total * SCALE * 3")])
    assert forward(upstream.Tower(), [1]) == 6
    upstream.SCALE = 5          # a later rebinding in upstream's module is seen, as by upstream's own code
    assert forward(upstream.Tower(), [1]) == 15


def test_tracebacks_point_at_upstreams_file_and_lines(upstream):
    fails = edit_function(upstream.Tower.fails, [InsertBefore("raise ValueError(y)", "y = y + 1")])
    with pytest.raises(ValueError) as raised:
        fails(upstream.Tower(), 1)
    frame = traceback.extract_tb(raised.tb)[-1]
    assert frame.filename == upstream.__file__
    assert frame.line == "raise ValueError(y)"          # upstream's line, at upstream's number
    assert raised.value.args == (3,)


def test_a_missing_anchor_is_refused_naming_it(upstream):
    with pytest.raises(TargetMismatch, match=r"Tower.forward: anchor 'total = max\(lengths\)' found 0 times, expected 1"):
        edit_function(upstream.Tower.forward, [Replace("total = max(lengths)", "total = 0")])


def test_an_anchor_found_more_often_than_expected_is_refused(upstream):
    with pytest.raises(TargetMismatch, match=r"anchor 'x = x \+ 1' found 2 times, expected 1"):
        edit_function(upstream.Tower.twice, [Replace("x = x + 1", "x = x + 2")])
    twice = edit_function(upstream.Tower.twice, [Replace("x = x + 1", "x = x + 2", count=2)])
    assert twice(upstream.Tower(), 0) == 4


def test_anchors_compare_as_syntax_not_text(upstream):
    forward = edit_function(upstream.Tower.forward, [Replace("doubled = (total*scale)   # any layout",
                                                             "doubled = 0")])
    assert forward(upstream.Tower(), [1, 2]) == 0


def test_an_expression_is_replaced_where_it_is_read(upstream):
    forward = edit_function(upstream.Tower.forward, [ReplaceExpression("sum(lengths)", "math.fsum(lengths) * 2")])
    assert forward(upstream.Tower(), [1, 2]) == 12
    with pytest.raises(TargetMismatch, match="assigned to"):
        edit_function(upstream.Tower.forward, [ReplaceExpression("total", "other")])


def test_a_keyword_is_added_to_each_call_of_the_callee(upstream):
    forward = edit_function(upstream.Tower.forward, [AddKeyword("sum", keyword="start", value="100 * scale")])
    assert forward(upstream.Tower(), [1, 2]) == (3 + 200) * 2
    assert "sum(lengths, start=100 * scale)" in edited_source(upstream.Tower.forward,
                                                              [AddKeyword("sum", keyword="start", value="100 * scale")])
    # a call that passes the keyword already is upstream's: refused
    with pytest.raises(TargetMismatch, match="passes start already"):
        edit_function(upstream.Tower.forward, [AddKeyword("sum", keyword="start", value="1"),
                                               AddKeyword("sum", keyword="start", value="2")])
    # a name used as a value (``late.append(read)``) is not a call of it
    with pytest.raises(TargetMismatch, match="anchor 'read' found 0 times, expected 1"):
        edit_function(upstream.make_closures, [AddKeyword("read", keyword="x", value="1")])
    with pytest.raises(ValueError, match="keyword must be a name"):
        AddKeyword("sum", keyword="not a name", value="1")


def test_zero_argument_super_keeps_its_class(upstream):
    describe = edit_function(upstream.Tower.describe, [Replace('return "tower " + super().describe(x)',
                                                               'return "edited " + super().describe(x)')])
    assert describe(upstream.Tower(), 1) == "edited base 1"


def test_closures_share_upstreams_cells(upstream):
    bump, peek = upstream.counter()
    edited_peek = edit_function(peek, [Replace("return seen", "return seen * 100")])
    bump()
    bump()
    assert edited_peek() == 200                          # the very cell upstream's bump writes


def test_functions_made_in_a_loop_keep_their_own_cells(upstream):
    late, own = upstream.make_closures()
    edit = [Replace("return k * 10", "return k * 10 + 1")]
    # defined in the loop itself: one cell for all (upstream's late binding, kept); one per call: their own
    assert [f() for f in late] == [20, 20, 20]
    assert [edit_function(f, edit)() for f in late] == [21, 21, 21]
    assert [edit_function(f, edit)() for f in own] == [1, 11, 21]


def test_the_shims_values_come_as_cells_never_through_upstreams_globals(upstream):
    calls = []
    forward = edit_function(upstream.Tower.forward, [InsertBefore("total = sum(lengths)", "note(lengths)")],
                            names={"note": calls.append})
    forward(upstream.Tower(), [7])
    assert calls == [[7]] and not hasattr(upstream, "note")
    with pytest.raises(TargetMismatch, match="names sum are used by upstream's code"):
        edit_function(upstream.Tower.forward, [], names={"sum": max})


def test_an_edit_that_does_not_compile_is_refused_naming_why(upstream):
    bump, peek = upstream.counter()
    with pytest.raises(TargetMismatch, match="does not compile: no binding for nonlocal 'absent'"):
        # `seen` is a cell of counter(); peek closes over it, but a nonlocal of a new name is not there
        edit_function(peek, [InsertBefore("return seen", "nonlocal absent")])


def test_decorated_wrappers_and_lambdas_are_refused_and_tags_are_kept(upstream):
    with pytest.raises(TargetMismatch, match=r"tagged is a builtins.function compiled from .*fake_upstream.py "
                                             r"wrapping fake_upstream.tagged \(__wrapped__\)"):
        edit_function(upstream.wrapper, [])
    with pytest.raises(TargetMismatch, match="is a lambda"):
        edit_function(upstream.square, [])
    tagged = edit_function(upstream.tagged, [Replace("return x + 1", "return x + 2")])
    assert tagged(1) == 3 and tagged.tagged is True      # the decorator's attribute is kept
    with pytest.raises(TargetMismatch, match="not a Python function"):
        edit_function(len, [])


def test_source_that_is_not_the_running_code_is_refused(upstream, tmp_path):
    # the file changes after import: the source read is no longer the code in use
    path = tmp_path / "fake_upstream.py"
    path.write_text(UPSTREAM.replace("total = sum(lengths)", "total = sum(lengths) + 1"))
    linecache.checkcache(str(path))
    with pytest.raises(TargetMismatch, match="does not compile to the code in use"):
        edit_function(upstream.Tower.forward, [])


@pytest.mark.parametrize("function, running, stale", [
    ("Tower.forward", "doubled = total * scale", "doubled = total * scale * 1"),       # a constant added
    ("Tower.twice", "x = x + 1\n        x = x + 1", "x = x + 2\n        x = x + 2"),    # x + 1 vs x + 2
    ("Tower.describe", 'return "tower " + super()', 'return "TND " + super()'),        # one string for another
    ("Tower.fails", "y = x * 2", "y = x * 2.0"),                                      # equal, not the same
    ("make_closures", "late, own = [], []", "late, own = [], []\n    f = lambda: 1"),  # nested code added
    ("make_closures", "return k * 10\n        late", "return k * 11\n        late"),   # nested code's constant
])
def test_a_source_differing_only_in_a_constant_is_not_the_running_code(upstream, tmp_path, function, running, stale):
    """Bytecode names a constant by its index: a stale file with ``x + 2`` where the running code
    has ``x + 1`` compiles to the same instructions; the constants (nested code objects compared
    the same way) tell them apart."""
    assert UPSTREAM.count(running) == 1
    path = tmp_path / "fake_upstream.py"
    path.write_text(UPSTREAM.replace(running, stale))
    linecache.checkcache(str(path))
    target = upstream
    for part in function.split("."):
        target = getattr(target, part)
    with pytest.raises(TargetMismatch, match="does not compile to the code in use"):
        edit_function(target, [])


OTHER_TOOL = '''
def forward(self, lengths, scale=2, *, offset=[]):
    """Another plugin's stand-in (vllm-ascend-split-batch swaps such a method's __code__)."""
    total = sum(lengths)
    doubled = total * scale
    return doubled + len(offset)
'''


def test_a_function_whose_code_another_tool_swapped_is_refused_naming_it(upstream, tmp_path):
    """Another plugin replaces upstream's ``__code__`` with code compiled from its own file. The
    function object is upstream's, so a check by identity or name passes; the edit would be made
    to the other tool's code (or fail on an anchor for an unrelated reason)."""
    path = tmp_path / "other_tool.py"
    path.write_text(OTHER_TOOL)
    namespace = {}
    exec(compile(OTHER_TOOL, str(path), "exec"), namespace)
    upstream.Tower.forward.__code__ = namespace["forward"].__code__
    with pytest.raises(TargetMismatch, match=r"Tower.forward runs code compiled from .*other_tool.py, not from its "
                                             r"module fake_upstream .*replaced by another tool"):
        edit_function(upstream.Tower.forward, [Replace("doubled = total * scale", "doubled = 0")])


def test_a_wrapper_object_where_upstreams_function_stood_is_named(upstream):
    """A wrapt-style proxy (it answers ``__class__`` as the function's, so ``inspect.isfunction``
    takes it for one) stands where the class's own function was: refused, naming its type and what
    it wraps."""
    from npu_shim.patches._shared.structure import own_function

    class FunctionProxy:
        def __init__(self, wrapped):
            self.__wrapped__ = wrapped

        @property
        def __class__(self):
            return type(self.__wrapped__)

        def __call__(self, *args, **kwargs):
            return self.__wrapped__(*args, **kwargs)

    upstream.Tower.forward = FunctionProxy(upstream.Tower.forward)
    with pytest.raises(TargetMismatch, match=r"Tower.forward is a .*FunctionProxy wrapping fake_upstream.Tower.forward, "
                                             r"not upstream's function: another tool's wrapper"):
        own_function(upstream.Tower, "forward")
    del upstream.Tower.forward
    with pytest.raises(TargetMismatch, match="Tower.forward is not a function defined by the class"):
        own_function(upstream.Tower, "forward")


def test_upstreams_function_is_left_alone_and_the_edit_is_readable(upstream):
    original = upstream.Tower.forward
    edit_function(original, [Replace("doubled = total * scale", "doubled = 0")])
    assert upstream.Tower.forward is original and original(upstream.Tower(), [1, 2]) == 6
    source = edited_source(original, [Replace("doubled = total * scale", "doubled = 0")])
    assert "doubled = 0" in source and "total * scale" not in source
    assert textwrap.dedent(source).startswith("def forward(self, lengths, scale, *, offset):")
