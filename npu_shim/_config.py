"""Environment configuration, and this process's settings.

Read at interpreter start, so this module imports nothing beyond ``os``.
Every malformed value raises :class:`ConfigError` naming the variable and the
values it accepts; a misspelt switch must never silently mean "default".
:func:`settings` is the one way the shim reads them: the engine, the patches
and the start-up path all get the same validated snapshot.
"""
import os

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")
LOG_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")
MOONVIT_ATTN_CHOICES = ("auto", "ascend_fa", "sdpa")
# vllm.mm_encoder_attn, families 0.22.1rc1+: family 0.18.0's op call instead of FIA (named in errors)
MM_ENCODER_FUSION_SWITCH = "NPU_SHIM_MM_ENCODER_FUSION_ATTENTION"

# Patches that are on by default and have a switch of their own (boolean, default 1)
# besides NPU_SHIM_DISABLE: patch name -> variable.
PATCH_SWITCHES = {
    "sglang.small_page_fia": "NPU_SHIM_SGLANG_SMALL_PAGE_FIA",
    "sglang.vision_head_pad": "NPU_SHIM_SGLANG_VISION_HEAD_PAD",
    "sglang.npu_mrope_positions": "NPU_SHIM_SGLANG_NPU_MROPE_POSITIONS",
    "vllm.mimo_v2_v_head_dim": "NPU_SHIM_VLLM_MIMO_V_HEAD_DIM",
    "vllm.mimo_v2_flash_v_head_dim": "NPU_SHIM_VLLM_MIMO_V_HEAD_DIM",
}


