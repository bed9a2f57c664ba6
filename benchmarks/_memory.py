"""Peak resident memory of a block of code (Linux), shared by the memory benchmarks."""
import contextlib
import ctypes


def _status_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError("no %s in /proc/self/status" % field)


class PeakRss:
    """Peak resident memory above the level at entry: VmHWM after ``clear_refs`` 5.

    ``extra`` (bytes) is set on exit. Freed heap is handed back first so the
    starting RSS is honest.
    """

    def __enter__(self):
        with contextlib.suppress(OSError):
            ctypes.CDLL("libc.so.6").malloc_trim(0)
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        self.start = _status_kib("VmRSS") * 1024
        return self

    def __exit__(self, *exc):
        self.extra = _status_kib("VmHWM") * 1024 - self.start
