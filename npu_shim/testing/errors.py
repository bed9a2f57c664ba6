"""Where the tests' tolerances come from: each comparison against the float64 reference
can write the error it measured, so a tolerance is set from the worst one seen (at most
10x it) instead of guessed.

``RECORD_TOLERANCE_ERRORS=<file>`` appends one tab-separated line per check: comparison,
dtype, error, tolerance, the environment (the lane venv's name). ``python -m npu_shim.testing.errors
<file>...`` prints the worst error per comparison and dtype beside the tolerance in force.
"""
import os
import sys

ENV = "RECORD_TOLERANCE_ERRORS"   # not NPU_SHIM_*: a test-only switch, not a shim setting


def _dtype_name(dtype):
    return str(dtype).replace("torch.", "") if dtype is not None else "-"


def within(comparison, error, tolerance, dtype=None):
    """``error <= tolerance``, the figure recorded under ``RECORD_TOLERANCE_ERRORS``."""
    error = float(error)
    path = os.environ.get(ENV)
    if path:
        with open(path, "a") as f:
            f.write("%s\t%s\t%.3e\t%.3e\t%s\n" % (comparison, _dtype_name(dtype), error, tolerance,
                                                 os.path.basename(sys.prefix)))
    return error <= tolerance


class Tolerance(float):
    """A tolerance that records what it is compared with: ``err < TOL`` (or ``<=``) makes
    Python call ``TOL.__gt__(err)`` first (a float subclass on the right), which records
    ``err`` under ``comparison`` and compares as a float."""

    def __new__(cls, comparison, value, dtype=None):
        self = super().__new__(cls, value)
        self.comparison, self.dtype = comparison, dtype
        return self

    def __gt__(self, error):
        within(self.comparison, error, float(self), self.dtype)
        return float(self) > float(error)

    def __ge__(self, error):
        return within(self.comparison, error, float(self), self.dtype)


def worst(paths):
    """{(comparison, dtype): (worst error, tolerances seen, lanes)} from recorded files."""
    table = {}
    for path in paths:
        with open(path) as f:
            for line in f:
                comparison, dtype, error, tolerance, lane = line.rstrip("\n").split("\t")
                err, tols, lanes = table.get((comparison, dtype), (0.0, set(), set()))
                table[(comparison, dtype)] = (max(err, float(error)), tols | {float(tolerance)},
                                              lanes | {lane})
    return table


def main(argv=None):
    table = worst(argv if argv is not None else sys.argv[1:])
    for (comparison, dtype), (err, tols, lanes) in sorted(table.items()):
        print("%-55s %-9s worst %.2e  tol %s  ratio %.1f  (%d lanes)"
              % (comparison, dtype, err, "/".join("%.1e" % t for t in sorted(tols)),
                 min(tols) / err if err else float("inf"), len(lanes)))


if __name__ == "__main__":
    main()
