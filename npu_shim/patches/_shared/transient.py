"""State the shim hangs on upstream's tensors and layers, which must never travel with them.

A pickled or deep-copied tensor or layer comes back without it (``None`` in its place),
and the shim rebuilds it from the object's own attributes on first use.
"""


class Transient:
    __slots__ = ()

    def __reduce__(self):
        return (_nothing, ())

    def __deepcopy__(self, memo):
        return None


def _nothing():
    return None
