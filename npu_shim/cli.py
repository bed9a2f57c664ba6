"""``npu-shim`` command line (also ``python -m npu_shim``).

    npu-shim status [--json] [--import]   what each patch does in this environment
    npu-shim run -- CMD [ARGS...]         run CMD with the shim installed at start-up
    npu-shim selftest [--json]            check every applicable patched path against float64
    npu-shim reference [--check]          write (or check) docs/reference.md, docs/lanes.md, docs/benchmarks.md
    npu-shim evidence [--record] [DIR...] the releases the lanes' and probes' reports found each family
                                          applied on; --record adds them to npu_shim/releases_read.json
"""
import argparse
import contextlib
import json
import os
import sys

from npu_shim import _config, _startup
from npu_shim._table import format_table

EXIT_USAGE = 2
EXIT_NOT_FOUND = 127
EXIT_BROKEN_PIPE = 141  # 128 + SIGPIPE, what a shell reports for a writer cut off by `head`


def _status_table(rows):
    return format_table(
        ("patch", "state", "family", "reason", "versions"),
        [
            (
                row["name"],
                row["state"],
                row.get("family") or "-",
                row["reason"] + "".join("; %s=%s" % (name, int(value) if isinstance(value, bool) else value)
                                        for name, value in (row.get("switches") or {}).items())
                + "".join("; " + text for text in row.get("notes") or ()),
                ", ".join("%s %s" % (d, v or "-") for d, v in row["versions"].items()) or "-",
            )
            for row in rows
        ],
    )


def cmd_status(args):
    engine = _startup.engine()
    # Frameworks log to stdout while they import (vLLM does): keep stdout for our output.
    with contextlib.redirect_stdout(sys.stderr):
        rows = engine.status(import_targets=args.import_targets)
    if args.json:
        print(json.dumps(rows, indent=2, sort_keys=True))
    else:
        print(_status_table(rows))
    return 0


def cmd_run(argv):
    # A malformed variable stops here, before anything is launched (exit 2 from main).
    _config.Settings()
    if argv[:1] == ["--"]:
        argv = argv[1:]
    if not argv:
        print("npu-shim run: missing command; usage: npu-shim run -- CMD [ARGS...]", file=sys.stderr)
        return EXIT_USAGE
    entries = _startup._pythonpath_entries()
    if _startup.BOOTSTRAP_DIR not in entries:
        entries.insert(0, _startup.BOOTSTRAP_DIR)
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(entries))
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(argv[0], argv, env)
    except FileNotFoundError:
        print("npu-shim run: command not found: %s" % argv[0], file=sys.stderr)
        return EXIT_NOT_FOUND
    except PermissionError as exc:
        print("npu-shim run: cannot execute %s: %s" % (argv[0], exc), file=sys.stderr)
        return 126


def cmd_selftest(args):
    from npu_shim import selftest

    return selftest.main(as_json=args.json)


def cmd_reference(args):
    from npu_shim import reference

    return reference.main(args)


def cmd_evidence(args):
    from npu_shim import evidence

    return evidence.main(args)


def build_parser():
    parser = argparse.ArgumentParser(prog="npu-shim", description="Ascend NPU attention backports for pinned stacks.")
    sub = parser.add_subparsers(dest="command", required=True)
    status = sub.add_parser("status", help="show what each patch does in this environment")
    status.add_argument("--json", action="store_true", help="print the status list as JSON")
    status.add_argument(
        "--import",
        dest="import_targets",
        action="store_true",
        help="import each installed target module first, so structural checks run and patches apply",
    )
    status.set_defaults(func=cmd_status)
    selftest = sub.add_parser("selftest", help="run every applicable patched path against a float64 reference")
    selftest.add_argument("--json", action="store_true", help="print the results as JSON")
    selftest.set_defaults(func=cmd_selftest)
    reference = sub.add_parser("reference", help="write docs/reference.md from the declarations and "
                                                 "docs/lanes.md from the last recorded CI run "
                                                 "(--check: exit 1 with a diff when one differs)")
    reference.add_argument("--check", action="store_true", help="compare instead of writing")
    reference.add_argument("--root", default=os.curdir, help="the checkout (default: the current directory)")
    reference.add_argument("--output", default=os.path.join("docs", "reference.md"),
                           help="path of the reference inside the checkout")
    reference.set_defaults(func=cmd_reference)
    record = sub.add_parser("evidence", help="the releases each family was found applied on in the lanes' and "
                                             "probes' reports (--record: add them to npu_shim/releases_read.json)")
    record.add_argument("--record", action="store_true", help="write npu_shim/releases_read.json under --root")
    record.add_argument("--root", default=os.curdir, help="the checkout (default: the current directory)")
    record.add_argument("reports", nargs="*", help="report folders to read evidence.json from "
                                                   "(default: .nox/reports and .nox/probe-reports under --root)")
    record.set_defaults(func=cmd_evidence)
    sub.add_parser("run", help="run a command with the shim installed at start-up (npu-shim run -- CMD ...)")
    return parser


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    try:
        if argv[:1] == ["run"]:
            return cmd_run(argv[1:])
        args = build_parser().parse_args(argv)
        return args.func(args)
    except _config.ConfigError as exc:
        print("npu-shim: %s" % exc, file=sys.stderr)
        return EXIT_USAGE
    except BrokenPipeError:
        # The reader went away (e.g. `npu-shim status | head`): not an error of ours.
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return EXIT_BROKEN_PIPE
