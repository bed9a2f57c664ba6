"""A sglang build in the broken window, assembled from two real wheels.

Between sglang PR 23269 (``ContextParallelMetadata`` became per-sequence lists;
the scalar ``actual_seq_q_prev`` / ``kv_len_prev`` fields were removed) and PR
26705 (``AscendAttnBackend.do_cp_attn_fia`` updated to them) every build of
sglang's main branch had the new metadata and the old method: its CP prefill
raised AttributeError on the first call. No release has that shape
(0.5.12 has old + old, 0.5.13 new + new), so this module builds it honestly:

* the ascend_backend module of the *installed* sglang 0.5.13 (its real file),
* with the ``do_cp_attn_fia`` method of the class replaced, text for text, by
  the method as it is in the sglang **0.5.12** wheel, read at test time from that
  wheel's ``ascend_backend.py`` (whose sha256 is checked against the wheel's
  RECORD), located with ``ast`` (not pasted into this repository);
* compiled and executed under the real module name
  ``sglang.srt.hardware_backend.npu.attention.ascend_backend`` through a
  meta-path finder, so that npu-shim's import hook sees it exactly as it would
  see such a dev build, and the metadata it meets is 0.5.13's real one.

Run as a script (``python broken_window.py WHEEL``) it does that in a fresh
interpreter and prints one JSON object: the shim's status row, the error the
unpatched method raises, and the patched method's errors against the float64
reference for a few batches, and the rows of ``npu-shim selftest``'s runner.
"""
import ast
import base64
import hashlib
import importlib.abc
import importlib.util
import json
import os
import subprocess
import sys
import zipfile

TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
MEMBER = TARGET.replace(".", "/") + ".py"
LANES_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))), "lanes")


def old_version():
    """The release whose ``do_cp_attn_fia`` goes into the build: the newest sglang a lane pins
    below the installed one (the fix's release, 0.5.13, whose marker selects the lane), read
    from the pin files, not written here."""
    import re
    from importlib.metadata import version

    from packaging.version import Version

    installed = Version(version("sglang"))
    pins = set()
    for name in os.listdir(LANES_DIR):
        if name.endswith(".txt"):
            with open(os.path.join(LANES_DIR, name)) as pin_file:
                pins.update(re.findall(r"^sglang==(\S+)", pin_file.read(), re.M))
    older = [pin for pin in pins if Version(pin) < installed]
    if not older:
        raise RuntimeError("no lane pins an sglang below the installed %s" % installed)
    return max(older, key=Version)


WHEEL_ENV = "NPU_SHIM_TEST_SGLANG_0_5_12_WHEEL"


def find_or_fetch_old_wheel(cache_dir):
    """Path of the sglang 0.5.12 wheel: ``$NPU_SHIM_TEST_SGLANG_0_5_12_WHEEL``, a copy
    in ``cache_dir``, or one downloaded there with this interpreter's pip (no deps)."""
    path = os.environ.get(WHEEL_ENV)
    if path:
        if not os.path.isfile(path):
            raise FileNotFoundError("%s=%s does not exist" % (WHEEL_ENV, path))
        return path
    os.makedirs(cache_dir, exist_ok=True)
    old = old_version()
    for name in sorted(os.listdir(cache_dir)):
        if name.startswith("sglang-%s-" % old) and name.endswith(".whl"):
            return os.path.join(cache_dir, name)
    proc = subprocess.run(
        [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
         "sglang==%s" % old, "-d", cache_dir],
        capture_output=True, text=True, timeout=300)
    for name in sorted(os.listdir(cache_dir)):
        if name.startswith("sglang-%s-" % old) and name.endswith(".whl"):
            return os.path.join(cache_dir, name)
    raise RuntimeError("could not obtain the sglang %s wheel (set %s to its path):\n%s"
                       % (old, WHEEL_ENV, proc.stdout + proc.stderr))


def read_wheel_member(wheel_path, member=MEMBER):
    """The text of ``member`` in the wheel, verified against the wheel's RECORD."""
    with zipfile.ZipFile(wheel_path) as wheel:
        data = wheel.read(member)
        record_name = next(n for n in wheel.namelist() if n.endswith(".dist-info/RECORD"))
        record = wheel.read(record_name).decode()
    digest = "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
    entry = next((line for line in record.splitlines() if line.startswith(member + ",")), None)
    if entry is None or entry.split(",")[1] != digest:
        raise RuntimeError("%s in %s does not match the wheel's RECORD" % (member, wheel_path))
    return data.decode()


def method_span(source, class_name="AscendAttnBackend", method="do_cp_attn_fia"):
    """(first line, last line), 1-based inclusive, of ``class_name.method`` incl. decorators."""
    for node in ast.parse(source).body:
        if isinstance(node, ast.ClassDef) and node.name == class_name:
            for item in node.body:
                if isinstance(item, ast.FunctionDef) and item.name == method:
                    first = min([item.lineno] + [d.lineno for d in item.decorator_list])
                    return first, item.end_lineno
    raise LookupError("%s.%s not found" % (class_name, method))


