"""The switch tests every patch has, in fresh interpreters: ``NPU_SHIM_DISABLE`` (the patch off
brings back what it removes) and ``NPU_SHIM_STRICT`` (a shape no family knows skips, or raises
in strict mode). Each child is ``python -P -c CODE`` with this process's environment, its own
``NPU_SHIM_DISABLE`` / ``NPU_SHIM_STRICT`` replaced by what the test asks for."""
import json
import os
import subprocess
import sys

__all__ = ["census_tower_disabled_and_applied", "child", "last_line", "assert_skipped_or_raised"]

SWITCHES = ("NPU_SHIM_DISABLE", "NPU_SHIM_STRICT")


def child(code, timeout=300, **env):
    """``code`` run in a fresh interpreter with ``env`` on top of this environment (switches
    cleared first): the ``CompletedProcess``."""
    environ = {k: v for k, v in os.environ.items() if k not in SWITCHES}
    environ.update(env)
    return subprocess.run([sys.executable, "-P", "-c", code], env=environ, capture_output=True, text=True,
                          timeout=timeout)


def last_line(proc):
    """The last line the child printed; it must have succeeded."""
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout.strip().splitlines()[-1]


def assert_skipped_or_raised(code, strict, token, reason, **env):
    """``code`` makes the patch meet a shape no family accepts, then prints JSON ``[state, reason,
    patched]`` of the patch. Strict (``strict == "1"``): the child fails with a ``PatchError``
    naming ``token``. Otherwise it runs, and the patch is skipped with ``reason`` in its reason and
    nothing replaced."""
    proc = child(code, NPU_SHIM_STRICT=strict, **env)
    if strict == "1":
        assert proc.returncode != 0, proc.stdout[-2000:]
        assert "PatchError" in proc.stderr and token in proc.stderr, proc.stderr[-2000:]
        return
    state, why, patched = json.loads(last_line(proc))
    assert state == "skipped" and reason in why and not patched, (state, why, patched)


CENSUS_TOWER_CODE = """
import torch, npu_shim
from npu_shim.testing import census
s = census.setup(); a = s.attention['A2']
t = census.build(s, {tower!r}, a)
g = census.grids(0, {tower!r}); x = census.pixel_values({tower!r}, t, g)
out, c = census.call({tower!r}, t, a, x, g)
print([r['state'] for r in npu_shim.status() if r['name'] == {patch!r}][0], c.count)
torch.save(out, {path!r})
"""


def census_tower_disabled_and_applied(tower, patch_name, directory):
    """One forward of census tower ``tower`` (A2) in a child with ``patch_name`` disabled and in
    one with it applied: ``{True: (line, output), False: (line, output)}``, the line being
    ``"<state> <reads>"``."""
    import torch

    runs = {}
    for disabled in (True, False):
        path = os.path.join(str(directory), "out_%d.pt" % disabled)
        env = {"NPU_SHIM_DISABLE": patch_name} if disabled else {}
        line = last_line(child(CENSUS_TOWER_CODE.format(tower=tower, patch=patch_name, path=path), **env))
        runs[disabled] = (line, torch.load(path))
    return runs
