"""Helpers for the sglang.cp_fia lane tests (cases, the broken-window build, the gloo worker).

``broken_window.py`` and ``cp_gloo_worker.py`` also run as scripts in fresh
interpreters; there they import their siblings as top-level modules.
"""
