"""lanes/thin.py leaves out a wheel's extension modules that link a CUDA library and nothing
else: every other member byte for byte (an extension linking no CUDA library included), RECORD
without the removed files (and with the note), the note naming each file left out; a wheel with
nothing to leave out is refused; concurrent makers of one wheel never share a partial file."""
import base64
import hashlib
import importlib.util
import os
import struct
import threading
import zipfile

import pytest

pytestmark = pytest.mark.lanes("base")

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def thin_module():
    spec = importlib.util.spec_from_file_location("_npu_shim_lanes_thin", os.path.join(REPO, "lanes", "thin.py"))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _record_line(name, data):
    digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    return "%s,sha256=%s,%d" % (name, digest, len(data))


def make_wheel(path, files):
    record = [_record_line(name, data) for name, data in files.items()] + ["demo-1.0.dist-info/RECORD,,"]
    with zipfile.ZipFile(path, "w") as archive:
        for name, data in files.items():
            archive.writestr(name, data)
        archive.writestr("demo-1.0.dist-info/RECORD", "\n".join(record) + "\n")


def make_elf(*needed):
    """A minimal 64-bit little-endian ELF shared object whose dynamic section needs ``needed``:
    header, a PT_LOAD over the whole file (vaddr == offset), a PT_DYNAMIC, the string table."""
    strtab = b"\0"
    offsets = []
    for name in needed:
        offsets.append(len(strtab))
        strtab += name.encode() + b"\0"
    strtab += b"\0" * (-len(strtab) % 8)
    strtab_at = 64 + 2 * 56
    dynamic_at = strtab_at + len(strtab)
    dynamic = b"".join(struct.pack("<qQ", 1, offset) for offset in offsets)
    dynamic += struct.pack("<qQ", 5, strtab_at) + struct.pack("<qQ", 0, 0)
    size = dynamic_at + len(dynamic)
    header = b"\x7fELF" + bytes([2, 1, 1]) + b"\0" * 9
    header += struct.pack("<HHIQQQIHHHHHH", 3, 62, 1, 0, 64, 0, 0, 64, 56, 2, 64, 0, 0)
    program = struct.pack("<IIQQQQQQ", 1, 5, 0, 0, 0, size, size, 8)
    program += struct.pack("<IIQQQQQQ", 2, 6, dynamic_at, dynamic_at, dynamic_at, len(dynamic), len(dynamic), 8)
    return header + program + strtab + dynamic


FILES = {
    "demo/__init__.py": b"VERSION = '1.0'\n",
    "demo/_C.abi3.so": make_elf("libc10.so", "libcudart.so.12", "libc.so.6"),
    "demo/kernels/_fa2.cpython-311-x86_64-linux-gnu.so": make_elf("libtorch_cuda.so"),
    "demo/libs/libfoo.so.1": make_elf("libcuda.so.1"),
    "demo/_rust_tool_parser.abi3.so": make_elf("libgcc_s.so.1", "libc.so.6"),
    "demo/ops.py": b"def op():\n    return 1\n",
    "demo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
}
CUDA_LINKED = ["demo/_C.abi3.so", "demo/kernels/_fa2.cpython-311-x86_64-linux-gnu.so", "demo/libs/libfoo.so.1"]


def test_elf_needed_reads_the_dynamic_section(thin_module):
    assert thin_module.elf_needed(FILES["demo/_C.abi3.so"]) == ["libc10.so", "libcudart.so.12", "libc.so.6"]
    assert thin_module.elf_needed(b"not an ELF file") == []


def test_thin_wheel_leaves_out_cuda_linked_extension_modules_only(thin_module, tmp_path):
    original = tmp_path / "demo-1.0-cp311-cp311-linux_x86_64.whl"
    make_wheel(str(original), FILES)
    thinned = tmp_path / "out" / original.name
    thinned.parent.mkdir()

    size, count = thin_module.thin(str(original), str(thinned))

    left_out = CUDA_LINKED
    assert count == 3 and size == sum(len(FILES[name]) for name in left_out)
    with zipfile.ZipFile(thinned) as archive:
        names = set(archive.namelist())
        for name, data in FILES.items():
            if name in left_out:
                assert name not in names
            else:
                assert archive.read(name) == data
        note = archive.read("demo-1.0.dist-info/" + thin_module.NOTE).decode()
        record = archive.read("demo-1.0.dist-info/RECORD").decode().splitlines()
    for name in left_out:
        assert "%s %d" % (name, len(FILES[name])) in note
    assert hashlib.sha256(original.read_bytes()).hexdigest() in note
    recorded = {line.split(",", 1)[0] for line in record}
    assert recorded == (set(FILES) - set(left_out)) | {"demo-1.0.dist-info/RECORD",
                                                       "demo-1.0.dist-info/" + thin_module.NOTE}
    note_line = next(line for line in record if line.startswith("demo-1.0.dist-info/" + thin_module.NOTE))
    assert note_line == _record_line("demo-1.0.dist-info/" + thin_module.NOTE, note.encode())


def test_wheel_without_extension_modules_is_refused(thin_module, tmp_path):
    original = tmp_path / "pure-1.0-py3-none-any.whl"
    make_wheel(str(original), {name: data for name, data in FILES.items() if name not in CUDA_LINKED})
    with pytest.raises(SystemExit, match="no extension module links a CUDA library"):
        thin_module.thin(str(original), str(tmp_path / "thin.whl"))


def test_concurrent_makers_of_one_wheel_make_it_once(thin_module, tmp_path, monkeypatch):
    """Two lanes needing the same thin wheel at once: one makes it, the other waits and gets the
    same file (before, both wrote ``<wheel>.partial`` and one died in os.replace)."""
    monkeypatch.setenv("NPU_SHIM_THIN_CACHE", str(tmp_path / "cache"))
    original = tmp_path / "demo-1.0-cp311-cp311-linux_x86_64.whl"
    make_wheel(str(original), FILES)
    made = []

    def make(name, version):
        made.append(threading.current_thread().name)
        destination = os.path.join(thin_module.cache_dir(), original.name)
        thin_module.thin(str(original), destination)
        return destination

    monkeypatch.setattr(thin_module, "_make", make)
    results = []
    threads = [threading.Thread(target=lambda: results.append(thin_module.wheel("demo", "1.0"))) for _ in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len(made) == 1 and len(set(results)) == 1 and len(results) == 4
    assert [name for name in os.listdir(thin_module.cache_dir()) if name.endswith(".partial")] == []
    assert thin_module.RULE_KEY in results[0]
