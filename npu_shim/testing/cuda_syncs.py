"""Count the synchronisations CUDA itself reports, to check :mod:`npu_shim.testing.syncs`
against a real device.

:func:`count_host_syncs` counts device->host reads on CPU, with stand-in "device" tensors.
On a CUDA machine, ``torch.cuda.set_sync_debug_mode("warn")`` makes torch report every
synchronising CUDA operation it issues (a scalar read, a device->host copy, a blocking
host->device copy, a stream or device synchronise, an op whose output shape depends on
device data) as a warning, "called a synchronizing CUDA operation", raised in the Python
frame that called the op. :func:`count_cuda_syncs` turns it on for a block and keeps one
:class:`CudaSync` per report, named by the same ``dir/file.py:line in function`` rule as the
CPU counter's events (the first frame outside torch, ``npu_shim/testing`` and the
emulation), so the two can be compared site by site.

The emulated torch_npu ops (:mod:`npu_shim.emulation`) stand in for device kernels: their
bodies are pure PyTorch, and a sync in there is the emulation's, not something a real NPU
kernel does. So by default the sync-debug mode is off inside every emulated op body
(``silence_ops=True``, through :func:`npu_shim.emulation._registry.set_body_hook`). Two things
the CPU counter does at the call stay visible:

* an argument torch_npu reads on the host (``npu_shim.emulation._registry.HOST_ARGS``) that
  is a CUDA tensor is read back before the body runs (``.tolist()``, outside the silenced
  region), so CUDA reports it at the op's caller: the CPU counter's ``host_arg`` event;
* with ``silence_ops=False`` the reports from inside op bodies are kept apart
  (``op_events``, each naming the op and the emulation's line), to see which emulated ops
  synchronise on CUDA by themselves.

What this does not see: implicit synchronisations that torch does not issue itself
(``cudaMalloc`` / ``cudaFree`` of the caching allocator, first-use initialisation): warm up
before counting. CUDA's syncs are not an NPU's either; what matches is the code that asks
for device data on the host.
"""
import contextlib
import os
import sys
import warnings
from collections import Counter
from typing import NamedTuple

import torch

from npu_shim.emulation._registry import host_arguments, set_body_hook
from npu_shim.testing import syncs as _syncs

__all__ = ["CudaSync", "CudaSyncCounter", "MESSAGE", "count_cuda_syncs", "site_of"]

MESSAGE = "called a synchronizing CUDA operation"

_SKIP_FILES = frozenset(_syncs._SKIP_FILES | {os.path.abspath(warnings.__file__)})


class CudaSync(NamedTuple):
    location: str      # "dir/file.py:line in function", as SyncEvent.location
    op: str = ""       # the emulated torch_npu op whose body or host argument made it
    host_arg: str = ""  # "<argument> of <op>": a host-only argument read back at the call

    def __str__(self):
        where = self.location
        if self.host_arg:
            return "host_arg (%s) at %s" % (self.host_arg, where)
        return "in %s at %s" % (self.op, where) if self.op else where


def site_of(frame, skip_dirs=_syncs._SKIP_DIRS, skip_files=_SKIP_FILES):
    """The ``dir/file.py:line in function`` of the first frame from ``frame`` outwards that is
    not in ``skip_dirs`` / ``skip_files`` (by default the CPU counter's rule: torch,
    ``npu_shim/testing``, the emulation, contextlib, and warnings)."""
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if not path.startswith(tuple(skip_dirs)) and path not in skip_files:
            short = os.path.join(os.path.basename(os.path.dirname(path)), os.path.basename(path))
            return "%s:%d in %s" % (short, frame.f_lineno, frame.f_code.co_name)
        frame = frame.f_back
    return "<unknown>"


class CudaSyncCounter:
    """``events``: the syncs CUDA reported outside emulated op bodies (host-argument reads
    included); ``op_events``: those inside op bodies (only with ``silence_ops=False``)."""

    def __init__(self, silence_ops=True):
        self.silence_ops = silence_ops
        self.events = []
        self.op_events = []
        self._ops = []           # emulated op bodies in progress (innermost last)
        self._host_arg = None    # "<argument> of <op>" while one is read back

    @property
    def count(self):
        return len(self.events)

    def sites(self):
        return Counter(str(e) for e in self.events)

    def op_sites(self):
        return Counter(str(e) for e in self.op_events)

    def summary(self):
        return "%d CUDA syncs%s" % (self.count, "; %d inside emulated ops" % len(self.op_events)
                                    if self.op_events else "")

    def __repr__(self):
        return "<CudaSyncCounter %s>" % self.summary()

    # -- what the hooks call -------------------------------------------------------------
    def _report(self, frame):
        if self._host_arg is not None:
            self.events.append(CudaSync(site_of(frame), self._ops[-1] if self._ops else "", self._host_arg))
        elif self._ops:
            # inside a body: the emulation's own line (skip torch and this module only)
            here = os.path.abspath(__file__)
            self.op_events.append(CudaSync(site_of(frame, skip_dirs=(_syncs._SKIP_DIRS[0],),
                                                   skip_files=_SKIP_FILES | {here}), self._ops[-1]))
        else:
            self.events.append(CudaSync(site_of(frame)))

    @contextlib.contextmanager
    def _body(self, name, args, kwargs):
        """Around one emulated op body: host-only arguments that are CUDA tensors are read back
        first (a real read, reported at the caller), then the body runs with the sync-debug
        mode off (``silence_ops``) or reported apart."""
        for arg, value in host_arguments(name, args, kwargs):
            for item in value if isinstance(value, (list, tuple)) else (value,):
                if isinstance(item, torch.Tensor) and item.is_cuda:
                    self._host_arg = "%s of %s" % (arg, name)
                    try:
                        item.tolist()
                    finally:
                        self._host_arg = None
        self._ops.append(name)
        previous = torch.cuda.get_sync_debug_mode()
        if self.silence_ops:
            torch.cuda.set_sync_debug_mode(0)
        try:
            yield
        finally:
            torch.cuda.set_sync_debug_mode(previous)
            self._ops.pop()


@contextlib.contextmanager
def count_cuda_syncs(silence_ops=True):
    """CUDA's own sync reports inside the block; yields a :class:`CudaSyncCounter`.

    Needs CUDA (``RuntimeError`` otherwise). ``silence_ops``: the emulated torch_npu op
    bodies run with the sync-debug mode off (they stand in for device kernels); False keeps
    their reports apart in ``op_events``. Other warnings pass through as usual.
    """
    if not torch.cuda.is_available():
        raise RuntimeError("count_cuda_syncs needs CUDA: torch.cuda.is_available() is False")
    counter = CudaSyncCounter(silence_ops)
    with warnings.catch_warnings():
        warnings.filterwarnings("always", message=".*" + MESSAGE)
        shown = warnings.showwarning

        def show(message, category, filename, lineno, file=None, line=None):
            if MESSAGE in str(message):
                counter._report(sys._getframe(1))
            else:
                shown(message, category, filename, lineno, file, line)

        warnings.showwarning = show
        previous_hook = set_body_hook(counter._body)
        previous_mode = torch.cuda.get_sync_debug_mode()
        torch.cuda.set_sync_debug_mode("warn")
        try:
            yield counter
        finally:
            torch.cuda.set_sync_debug_mode(previous_mode)
            set_body_hook(previous_hook)
