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
modules (``*.so``, ``*.so.*``) under the wheel's packages that link a CUDA library (their ELF
``DT_NEEDED`` entries name one of CUDA_LIBRARIES), which are left out; an extension that
links none (vLLM's ``_rust_tool_parser.abi3.so``) stays, since it loads anywhere. METADATA, the
version and the entry points unchanged (the version fences read them); RECORD without the
removed files; and ``npu_shim_thinned.txt`` in the .dist-info naming the original wheel, its
sha256 and every file left out with its size, so a lane's venv says what it lacks.

Cache: ``$NPU_SHIM_THIN_CACHE``, default ``~/.cache/npu-shim/thin-wheels`` (outside the
checkout), in a subdirectory named after the rule (RULE_KEY: a digest of the rule's source), so
a changed rule never serves a wheel the old rule made. The original wheel is fetched with
``pip download --no-deps --only-binary :all:`` (pip's own index configuration) into a temporary
directory, thinned, and deleted: only the thin wheel is kept (tens of MB zipped for vLLM).
Lanes run in parallel: one lane makes a given wheel while the others wait for it, and every
writer has its own partial file (``_cachefile.py``). Standard library only (this runs under
nox's Python).
"""
import argparse
import base64
import fnmatch
import glob
import hashlib
import inspect
import os
import re
import struct
import subprocess
import sys
import tempfile
import zipfile

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # _cachefile, also when loaded by path
from _cachefile import one_maker, unique_partial  # noqa: E402

EXTENSIONS = ("*.so", "*.so.*")
# Shared libraries that exist only with a CUDA toolkit and a CUDA build of torch; an extension
# module that needs one cannot load on the lanes' machines.
CUDA_LIBRARIES = re.compile(r"^lib(cuda|cudart|cublas|cublasLt|cufft|curand|cusolver|cusparse|cudnn\w*|nccl|nvrtc"
                            r"|nvToolsExt|nvJitLink|c10_cuda|torch_cuda)\.so(\.|$)")
NOTE = "npu_shim_thinned.txt"


def cache_dir():
    default = os.path.join(os.environ.get("XDG_CACHE_HOME") or os.path.expanduser("~/.cache"), "npu-shim",
                           "thin-wheels")
    return os.path.join(os.environ.get("NPU_SHIM_THIN_CACHE") or default, RULE_KEY)


def elf_needed(data):
    """The ``DT_NEEDED`` names of a 64-bit little-endian ELF shared object (bytes); [] if
    ``data`` is not one."""
    if data[:4] != b"\x7fELF" or data[4] != 2 or data[5] != 1:
        return []
    phoff, = struct.unpack_from("<Q", data, 0x20)
    phentsize, phnum = struct.unpack_from("<HH", data, 0x36)
    loads, dynamic = [], None
    for index in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz = struct.unpack_from("<IIQQQQ", data, phoff + index * phentsize)
        if p_type == 1:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == 2:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return []
    entries = [struct.unpack_from("<qQ", data, dynamic[0] + at) for at in range(0, dynamic[1], 16)]
    strtab = next((value for tag, value in entries if tag == 5), None)
    if strtab is None:
        return []
    base = next((offset + strtab - vaddr for vaddr, offset, size in loads if vaddr <= strtab < vaddr + size), None)
    if base is None:
        return []
    return [data[base + value:data.index(b"\0", base + value)].decode() for tag, value in entries if tag == 1]


def _normalized(name):
    return name.lower().replace("-", "_").replace(".", "_")


def _cached(name, version):
    pattern = os.path.join(cache_dir(), "%s-%s-*.whl" % (_normalized(name), version))
    found = sorted(glob.glob(pattern))
    return found[0] if found else None


def _left_out(member, read):
    """Whether wheel member ``member`` (``read()`` gives its bytes) is an extension module that
    links a CUDA library."""
    base = os.path.basename(member)
    if ".dist-info/" in member or not any(fnmatch.fnmatch(base, pattern) for pattern in EXTENSIONS):
        return False
    return any(CUDA_LIBRARIES.match(name) for name in elf_needed(read()))


# The cache key: the rule's own source (patterns and code), so changing it makes new wheels.
RULE_KEY = "rule-" + hashlib.sha256("".join(
    [repr(EXTENSIONS), CUDA_LIBRARIES.pattern, inspect.getsource(elf_needed), inspect.getsource(_left_out)]
).encode()).hexdigest()[:12]


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
        removed = [m for m in members if _left_out(m.filename, lambda m=m: source.read(m))]
        if not removed:
            raise SystemExit("%s: no extension module links a CUDA library; install the wheel itself" % original)
        removed_names = {m.filename for m in removed}
        note = "".join(
            ["npu-shim lanes: thin copy of %s (sha256 %s)\n" % (os.path.basename(original), _sha256(original)),
             "left out, compiled extensions that link a CUDA library (lanes/thin.py, %s):\n" % RULE_KEY]
            + ["%s %d\n" % (m.filename, m.file_size) for m in removed]).encode()
        note_hash = base64.urlsafe_b64encode(hashlib.sha256(note).digest()).rstrip(b"=").decode()
        kept_records = []
        for line in source.read(record_name).decode().splitlines():
            if line and line.split(",", 1)[0] not in removed_names:
                kept_records.append(line)
        kept_records.append("%s%s,sha256=%s,%d" % (dist_info, NOTE, note_hash, len(note)))
        partial = unique_partial(destination)
        try:
            with zipfile.ZipFile(partial, "w", compression=zipfile.ZIP_DEFLATED) as target:
                for member in members:
                    if member.filename in removed_names or member.filename == record_name:
                        continue
                    target.writestr(member, source.read(member))
                target.writestr(dist_info + NOTE, note)
                target.writestr(record_name, "\n".join(kept_records) + "\n")
        except BaseException:
            os.remove(partial)
            raise
    os.replace(partial, destination)
    return sum(m.file_size for m in removed), len(removed)


def wheel(name, version):
    """Path of the cached thin wheel of ``name==version``, made if missing."""
    cached = _cached(name, version)
    if cached:
        return cached
    with one_maker(os.path.join(cache_dir(), "%s-%s" % (_normalized(name), version))):
        return _cached(name, version) or _make(name, version)


def _make(name, version):
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
