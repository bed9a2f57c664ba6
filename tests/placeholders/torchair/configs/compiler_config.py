"""Import placeholder for ``torchair.configs.compiler_config``: a config that only holds attributes."""
import types


class CompilerConfig:
    def __init__(self):
        self.mode = None
        self.debug = types.SimpleNamespace(run_eagerly=False)
