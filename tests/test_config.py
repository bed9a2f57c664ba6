import pytest

from npu_shim._config import ConfigError, Settings, env_choice, env_flag


@pytest.mark.parametrize("word", ["1", "true", "TRUE", "Yes", "on", " On "])
def test_true_words(word):
    assert env_flag("NPU_SHIM_STRICT", False, {"NPU_SHIM_STRICT": word}) is True


@pytest.mark.parametrize("word", ["0", "false", "False", "NO", "off"])
def test_false_words(word):
    assert env_flag("NPU_SHIM_STRICT", True, {"NPU_SHIM_STRICT": word}) is False


def test_unset_or_blank_means_default():
    assert env_flag("NPU_SHIM", True, {}) is True
    assert env_flag("NPU_SHIM", True, {"NPU_SHIM": "  "}) is True


@pytest.mark.parametrize("word", ["2", "maybe", "enable", "y"])
def test_malformed_boolean_names_the_variable_and_the_values(word):
    with pytest.raises(ConfigError) as info:
        env_flag("NPU_SHIM_EMULATE", False, {"NPU_SHIM_EMULATE": word})
    message = str(info.value)
    assert "NPU_SHIM_EMULATE" in message and repr(word) in message
    for valid in ("1", "0", "true", "false", "yes", "no", "on", "off"):
        assert valid in message


def test_log_level_validated():
    assert Settings({"NPU_SHIM_LOG_LEVEL": "info"}).log_level == "INFO"
    with pytest.raises(ConfigError, match="NPU_SHIM_LOG_LEVEL.*DEBUG, INFO, WARNING"):
        Settings({"NPU_SHIM_LOG_LEVEL": "chatty"})


def test_choice_validated():
    assert env_choice("NPU_SHIM_MOONVIT_ATTN", ("auto", "sdpa"), "auto", {}) == "auto"
    with pytest.raises(ConfigError, match="NPU_SHIM_MOONVIT_ATTN='flash'.*auto, sdpa"):
        env_choice("NPU_SHIM_MOONVIT_ATTN", ("auto", "sdpa"), "auto", {"NPU_SHIM_MOONVIT_ATTN": "flash"})


def test_enable_disable_lists():
    s = Settings({"NPU_SHIM_ENABLE": "a, b,,", "NPU_SHIM_DISABLE": "b"})
    assert s.enable == ("a", "b") and s.disable == ("b",)
    assert s.disabled_reason("a") is None
    assert s.disabled_reason("b") == "listed in NPU_SHIM_DISABLE (and in NPU_SHIM_ENABLE: DISABLE wins)"
    assert s.disabled_reason("c") == "not listed in NPU_SHIM_ENABLE"
    assert Settings({"NPU_SHIM": "0"}).disabled_reason("a") == "NPU_SHIM=0"
    assert s.unknown_names({"a"}) == [("NPU_SHIM_ENABLE", "b"), ("NPU_SHIM_DISABLE", "b")]


def test_mm_encoder_fusion_attention_switch_validated_and_shown():
    assert Settings({}).mm_encoder_fusion_attention is False
    assert Settings({"NPU_SHIM_MM_ENCODER_FUSION_ATTENTION": "1"}).mm_encoder_fusion_attention is True
    with pytest.raises(ConfigError, match="NPU_SHIM_MM_ENCODER_FUSION_ATTENTION='fia' is not a boolean"):
        Settings({"NPU_SHIM_MM_ENCODER_FUSION_ATTENTION": "fia"})
    assert Settings({}).switches("vllm.mm_encoder_attn") == {
        "NPU_SHIM_MM_ENCODER_TND": False, "NPU_SHIM_MM_ENCODER_FUSION_ATTENTION": False}
    assert Settings({"NPU_SHIM_MM_ENCODER_FUSION_ATTENTION": "yes"}).switches("vllm.mm_encoder_attn")[
        "NPU_SHIM_MM_ENCODER_FUSION_ATTENTION"] is True
    assert Settings({}).switches("vllm.moonvit_attn") == {"NPU_SHIM_MOONVIT_ATTN": "auto"}
    assert Settings({}).switches("vllm.glm_ocr_host_lengths") == {}


def test_mimo_switches_validated_and_shown():
    assert Settings({}).mimo_pad_v is False
    assert Settings({"NPU_SHIM_VLLM_MIMO_PAD_V": "1"}).mimo_pad_v is True
    assert "vllm.mimo_v2_v_head_dim" in Settings({"NPU_SHIM_VLLM_MIMO_V_HEAD_DIM": "0"}).switched_off
    assert Settings({}).mimo_pad_sinks is False
    assert Settings({"NPU_SHIM_VLLM_MIMO_PAD_SINKS": "1"}).mimo_pad_sinks is True
    with pytest.raises(ConfigError, match="NPU_SHIM_VLLM_MIMO_PAD_SINKS='pad' is not a boolean"):
        Settings({"NPU_SHIM_VLLM_MIMO_PAD_SINKS": "pad"})
    assert Settings({"NPU_SHIM_VLLM_MIMO_PAD_SINKS": "on"}).switches("vllm.mimo_v2_v_head_dim") == {
        "NPU_SHIM_VLLM_MIMO_PAD_V": False, "NPU_SHIM_VLLM_MIMO_PAD_SINKS": True}


def test_mm_encoder_tnd_switch_validated():
    assert Settings({}).mm_encoder_tnd is False
    assert Settings({"NPU_SHIM_MM_ENCODER_TND": "1"}).mm_encoder_tnd is True
    with pytest.raises(ConfigError, match="NPU_SHIM_MM_ENCODER_TND='tnd' is not a boolean"):
        Settings({"NPU_SHIM_MM_ENCODER_TND": "tnd"})


def test_patch_switch_turns_its_patch_off_and_is_validated():
    from npu_shim._config import PATCH_SWITCHES

    name, var = "sglang.small_page_fia", "NPU_SHIM_SGLANG_SMALL_PAGE_FIA"
    assert PATCH_SWITCHES[name] == var
    assert Settings({}).disabled_reason(name) is None
    assert Settings({var: "on"}).disabled_reason(name) is None
    assert Settings({var: "0"}).disabled_reason(name) == var + "=0"
    assert Settings({var: "0"}).disabled_reason("sglang.cp_fia") is None
    with pytest.raises(ConfigError, match=var):
        Settings({var: "maybe"})
