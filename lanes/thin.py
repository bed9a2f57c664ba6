"""Thin wheels: an upstream wheel without its CUDA extension modules, for the lanes.

    python lanes/thin.py wheel vllm 0.14.1        # -> path of the cached thin wheel
    python lanes/thin.py check <wheel>            # what a thin wheel left out, and from what

Why: a vLLM wheel installs 1.2 GiB, 1.16 GiB of it compiled CUDA extensions (``vllm/_C.abi3.so``,
``_moe_C``, ``vllm_flash_attn/_vllm_fa2_C`` and ``_fa3_C``, ``cumem_allocator``). On the lanes'
machines none of them can load: ``import vllm._C`` raises ``ImportError: libcudart.so.12``
(there is no CUDA runtime, and the lanes' torch is the CPU build), and vLLM already treats that
ImportError as "no CUDA ops". Seventeen vLLM lanes held 20 GiB of these files. Without them
the same import raises ``ModuleNotFoundError`` (an ImportError) and vLLM takes the same path.

What a thin wheel is: the release's own wheel, every file byte for byte except the extension
modules (``*.so``, ``*.so.*``) under the wheel's packages, which are left out; METADATA, the
version and the entry points unchanged (the version fences read them); RECORD without the
removed files; and ``npu_shim_thinned.txt`` in the .dist-info naming the original wheel, its
sha256 and every file left out with its size, so a lane's venv says what it lacks.

Cache: ``$NPU_SHIM_THIN_CACHE``, default ``~/.cache/npu-shim/thin-wheels`` (outside the
checkout). The original wheel is fetched with ``pip download --no-deps --only-binary :all:``
(pip's own index configuration) into a temporary directory, thinned, and deleted: only the
thin wheel is kept (about 5 MB for vLLM). Standard library only (this runs under nox's Python).
"""
import argparse
import base64
import fnmatch
import glob
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile

LEFT_OUT = ("*.so", "*.so.*")
NOTE = "npu_shim_thinned.txt"


def cache_dir():
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "npu-shim",
                           "thin-wheels")
    return os.environ.get("NPU_SHIM_THIN_CACHE") or default


def _normalized(name):
    return name.lower().replace("-", "_").replace(".", "_")


def _cached(name, version):
    pattern = os.path.join(cache_dir(), "%s-%s-*.whl" % (_normalized(name), version))
    found = sorted(glob.glob(pattern))
    return found[0] if found else None


def _left_out(member):
    base = os.path.basename(member)
    return ".dist-info/" not in member and any(fnmatch.fnmatch(base, pattern) for pattern in LEFT_OUT)


def _sha256(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def thin(original, destination):
    """Write the thin copy of wheel ``original`` to ``destination`` (same file name)."""
    with zipfile.ZipFile(original) as source:
        members = source.infolist()
        records = [m.filename for m in members if m.filename.endswith(".dist-info/RECORD")]
        if len(records) != 1:
            raise SystemExit("%s: expected one .dist-info/RECORD, found %d" % (original, len(records)))
        record_name = records[0]
        dist_info = record_name[: -len("RECORD")]
        removed = [m for m in members if _left_out(m.filename)]
        if not removed:
            raise SystemExit("%s: no extension module to leave out; install the wheel itself" % original)
        removed_names = {m.filename for m in removed}
        note = "".join(
            ["npu-shim lanes: thin copy of %s (sha256 %s)\n" % (os.path.basename(original), _sha256(original)),
             "left out, compiled extensions that cannot load without CUDA (lanes/thin.py):\n"]
            + ["%s %d\n" % (m.filename, m.file_size) for m in removed]).encode()
        note_hash = base64.urlsafe_b64encode(hashlib.sha256(note).digest()).rstrip(b"=").decode()
        kept_records = []
        for line in source.read(record_name).decode().splitlines():
            if line and line.split(",", 1)[0] not in removed_names:
                kept_records.append(line)
        kept_records.append("%s%s,sha256=%s,%d" % (dist_info, NOTE, note_hash, len(note)))
        partial = destination + ".partial"
        with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as target:
            for member in members:
                if member.filename in removed_names or member.filename == record_name:
                    continue
                target.writestr(member, source.read(member))
            target.writestr(dist_info + NOTE, note)
            target.writestr(record_name, "\n".join(kept_records) + "\n")
    os.replace(partial, destination)
    return sum(m.file_size for m in removed), len(removed)


def wheel(name, version):
    """Path of the cached thin wheel of ``name==version``, made if missing."""
    cached = _cached(name, version)
    if cached:
        return cached
    os.makedirs(cache_dir(), exist_ok=True)
    with tempfile.TemporaryDirectory(prefix="npu-shim-thin-") as scratch:
        # --no-cache-dir: the thin wheel is what is kept; pip's cache would keep the 0.5 GB original too.
        subprocess.run([sys.executable, "-m", "pip", "download", "--quiet", "--disable-pip-version-check",
                        "--no-cache-dir", "--no-deps", "--only-binary", ":all:", "--dest", scratch, "%s==%s" % (name, version)],
                       check=True)
        originals = glob.glob(os.path.join(scratch, "*.whl"))
        if len(originals) != 1:
            raise SystemExit("pip download %s==%s gave %d wheels" % (name, version, len(originals)))
        destination = os.path.join(cache_dir(), os.path.basename(originals[0]))
        size, count = thin(originals[0], destination)
        print("thin.py: %s %s: left out %d extension modules, %.0f MiB" % (name, version, count, size / 2**20),
              file=sys.stderr)
    return destination


def check(path):
    with zipfile.ZipFile(path) as archive:
        notes = [n for n in archive.namelist() if n.endswith(".dist-info/" + NOTE)]
        if not notes:
            raise SystemExit("%s is not a thin wheel (no %s)" % (path, NOTE))
        print(archive.read(notes[0]).decode(), end="")


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    make = commands.add_parser("wheel", help="print the path of the thin wheel, made if missing")
    make.add_argument("name")
    make.add_argument("version")
    show = commands.add_parser("check", help="print what a thin wheel left out")
    show.add_argument("path")
    args = parser.parse_args(argv)
    if args.command == "wheel":
        print(wheel(args.name, args.version))
    else:
        check(args.path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
