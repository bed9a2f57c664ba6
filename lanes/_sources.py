"""The package sources pip is configured with on this machine, as ``uv pip install`` flags.

uv reads none of pip's configuration; the lanes (noxfile.py) and the sdist builds
(lanes/sdist.py) hand it these. Standard library only: runs under nox's Python.
"""
import functools
import os
import subprocess
import sys


def _pip_config(key):
    """pip's setting ``key`` (PIP_<KEY> first, then ``pip config get global.<key>``), as a list."""
    value = os.environ.get("PIP_" + key.upper().replace("-", "_"))
    if value is None:
        proc = subprocess.run([sys.executable, "-m", "pip", "config", "get", "global." + key],
                              capture_output=True, text=True)
        value = proc.stdout.strip() if proc.returncode == 0 else ""
    return value.split()


def _exists(location):
    """False for a local directory/file:// URL that is missing (pip ignores those; uv fails)."""
    if location.startswith("file://"):
        return os.path.exists(location[len("file://"):])
    if "://" not in location:
        return os.path.exists(location)
    return True


@functools.lru_cache(maxsize=None)
def uv_source_args():
    """``uv pip install`` flags for the package sources pip is configured with here. pip picks
    the best match over all its indexes; uv's default takes the first index that has the
    project at all, hence --index-strategy unsafe-best-match (pip's behaviour)."""
    args = ["--index-strategy", "unsafe-best-match"]
    for key, flag in (("index-url", "--index-url"), ("extra-index-url", "--extra-index-url"),
                      ("find-links", "--find-links")):
        for location in _pip_config(key):
            if _exists(location):
                args += [flag, location]
    return tuple(args)
