"""Patch ``transformers.attn_check`` on the real transformers wheels.

Lanes kimi-vl-2025 (transformers 4.56.0 + vllm 0.10.1.1) and vllm-0.13
(4.57.6 + vllm 0.13.0): the patch is applied and accepts ``ascend_fa`` for vLLM's
``MoonVitPretrainedModel`` only; every other call gives exactly what
transformers' own method gives (compared call by call against the original
function the shim wrapped, on real model instances).

Lanes vllm-0.15 and latest: no shim-provided attention name can be requested
there (vLLM >= 0.14 has no ``VL_VISION_ATTENTION_FUNCTIONS``), so the patch is
skipped with that reason and transformers' method is untouched; the wrapper the
patch would build is still checked against that transformers' method shape
(5.x in the latest lane) and shown to be transparent.
"""
import os

import pytest

from npu_shim.patch import FamilyContext
from npu_shim.testing import moonvit as mv

pytestmark = [pytest.mark.claimed("transformers.attn_check"), pytest.mark.patch("transformers.attn_check")]
# the first lane past the window and the newest
outside = pytest.mark.claimed("transformers.attn_check", outside=("above", "newest"))

PATCH_NAME = "transformers.attn_check"
TRANSFORMERS_REJECTS = 'Specified `attn_implementation="ascend_fa"` is not supported'
NAMES = [None, "sdpa", "eager", "flash_attention_2", "flex_attention", "ascend_fa", "no_such_attention"]



@pytest.fixture(scope="module")
def stack():
    import npu_shim
    from npu_shim import emulation

    emulation.install()
    npu_shim.install()
    import transformers.modeling_utils as modeling_utils

    module = mv.moonvit_module()
    row = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)
    return modeling_utils, module, row


def tiny_llama(attn_implementation=None):
    from transformers import LlamaConfig, LlamaModel

    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=2)
    if attn_implementation is not None:
        config._attn_implementation = attn_implementation
    return LlamaModel(config)


def outcome(function, *args, **kwargs):
    """What a call returns or raises, comparable across two functions."""
    try:
        return ("returned", function(*args, **kwargs))
    except Exception as exc:  # the exception transformers raises is part of the behaviour
        return ("raised", type(exc).__name__, str(exc))


def original_method(modeling_utils):
    return modeling_utils.PreTrainedModel.get_correct_attn_implementation.__wrapped__


# --------------------------------------------------------------------------- applied lanes


def test_applied_and_wraps_transformers_method(stack):
    modeling_utils, _, row = stack
    assert row["state"] == "applied", row
    method = modeling_utils.PreTrainedModel.get_correct_attn_implementation
    assert method.__code__.co_filename.endswith(os.path.join("patches", "transformers", "attn_check.py"))
    assert original_method(modeling_utils).__code__.co_filename == modeling_utils.__file__


@pytest.mark.parametrize("is_init_check", [True, False])
@pytest.mark.parametrize("name", NAMES)
def test_other_models_get_exactly_transformers_answer(stack, name, is_init_check):
    modeling_utils, _, _ = stack
    model = tiny_llama()
    patched = outcome(model.get_correct_attn_implementation, name, is_init_check)
    original = outcome(original_method(modeling_utils), model, name, is_init_check)
    assert patched == original
    if name == "ascend_fa":
        assert patched[0] == "raised" and TRANSFORMERS_REJECTS in patched[2]


@pytest.mark.parametrize("name", NAMES)
def test_moonvit_gets_ascend_fa_and_transformers_answer_otherwise(stack, name):
    modeling_utils, module, _ = stack
    model = mv.build_tower(module, mv.TINY)
    patched = outcome(model.get_correct_attn_implementation, name, True)
    original = outcome(original_method(modeling_utils), model, name, True)
    if name == "ascend_fa":
        assert patched == ("returned", "ascend_fa")
        assert original[0] == "raised" and TRANSFORMERS_REJECTS in original[2]
    else:
        assert patched == original


def test_keyword_spelling(stack):
    _, module, _ = stack
    moonvit_model = mv.build_tower(module, mv.TINY)
    assert moonvit_model.get_correct_attn_implementation(requested_attention="ascend_fa") == "ascend_fa"
    with pytest.raises(ValueError, match="ascend_fa"):
        tiny_llama().get_correct_attn_implementation(requested_attention="ascend_fa")


def test_model_construction(stack):
    """Through PreTrainedModel.__init__, as vLLM builds the tower."""
    for name in ("sdpa", "eager"):
        assert tiny_llama(name).config._attn_implementation == name
    with pytest.raises(ValueError, match="is not supported"):
        tiny_llama("ascend_fa")
    _, module, _ = stack
    assert mv.build_tower(module, mv.TINY, attn_implementation="ascend_fa").config._attn_implementation == "ascend_fa"


def test_identified_by_class_not_by_name(stack):
    """A subclass of vLLM's MoonViT is accepted; an unrelated class that merely has the
    same name is not."""
    from transformers import PretrainedConfig, PreTrainedModel

    _, module, _ = stack

    class KimiVisionTower(module.MoonVitPretrainedModel):
        pass

    class MoonVitPretrainedModel(PreTrainedModel):  # same name, other module
        config_class = PretrainedConfig

    config = mv.make_config(module, mv.TINY, "ascend_fa")
    with mv.vllm_layer_context(module):
        tower = KimiVisionTower(config)
    assert tower.config._attn_implementation == "ascend_fa"
    impostor_config = PretrainedConfig()
    impostor_config._attn_implementation = "ascend_fa"
    with pytest.raises(ValueError, match="is not supported"):
        MoonVitPretrainedModel(impostor_config)


def test_accepted_only_while_the_moonvit_patch_dispatches_it(stack, monkeypatch):
    _, module, _ = stack
    monkeypatch.delitem(module.VL_VISION_ATTENTION_FUNCTIONS, "ascend_fa")
    with pytest.raises(ValueError, match="is not supported"):
        mv.build_tower(module, mv.TINY, attn_implementation="ascend_fa")


# --------------------------------------------------------------------------- lanes without the dict


@outside
def test_skipped_where_no_shim_attention_name_can_be_requested(stack):
    modeling_utils, module, row = stack
    assert not hasattr(module, "VL_VISION_ATTENTION_FUNCTIONS")
    assert row["state"] == "skipped", row
    assert row["reason"] == ("vllm %s is outside >=0.8.5,<0.14 (ascend_fa can be requested only where "
                             "vllm.moonvit_attn applies)" % row["versions"]["vllm"])
    method = modeling_utils.PreTrainedModel.get_correct_attn_implementation
    assert method.__code__.co_filename == modeling_utils.__file__


@outside
@pytest.mark.parametrize("name", NAMES)
def test_wrapper_fits_and_is_transparent_on_this_transformers(stack, name):
    """The method shape this transformers has passes the patch's check, and the wrapper
    it would install answers exactly like transformers (no MoonViT dispatches ascend_fa here)."""
    from npu_shim.patches.transformers import attn_check as patch_module

    modeling_utils, _, _ = stack
    context = FamilyContext(patch_module.PATCH.name)
    patch_module.check(modeling_utils, context)
    wrapper = patch_module.build(modeling_utils, context)["PreTrainedModel.get_correct_attn_implementation"]
    original = modeling_utils.PreTrainedModel.get_correct_attn_implementation
    model = tiny_llama()
    assert outcome(wrapper, model, name, True) == outcome(original, model, name, True)


@outside
def test_lane_versions(stack, lane_pins):
    _, _, row = stack
    assert row["versions"] == lane_pins("transformers", "vllm")
