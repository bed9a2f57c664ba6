"""Run one benchmark and keep what it printed, headed by the date, the machine and the commit it ran on.

    python benchmarks/record.py NAME LANE [ARGS...]

runs ``benchmarks/bench_<NAME>.py ARGS`` with this interpreter (the lane's), prints its
output as it comes, and writes it to ``benchmarks/results/<NAME>-<LANE>.txt``. The
reference (``npu-shim reference``) shows these files as they are: figures come from
the last run, not from hand-typed history. Standard library only.
"""
import datetime
import os
import platform
import subprocess
import sys

HERE = os.path.dirname(os.path.abspath(__file__))


def machine():
    model = ""
    try:
        with open("/proc/cpuinfo") as handle:
            model = next((line.split(":", 1)[1].strip() for line in handle if line.startswith("model name")), "")
    except OSError:
        pass
    return "%s, %d cores (%s), Python %s" % (platform.system(), os.cpu_count() or 0, model or platform.machine(),
                                            platform.python_version())


def commit():
    """The checkout's commit, and whether its tracked files differed from it (figures from a
    tree nobody can check out again say so)."""
    def git(*words):
        proc = subprocess.run(["git", *words], cwd=HERE, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    head = git("rev-parse", "--short=12", "HEAD")
    if not head:
        return "no git commit"
    return head + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def main(argv):
    if len(argv) < 2:
        print(__doc__.strip(), file=sys.stderr)
        return 2
    name, lane, args = argv[0], argv[1], argv[2:]
    script = os.path.join(HERE, "bench_%s.py" % name)
    proc = subprocess.Popen([sys.executable, script] + args, stdout=subprocess.PIPE, text=True)
    lines = []
    for line in proc.stdout:
        sys.stdout.write(line)
        lines.append(line)
    status = proc.wait()
    if status != 0:
        print("record: bench_%s.py exited %d; nothing recorded" % (name, status), file=sys.stderr)
        return status
    header = "ran %s UTC on %s, lane %s, at %s: python benchmarks/bench_%s.py %s\n\n" % (
        datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"), machine(), lane, commit(), name,
        " ".join(args))
    os.makedirs(os.path.join(HERE, "results"), exist_ok=True)
    with open(os.path.join(HERE, "results", "%s-%s.txt" % (name, lane)), "w") as handle:
        handle.write(header + "".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