def method_source(source):
    first, last = method_span(source)
    return "".join(source.splitlines(keepends=True)[first - 1:last])


def splice_method(new_module_source, old_method_source):
    """``new_module_source`` with its do_cp_attn_fia replaced by ``old_method_source``."""
    first, last = method_span(new_module_source)
    lines = new_module_source.splitlines(keepends=True)
    return "".join(lines[:first - 1]) + old_method_source + "".join(lines[last:])


class _SourceFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    """Serves one module name from a given source text (the spliced build)."""

    def __init__(self, name, source, origin):
        self.name, self.source, self.origin = name, source, origin

    def find_spec(self, fullname, path=None, target=None):
        if fullname != self.name:
            return None
        return importlib.util.spec_from_loader(fullname, self, origin=self.origin)

    def create_module(self, spec):
        return None

    def exec_module(self, module):
        module.__file__ = self.origin
        exec(compile(self.source, self.origin, "exec"), module.__dict__)


def install_broken_window(wheel_path):
    """Make ``import TARGET`` load the spliced module; returns (old method source, origin)."""
    if TARGET in sys.modules:
        raise RuntimeError("%s is already imported in this interpreter" % TARGET)
    spec = importlib.util.find_spec(TARGET)   # the installed 0.5.13 file
    with open(spec.origin) as handle:
        new_source = handle.read()
    old_method = method_source(read_wheel_member(wheel_path))
    origin = "%s [installed file, do_cp_attn_fia from sglang %s wheel]" % (spec.origin, old_version())
    sys.meta_path.insert(0, _SourceFinder(TARGET, splice_method(new_source, old_method), origin))
    return old_method, origin


def main(wheel_path):
    import torch

    _, origin = install_broken_window(wheel_path)
    import npu_shim

    npu_shim.install()
    module = importlib.import_module(TARGET)
    from npu_shim.testing import cp_case

    from npu_shim.patches.sglang import cp_fia as sglang_cp_fia

    row = next(r for r in npu_shim.status() if r["name"] == sglang_cp_fia.PATCH.name)
    result = {"state": row["state"], "reason": row["reason"], "origin": module.__file__}
    patched = module.AscendAttnBackend.__dict__["do_cp_attn_fia"]
    result["patched_is_shim"] = getattr(patched, "__npu_shim_patch__", None) == sglang_cp_fia.PATCH.name

    cp_case.set_cpu_server_args()
    specs = [
        cp_case.Spec(extend_lens=(45,), page_size=16, seed=1),
        cp_case.Spec(extend_lens=(33, 70, 21), page_size=16, num_heads=8, num_kv_heads=2, seed=2),
        cp_case.Spec(extend_lens=(19, 64, 8, 130, 27), page_size=128, num_heads=4, num_kv_heads=1,
                     qk_head_dim=192, v_head_dim=128, prefix_lens=(0, 7, 0, 20, 3), seed=3),
    ]
    cases = []
    for spec in specs:
        batch = cp_case.make_batch(spec)
        reference = batch.reference()
        errors = []
        for rank in range(spec.cp_size):
            out = cp_case.run_rank(module.AscendAttnBackend.do_cp_attn_fia, module, batch, rank)
            errors.append(cp_case.max_abs_err(out, cp_case.rank_expected(batch, reference, rank)))
        cases.append({"label": spec.label(), "max_abs_err": max(errors),
                      "tolerance": cp_case.tolerance(spec.dtype)})
    result["cases"] = cases

    # ``npu-shim selftest``'s runner, while the patch is applied.
    from npu_shim.selftest import run_all

    result["selftest"] = [{k: v for k, v in row.items() if k != "traceback"} for row in run_all()]

    # The bug itself: with the shim uninstalled, the spliced (old) method meets
    # the per-sequence metadata.
    npu_shim.uninstall()
    original = module.AscendAttnBackend.__dict__["do_cp_attn_fia"]
    result["restored_is_original"] = original is not patched and not hasattr(original, "__npu_shim_patch__")
    result["original_shape"] = sglang_cp_fia.method_shape(sglang_cp_fia.code_names(original))
    result["original_is_spliced"] = original.__code__.co_filename == origin
    batch = cp_case.make_batch(specs[0])
    try:
        cp_case.run_rank(original, module, batch, 0)
        result["unpatched_error"] = None
    except Exception as exc:  # the AttributeError the seed reports
        result["unpatched_error"] = "%s: %s" % (type(exc).__name__, exc)
    result["torch"] = torch.__version__
    print("BROKEN_WINDOW_RESULT " + json.dumps(result))


if __name__ == "__main__":
    main(sys.argv[1])
