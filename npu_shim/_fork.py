"""What a fork must do in this process, declared in one place.

Locks a thread of the parent may hold when another thread forks are taken before
the fork and released after it on both sides, so that a child never inherits one
held by a thread it does not have (logging does the same for its own locks); state
that belongs to one process is reset in the child. Standard library only: loaded
on the start-up path by ``npu_shim._startup``, and by the engine and the counters.

The interpreter runs ``before`` hooks newest registration first, and the shim logs
while it holds its lock: its locks must be taken before logging's, so the hooks are
registered again once the engine has loaded logging (:func:`register_with_interpreter`),
and only the newest registration acts.
"""
import os

_held = []            # taken in this order before a fork, released in reverse after it
_child_resets = []    # called in the child once the locks are released, in this order
_newest = 0           # the registration with the interpreter that acts
_taken = None         # (registration, locks) from a fork's `before` to its `after`


def hold_across_fork(lock):
    """Take ``lock`` before every fork, release it after, in parent and child.

    Register locks in the order the shim nests them (outer first), so that the
    fork takes them as every other thread does and cannot deadlock against one.
    """
    _held.append(lock)


def reset_in_child(function):
    """Call ``function()`` in every forked child (per-process state starts afresh)."""
    _child_resets.append(function)


def register_with_interpreter():
    """Register the hooks with the interpreter, after every hook registered so far
    (so that the shim's locks are taken first); older registrations stand aside."""
    global _newest
    _newest += 1
    number = _newest
    os.register_at_fork(before=lambda: _before(number),
                        after_in_parent=lambda: _after(number, in_child=False),
                        after_in_child=lambda: _after(number, in_child=True))


def _before(number):
    global _taken
    if number != _newest:
        return
    locks = list(_held)
    for lock in locks:
        lock.acquire()
    _taken = (number, locks)


def _after(number, in_child):
    global _taken
    if _taken is None or _taken[0] != number:
        return
    locks, _taken = _taken[1], None
    for lock in reversed(locks):
        lock.release()
    if in_child:
        for function in _child_resets:
            function()


register_with_interpreter()
