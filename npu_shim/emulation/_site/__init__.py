"""Directory that npu_shim.emulation.install() appends to ``sys.path``.

It holds the emulated top-level ``torch_npu`` package. Never import it as
``npu_shim.emulation._site.torch_npu``: that would create a second copy.
"""