# Every variable the shim reads, as data: (name, values, meaning, patch it belongs to or "").
# The reference (``npu-shim reference``) is generated from this table.
VARIABLES = (
    ("NPU_SHIM", "boolean, default 1", "0 turns everything off", ""),
    ("NPU_SHIM_ENABLE", "comma list of patch names", "only these patches may apply", ""),
    ("NPU_SHIM_DISABLE", "comma list of patch names", "these patches never apply (DISABLE wins over ENABLE)", ""),
    ("NPU_SHIM_STRICT", "boolean, default 0",
     "a patch that fails, or whose target does not have the expected shape inside its window, raises "
     "from the import of its target instead of logging a warning; so does a release newer than every "
     "release the accepting family was read in (npu_shim/releases_read.json), which is then not patched "
     "(without strict it gets the family its code has, and its status says the release was not read yet)",
     ""),
    ("NPU_SHIM_EMULATE", "boolean, default 0",
     "when the real torch_npu is not importable, `import torch_npu` resolves to the pure-PyTorch "
     "emulation (tests and development machines only)", ""),
    ("NPU_SHIM_LOG_LEVEL", ", ".join(LOG_LEVELS),
     "level of the npu_shim logger, with a stderr handler; INFO prints one line per applied patch", ""),
    ("NPU_SHIM_EXIT_SUMMARY", "boolean, default 0",
     "1: every process that applied a patch prints one line per applied patch at exit (pid, family, "
     "counters)", ""),
    ("NPU_SHIM_STATS_DIR", "a directory (made if missing), default unset",
     "every process that applies a patch keeps its record there, npu-shim-<pid>.json: pid, role (the "
     "name multiprocessing gave it, e.g. vLLM's EngineCore, VllmWorker-0), each applied patch's family "
     "and counters; written when a patch applies and as the counters change (at most 0.5 s behind), so "
     "a process killed at shutdown leaves its counts; `npu-shim stats --processes` reads them", ""),
    ("NPU_SHIM_FAMILY_BY_STRUCTURE", "boolean, default 1",
     "where the installed version of a family's distribution is a development or local build "
     "(PEP 440 .devN or +local), the family is chosen by the structure of the installed code alone: "
     "exactly one family's check may accept it, else the patch is skipped with every family's reason; "
     "0: the fences read that version as a release", ""),
    ("NPU_SHIM_MM_ENCODER_TND", "boolean, default 0",
     "family 0.13.0-0.17.0rc1: npu-shim's TND npu_fusion_attention (K/V not repeated) instead of "
     "upstream's _npu_flash_attention_unpad; off by default because upstream's call is the "
     "hardware-proven one", "vllm.mm_encoder_attn"),
    ("NPU_SHIM_MM_ENCODER_FUSION_ATTENTION", "boolean, default 0",
     "families 0.22.1rc1 and 0.23.0rc1+ (eager path): the op call of family 0.18.0 "
     "(torch_npu.npu_fusion_attention, TND, cumulative lengths for queries and keys) instead of "
     "upstream's npu_fused_infer_attention_score, for stacks where that call returns a uniform "
     "average (vllm-ascend #13699, open; not reproduced here); off by default because upstream's "
     "call is the one its release ships", "vllm.mm_encoder_attn"),
    ("NPU_SHIM_MOONVIT_ATTN", ", ".join(MOONVIT_ATTN_CHOICES),
     "MoonViT attention choice (auto: ascend_fa where NPU ops exist and the layer would use sdpa)",
     "vllm.moonvit_attn"),
    ("NPU_SHIM_SGLANG_SMALL_PAGE_FIA", "boolean, default 1",
     "0 turns the patch off (it shows as disabled); an explicit ASCEND_USE_FIA is respected either way",
     "sglang.small_page_fia"),
    ("NPU_SHIM_SGLANG_VISION_HEAD_PAD", "boolean, default 1",
     "0 turns the patch off (it shows as disabled): VisionAscendAttention then hands FIA's TND call the "
     "model's head dim as upstream does", "sglang.vision_head_pad"),
    ("NPU_SHIM_SGLANG_NPU_MROPE_POSITIONS", "boolean, default 1",
     "0 turns the patch off (it shows as disabled): MRotaryEmbedding.forward_npu hands 2-D (multimodal) positions "
     "to npu_mrope with mrope_section [0, 0, 0] as upstream does before 0.5.23", "sglang.npu_mrope_positions"),
    ("NPU_SHIM_VLLM_MIMO_V_HEAD_DIM", "boolean, default 1",
     "0 turns off vllm.mimo_v2_v_head_dim and vllm.mimo_v2_flash_v_head_dim: MiMo-V2-Flash takes upstream's "
     "DiffKV backend (which fails on Ascend at build or KV-cache initialisation)", "vllm.mimo_v2_v_head_dim"),
    ("NPU_SHIM_VLLM_MIMO_PAD_V", "boolean, default 0",
     "vllm.mimo_v2_v_head_dim and vllm.mimo_v2_flash_v_head_dim: 1 pads V to the key head dim (192) instead "
     "of the default separate 128-wide V cache: 1.2x the KV bytes of K 192 + V 128, and an FIA call the "
     "op's page does not document with GQA or paging (the default's call is documented)",
     "vllm.mimo_v2_v_head_dim"),
    ("NPU_SHIM_VLLM_MIMO_PAD_SINKS", "boolean, default 0",
     "with NPU_SHIM_VLLM_MIMO_PAD_V=1 (vllm.mimo_v2_v_head_dim, vllm.mimo_v2_flash_v_head_dim), and on vLLM "
     "0.15 - 0.19 (vllm.mimo_v2_flash_sinks_refuse, where the model pads V itself): 1 builds a layer with "
     "learnable sinks (MiMo-V2-Flash's sliding-window layers) with V padded to 192 anyway; otherwise such a "
     "layer is refused at build "
     "(NotImplementedError), because torch_npu's npu_fused_infer_attention_score_v2 page (op-plugin "
     "5e735e5) takes V_D 192 neither with GQA nor page attention, and learnable_sink only with V_D <= 128 "
     "(for a CANN that takes the call; unproven here)", "vllm.mimo_v2_v_head_dim"),
    ("NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE", "boolean, default 0",
     "vllm.ascend_attention_v_head_dim: 1 makes every sliding-window layer of vllm-ascend's "
     "AscendAttentionBackendImpl (eager FIA calls) pass pre_tokens = sliding_window - 1, the value that "
     "admits the model's W keys under the op page's band reading (pre_tokens=W admits W + 1); the layers "
     "with V != K the patch serves always do. Off by default: upstream's pre_tokens=sliding_window is the "
     "hardware-run call; turn it on where `npu-shim selftest` (the MiMo row's window probe) reports "
     "W + 1 keys for pre_tokens=W on the installed CANN", "vllm.ascend_attention_v_head_dim"),
    ("NPU_SHIM_EMULATE_SOC", "an Ascend SoC name, e.g. Ascend910B1, Ascend310P3",
     "the SoC the emulation reports (default an A2 part); Ascend310P* exercises the 310P paths; "
     "checked only where NPU_SHIM_EMULATE=1", ""),
    ("NPU_SHIM_EMULATE_CANN", "a CANN version as torch_npu reports it, e.g. 8.5.0, 8.3.RC1, 9.0.0",
     "the CANN release the emulation reports (torch_npu.npu.utils.get_cann_version()) and follows where "
     "the vendor's rules differ by release (default 8.5.0); checked only where NPU_SHIM_EMULATE=1", ""),
    ("NPU_SHIM_EMULATE_DEFECTS", "comma list of fia-tnd-uniform, fia-mask-512; default none",
     "the emulated ops behave as upstream's reports of silent op failures say, for the calls they name "
     "(fia-tnd-uniform: vllm-ascend #13699, FIA TND sparse_mode=0 without a mask returns the plain "
     "average of V; fia-mask-512: vllm-ascend #15503, FIA sparse_mode=0 with a bool [1,1,1,S] mask "
     "drops KV positions past 512), so that a check can be seen to catch them (npu-shim selftest "
     "fails); checked only where NPU_SHIM_EMULATE=1", ""),
    ("NPU_SHIM_EMULATE_MEMORY_MIB", "finite number > 0, default 256",
     "bound on the emulated ops' temporary memory per call (MiB); checked only where NPU_SHIM_EMULATE=1", ""),
    ("NPU_SHIM_EMULATE_DEVICE", "boolean, default 0",
     "with NPU_SHIM_EMULATE=1: importing the emulated torch_npu also makes `npu` a device of this process, "
     "backed by host memory (npu_shim.emulation.device: torch.npu.is_available() True, one device, streams, "
     "memory answers, hccl as one-rank gloo, every device->host transfer counted); without it torch.npu "
     "has no device; checked only where NPU_SHIM_EMULATE=1", ""),
    ("NPU_SHIM_EMULATE_DEVICE_MEMORY_MIB", "finite number > 0, default 65536",
     "memory of the emulated device (MiB): torch.npu.mem_get_info() and the out-of-memory bound; "
     "checked only where NPU_SHIM_EMULATE=1", ""),
)


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


