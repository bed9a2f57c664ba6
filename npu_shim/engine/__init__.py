"""The engine: what the shim does once a watched framework starts importing.

    registry   the patches of this process, their post-import hooks, the decision
               (environment, version window, NPU, family, structure), apply and
               revert, status, stats, the exit summary
    guards     installed versions, PEP 440 windows and fences, choosing the family
    slots      attribute paths resolved and written all or none, reverted exactly
    counters   per-process counters the patched functions bump on their hot paths

Loaded only when needed (a watched framework imports, or the API/CLI asks),
because it pulls in wrapt, packaging, importlib.metadata and logging. Nothing
here imports the start-up side (``npu_shim._startup``) or the public API
(``npu_shim.api``): they hand the engine what it needs (``registry.load``).
"""
