"""Emulated ``torch_npu.profiler.dynamic_profile``: torch_npu's dynamic profiling, driven by the
msMonitor daemon (``init``, ``start``, ``step``). vllm-ascend's worker imports it at module top and
steps it only with ``msmonitor_use_daemon`` on. The emulation has no daemon to talk to: each call
refuses, naming it."""

__all__ = ["init", "start", "step"]


def _refuse(name):
    raise RuntimeError("torch_npu.profiler.dynamic_profile.%s: dynamic profiling (the msMonitor daemon) "
                       "is not emulated by npu-shim" % name)


def init(*args, **kwargs):
    _refuse("init")


def start(*args, **kwargs):
    _refuse("start")


def step(*args, **kwargs):
    _refuse("step")
