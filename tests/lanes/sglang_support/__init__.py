"""Helpers for the sglang lane tests (the broken-window build, the rank workers, the strategy
and prefill inputs); the CP test case itself is npu_shim/testing/cp_case.py.

``broken_window.py`` and ``cp_gloo_worker.py`` also run as scripts in fresh
interpreters; there they import their siblings as top-level modules.
"""
