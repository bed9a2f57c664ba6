"""The set-up the sglang attention lane tests share: npu-shim installed over its emulation, then the
sglang modules under test imported, then sglang's global server args set for a CPU process.

The order is the one a worker has: ``torch_npu`` (here the emulation) before the shim, the shim's
import hook before the targets' first import (so they are imported patched), and the server args
that the backends read at call time in place before any test builds one.
"""
import importlib


def install(*targets):
    """The emulation and the shim installed, ``targets`` imported, sglang's server args set for CPU;
    returns the imported modules, in the order named. A target is a module name, or a callable that
    returns one: it is called once the shim is installed (a choice that itself imports sglang must
    not import it unpatched)."""
    import npu_shim
    from npu_shim import emulation
    from npu_shim.testing import cp_case

    emulation.install()             # the stand-in: torch_npu = npu-shim's emulation
    npu_shim.install()
    modules = tuple(importlib.import_module(target() if callable(target) else target) for target in targets)
    cp_case.set_cpu_server_args()
    return modules
