"""lanes/thin.py leaves out a wheel's extension modules and nothing else: every other member
byte for byte, RECORD without the removed files (and with the note), the note naming each
file left out; a wheel with nothing to leave out is refused."""
import base64
import hashlib
import importlib.util
import os
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


FILES = {
    "demo/__init__.py": b"VERSION = '1.0'\n",
    "demo/_C.abi3.so": b"\x7fELF" + b"\0" * 64,
    "demo/kernels/_fa2.cpython-311-x86_64-linux-gnu.so": b"\x7fELF" + b"\1" * 32,
    "demo/libs/libfoo.so.1": b"\x7fELF" + b"\2" * 16,
    "demo/ops.py": b"def op():\n    return 1\n",
    "demo-1.0.dist-info/METADATA": b"Metadata-Version: 2.1\nName: demo\nVersion: 1.0\n",
}


def test_thin_wheel_leaves_out_extension_modules_only(thin_module, tmp_path):
    original = tmp_path / "demo-1.0-cp311-cp311-linux_x86_64.whl"
    make_wheel(str(original), FILES)
    thinned = tmp_path / "out" / original.name
    thinned.parent.mkdir()

    size, count = thin_module.thin(str(original), str(thinned))

    left_out = [name for name in FILES if ".so" in name]
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
    make_wheel(str(original), {name: data for name, data in FILES.items() if ".so" not in name})
    with pytest.raises(SystemExit, match="no extension module to leave out"):
        thin_module.thin(str(original), str(tmp_path / "thin.whl"))
