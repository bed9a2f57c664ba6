"""Attributes set for the length of a block and put back after it, for test stand-ins."""
import contextlib

_MISSING = object()


@contextlib.contextmanager
def attributes_set():
    """Yields ``put(owner, name, value)``, which sets ``owner.name``; on leaving the block each
    attribute set is put back, the last first, or deleted where ``owner`` had none of its own."""
    saved = []

    def put(owner, name, value):
        saved.append((owner, name, vars(owner).get(name, _MISSING)))
        setattr(owner, name, value)

    try:
        yield put
    finally:
        for owner, name, value in reversed(saved):
            if value is _MISSING:
                delattr(owner, name)
            else:
                setattr(owner, name, value)
