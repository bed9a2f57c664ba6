"""Environment configuration.

Read at interpreter start, so this module imports nothing beyond ``os``.
Every malformed value raises :class:`ConfigError` naming the variable and the
values it accepts; a misspelt switch must never silently mean "default".
"""
import os

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")

# Patches that are on by default and have a switch of their own (boolean, default 1)
# besides NPU_SHIM_DISABLE: patch name -> variable.
PATCH_SWITCHES = {
    "sglang.small_page_fia": "NPU_SHIM_SGLANG_SMALL_PAGE_FIA",
}


class ConfigError(ValueError):
    """An ``NPU_SHIM*`` environment variable has a value the shim cannot use."""


def env_flag(name, default, environ=None):
    environ = os.environ if environ is None else environ
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    word = raw.strip().lower()
    if word in TRUE_WORDS:
        return True
    if word in FALSE_WORDS:
        return False
    raise ConfigError(
        "%s=%r is not a boolean; use one of %s (any case)"
        % (name, raw, ", ".join(TRUE_WORDS + FALSE_WORDS))
    )


def env_names(name, environ=None):
    """A comma-separated list of patch names; empty entries are ignored."""
    environ = os.environ if environ is None else environ
    raw = environ.get(name, "")
    return tuple(part.strip() for part in raw.split(",") if part.strip())


def env_choice(name, choices, default, environ=None):
    environ = os.environ if environ is None else environ
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    value = raw.strip().lower()
    if value not in choices:
        raise ConfigError(
            "%s=%r is not valid; use one of %s" % (name, raw, ", ".join(choices))
        )
    return value


def env_log_level(environ=None):
    environ = os.environ if environ is None else environ
    raw = environ.get("NPU_SHIM_LOG_LEVEL")
    if raw is None or raw.strip() == "":
        return None
    level = raw.strip().upper()
    if level not in LOG_LEVELS:
        raise ConfigError(
            "NPU_SHIM_LOG_LEVEL=%r is not a log level; use one of %s"
            % (raw, ", ".join(LOG_LEVELS))
        )
    return level


class Settings:
    """A snapshot of the ``NPU_SHIM*`` variables, validated."""

    __slots__ = ("enabled", "strict", "emulate", "enable", "disable", "log_level", "mm_encoder_tnd",
                 "switched_off")

    def __init__(self, environ=None):
        environ = os.environ if environ is None else environ
        self.enabled = env_flag("NPU_SHIM", True, environ)
        self.strict = env_flag("NPU_SHIM_STRICT", False, environ)
        self.emulate = env_flag("NPU_SHIM_EMULATE", False, environ)
        self.enable = env_names("NPU_SHIM_ENABLE", environ)
        self.disable = env_names("NPU_SHIM_DISABLE", environ)
        self.log_level = env_log_level(environ)
        # vllm.mm_encoder_attn on vllm-ascend 0.13-0.17: npu-shim's TND kernel instead of
        # upstream's _npu_flash_attention_unpad (default off: upstream's call is hardware-proven).
        self.mm_encoder_tnd = env_flag("NPU_SHIM_MM_ENCODER_TND", False, environ)
        self.switched_off = frozenset(
            name for name, var in PATCH_SWITCHES.items() if not env_flag(var, True, environ))

    def disabled_reason(self, patch_name):
        """Why the environment switches ``patch_name`` off, or None."""
        if not self.enabled:
            return "NPU_SHIM=0"
        if patch_name in self.disable:
            return "listed in NPU_SHIM_DISABLE"
        if self.enable and patch_name not in self.enable:
            return "not listed in NPU_SHIM_ENABLE"
        if patch_name in self.switched_off:
            return "%s=0" % PATCH_SWITCHES[patch_name]
        return None

    def unknown_names(self, known):
        """(variable, name) pairs naming patches that do not exist."""
        return [
            (var, name)
            for var, names in (("NPU_SHIM_ENABLE", self.enable), ("NPU_SHIM_DISABLE", self.disable))
            for name in names
            if name not in known
        ]
