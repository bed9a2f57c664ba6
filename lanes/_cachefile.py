"""Cache entries that concurrent lanes can share: one maker at a time, never a half-written file.

Lanes run in parallel (``nox`` starts one per core); two of them may need the same thin wheel or
the same sdist at the same moment. ``one_maker(path)`` holds an exclusive ``flock`` on
``path + ".lock"`` while the entry is looked up and, if missing, made; the second lane waits,
then finds the entry made. ``unique_partial(path)`` gives each writer its own temporary name in
the same directory, so even a writer outside the lock (a crashed run, another tool) never shares
a partial file with us, and ``os.replace`` publishes the whole file at once.

Standard library only: the lane scripts run under nox's Python.
"""
import contextlib
import fcntl
import os
import tempfile


@contextlib.contextmanager
def one_maker(path):
    """Exclusive lock for making cache entry ``path`` (blocks until held)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    with open(path + ".lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def unique_partial(path):
    """A fresh, empty file beside ``path`` for writing its content; the caller ``os.replace``s it
    onto ``path`` when complete (or removes it)."""
    handle, partial = tempfile.mkstemp(prefix=os.path.basename(path) + ".", suffix=".partial",
                                       dir=os.path.dirname(path))
    os.close(handle)
    return partial