def env_positive_number(name, default, environ=None):
    """A finite number > 0 (e.g. MiB); inf, nan, 0 and words are errors naming the variable."""
    environ = os.environ if environ is None else environ
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = None
    if value is None or not 0 < value < float("inf"):   # nan fails both comparisons
        raise ConfigError("%s=%r is not valid; use a finite number greater than 0" % (name, raw))
    return value


def env_directory(name, environ=None):
    """A directory path (None when unset or empty); a path that exists and is not a directory
    is an error naming the variable. The directory itself is made when first written."""
    environ = os.environ if environ is None else environ
    raw = environ.get(name)
    if raw is None or raw.strip() == "":
        return None
    path = os.path.abspath(os.path.expanduser(raw.strip()))
    if os.path.exists(path) and not os.path.isdir(path):
        raise ConfigError("%s=%r is not a directory (a file of that name exists); use a directory path"
                          % (name, raw))
    return path


def check_emulation(environ=None):
    """The NPU_SHIM_EMULATE_* variables; checked only where NPU_SHIM_EMULATE=1, so a
    typo in a test-only variable never switches the shim off on a production machine."""
    from npu_shim.emulation.soc import CANN_ENV, ENV, SOC_VERSIONS, parse_cann

    environ = os.environ if environ is None else environ
    soc = (environ.get(ENV) or "").strip()
    if soc and soc not in SOC_VERSIONS:
        raise ConfigError("%s=%r is not a known Ascend SoC; use one of %s"
                          % (ENV, environ[ENV], ", ".join(sorted(SOC_VERSIONS))))
    cann = (environ.get(CANN_ENV) or "").strip()
    if cann and parse_cann(cann) is None:
        raise ConfigError("%s=%r is not a CANN version; use the form torch_npu reports, e.g. 8.5.0, "
                          "8.3.RC1 or 9.0.0" % (CANN_ENV, environ[CANN_ENV]))
    env_positive_number("NPU_SHIM_EMULATE_MEMORY_MIB", None, environ)
    env_flag("NPU_SHIM_EMULATE_DEVICE", False, environ)
    env_positive_number("NPU_SHIM_EMULATE_DEVICE_MEMORY_MIB", None, environ)
    from npu_shim.emulation import defects

    try:
        defects.active(environ)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


