"""Run code in a fresh interpreter that sees the installed code of a distribution reported as
another release: a ``<dist>-<version>.dist-info`` made under ``tmp_path`` and put first on
``PYTHONPATH`` (the unread-release lane tests of sglang, vllm-ascend and transformers)."""
import os
import subprocess
import sys


def run_reported_as(dist, code, tmp_path, version=None, args=(), path=(), **env):
    """stdout of ``python -P -c code *args`` with ``NPU_SHIM_EMULATE=1``, the caller's other
    NPU_SHIM_* variables dropped and ``env`` added; ``dist`` reported as ``version`` (None: as
    installed). ``path``: entries after the dist-info's folder on PYTHONPATH (set whenever a
    version or a path is given, else inherited)."""
    environ = {k: v for k, v in os.environ.items() if not k.startswith("NPU_SHIM")}
    environ.update(env, NPU_SHIM_EMULATE="1")
    entries = list(path)
    if version:
        info = tmp_path / ("%s-%s.dist-info" % (dist.replace("-", "_"), version))
        info.mkdir(exist_ok=True)
        (info / "METADATA").write_text("Metadata-Version: 2.1\nName: %s\nVersion: %s\n" % (dist, version))
        entries.insert(0, str(tmp_path))
    if entries:
        environ["PYTHONPATH"] = os.pathsep.join(entries)
    proc = subprocess.run([sys.executable, "-P", "-c", code, *args], env=environ, cwd=str(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout
