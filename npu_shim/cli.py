"""``npu-shim`` command line (also ``python -m npu_shim``).

    npu-shim status [--json] [--import]   what each patch does in this environment
    npu-shim stats --processes [--dir D] [--json]
                                          every process's record of its applied patches and counters
                                          (NPU_SHIM_STATS_DIR, or --dir)
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


def _process_rows(records):
    import time

    rows = []
    for record in records:
        when = time.strftime("%Y-%m-%d %H:%M:%S", time.gmtime(record.get("written") or 0))
        process = "%s%s" % (record["pid"], " " + record["role"] if record.get("role") else "")
        patches = record["patches"] or {"-": None}
        for name, row in sorted(patches.items()):
            row = row or {}
            rows.append((process, "running" if record["alive"] else "ended", when + " UTC", name,
                         row.get("family") or "-")
                        + tuple(str(row.get(event, "-")) for event in _counters_events()))
    return rows


def _counters_events():
    from npu_shim.engine import counters

    return counters.EVENTS


def cmd_stats(args):
    if not args.processes:
        print("npu-shim stats: use --processes (every process's record in NPU_SHIM_STATS_DIR or --dir); "
              "a process's own counters are npu_shim.stats()", file=sys.stderr)
        return EXIT_USAGE
    directory = args.dir or _config.settings().stats_dir
    if not directory:
        print("npu-shim stats --processes: no directory: set NPU_SHIM_STATS_DIR (where the processes "
              "wrote their records) or pass --dir", file=sys.stderr)
        return EXIT_USAGE
    if not os.path.isdir(directory):
        print("npu-shim stats --processes: %s is not a directory (no process has written a record there)"
              % directory, file=sys.stderr)
        return 1
    from npu_shim.engine import counters

    records, problems = counters.read_records(directory)
    for line in problems:
        print("npu-shim stats: %s" % line, file=sys.stderr)
    if args.json:
        print(json.dumps(records, indent=2, sort_keys=True))
    elif not records:
        print("no process has written a record in %s" % directory)
    else:
        print(format_table(("process", "now", "written", "patch", "family") + counters.EVENTS,
                           _process_rows(records)))
    return 1 if problems else 0


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
    stats = sub.add_parser("stats", help="every process's record of its applied patches and counters "
                                          "(--processes; written where NPU_SHIM_STATS_DIR names)")
    stats.add_argument("--processes", action="store_true",
                       help="read every process's record (npu-shim-<pid>.json) in the directory")
    stats.add_argument("--dir", default=None, help="the directory (default: NPU_SHIM_STATS_DIR)")
    stats.add_argument("--json", action="store_true", help="print the records as JSON")
    stats.set_defaults(func=cmd_stats)
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