class Settings:
    """A snapshot of the ``NPU_SHIM*`` variables, validated."""

    __slots__ = ("enabled", "strict", "emulate", "enable", "disable", "log_level", "mm_encoder_tnd",
                 "mm_encoder_fusion_attention", "switched_off", "moonvit_attn", "exit_summary",
                 "family_by_structure", "mimo_pad_v", "mimo_pad_sinks", "stats_dir",
                 "ascend_swa_window_edge")

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
        # vllm.mm_encoder_attn on vllm-ascend 0.22.1rc1+: 0.18.0's npu_fusion_attention call
        # instead of npu_fused_infer_attention_score (default off: vllm-ascend #13699 is open).
        self.mm_encoder_fusion_attention = env_flag("NPU_SHIM_MM_ENCODER_FUSION_ATTENTION", False, environ)
        self.switched_off = frozenset(
            name for name, var in PATCH_SWITCHES.items() if not env_flag(var, True, environ))
        # vllm.mimo_v2_v_head_dim: V padded to the key head dim instead of a separate V cache (default
        # off: the native call is the one the op's page documents), and, padded, a layer with sinks
        # built anyway (default off: the op's page does not take that call).
        self.mimo_pad_v = env_flag("NPU_SHIM_VLLM_MIMO_PAD_V", False, environ)
        self.mimo_pad_sinks = env_flag("NPU_SHIM_VLLM_MIMO_PAD_SINKS", False, environ)
        # vllm.ascend_attention_v_head_dim: every sliding-window layer of vllm-ascend's impl passes
        # pre_tokens = W - 1 (default off: upstream's pre_tokens = W is the hardware-run call).
        self.ascend_swa_window_edge = env_flag("NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE", False, environ)
        self.moonvit_attn = env_choice("NPU_SHIM_MOONVIT_ATTN", MOONVIT_ATTN_CHOICES, "auto", environ)
        self.exit_summary = env_flag("NPU_SHIM_EXIT_SUMMARY", False, environ)
        self.stats_dir = env_directory("NPU_SHIM_STATS_DIR", environ)
        self.family_by_structure = env_flag("NPU_SHIM_FAMILY_BY_STRUCTURE", True, environ)
        if self.emulate:
            check_emulation(environ)

    def disabled_reason(self, patch_name):
        """Why the environment switches ``patch_name`` off, or None."""
        if not self.enabled:
            return "NPU_SHIM=0"
        if patch_name in self.disable:
            if patch_name in self.enable:
                return "listed in NPU_SHIM_DISABLE (and in NPU_SHIM_ENABLE: DISABLE wins)"
            return "listed in NPU_SHIM_DISABLE"
        if self.enable and patch_name not in self.enable:
            return "not listed in NPU_SHIM_ENABLE"
        if patch_name in self.switched_off:
            return "%s=0" % PATCH_SWITCHES[patch_name]
        return None

    def switches(self, patch_name):
        """{variable: value in effect} for the variables of :data:`VARIABLES` that belong to
        ``patch_name`` and choose how it works (shown by ``npu-shim status``)."""
        values = {"NPU_SHIM_MM_ENCODER_TND": self.mm_encoder_tnd,
                  "NPU_SHIM_MM_ENCODER_FUSION_ATTENTION": self.mm_encoder_fusion_attention,
                  "NPU_SHIM_MOONVIT_ATTN": self.moonvit_attn,
                  "NPU_SHIM_VLLM_MIMO_PAD_V": self.mimo_pad_v,
                  "NPU_SHIM_VLLM_MIMO_PAD_SINKS": self.mimo_pad_sinks,
                  "NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE": self.ascend_swa_window_edge}
        return {name: values[name] for name, _, _, owner in VARIABLES if owner == patch_name and name in values}

    def unknown_names(self, known):
        """(variable, name) pairs naming patches that do not exist."""
        return [
            (var, name)
            for var, names in (("NPU_SHIM_ENABLE", self.enable), ("NPU_SHIM_DISABLE", self.disable))
            for name in names
            if name not in known
        ]

    def contradictions(self):
        """Patch names listed in both NPU_SHIM_ENABLE and NPU_SHIM_DISABLE."""
        return [name for name in self.enable if name in self.disable]

    def warnings(self):
        """Lines to report where the settings are read (start-up, status, run)."""
        both = self.contradictions()
        if not both:
            return []
        return ["NPU_SHIM_ENABLE and NPU_SHIM_DISABLE both name %s; DISABLE wins, %s stays off"
                % (", ".join(repr(n) for n in both), "it" if len(both) == 1 else "they")]


class _Process:
    """The settings of this process, shared by every reader."""
    settings = None               # a Settings, made on first use or by read_settings()
    booted_with_defaults = False  # the start-up hook saw no NPU_SHIM* variable


def settings():
    """The validated settings of this process: the one accessor.

    Made on first use from the environment, or, where the start-up hook saw no
    ``NPU_SHIM*`` variable, from none at all (the environment is then not read again,
    as if validated at start-up); :func:`read_settings` (``npu_shim.install()``)
    replaces them.
    """
    current = _Process.settings
    if current is None:
        current = _Process.settings = Settings({} if _Process.booted_with_defaults else None)
    return current


def read_settings(environ=None):
    """Validate the environment now and make it this process's settings.

    Raises :class:`ConfigError` and keeps the previous settings on a malformed value.
    """
    _Process.settings = Settings(environ)
    return _Process.settings


def use_settings(replacement):
    """Make ``replacement`` (a :class:`Settings`) this process's settings; returns the
    previous ones. For code that builds with another choice for a while, e.g. a
    selftest comparing MoonViT's ``sdpa`` with ``ascend_fa`` in one process."""
    previous = settings()
    _Process.settings = replacement
    return previous


def started_with_defaults():
    """The start-up hook installed the shim with no ``NPU_SHIM*`` variable set."""
    _Process.booted_with_defaults = True
