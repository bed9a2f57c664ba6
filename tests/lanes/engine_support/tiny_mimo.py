"""A tiny random-weight MiMo-V2-Flash-shaped model for the engine tests, and its reference.

``save_mimo_v2_flash(folder)``: transformers' own ``MiMoV2FlashForCausalLM`` (transformers 5.14 has
the model), float32, seeded, saved with transformers (the checkpoint's own layout: per-expert
``experts.<e>.gate_proj/up_proj/down_proj``, ``self_attn.attention_sink_bias``), with the word-level
tokenizer of :mod:`engine_support.tiny`. MiMo-V2-Flash's shape, scaled down:

* query/key head dim 192, value head dim 128 (the model's), 4 query heads;
* 4 layers: full attention (layers 0 and 3, 2 KV heads, no sinks) and sliding-window attention
  (layers 1 and 2, window :data:`WINDOW`, 4 KV heads -- the model doubles them there -- with learnable
  sinks), partial rotary 0.334 (64 of 192 channels), rope theta 5e6 full / 1e4 sliding;
* the MLP dense in layer 0 and MoE in layers 1-3 (:data:`EXPERTS` routed experts, top
  :data:`TOP_K`, sigmoid scores with the score-correction bias for the choice, renormalised; one
  group, no shared expert: the model's router), the value scale 0.707.

The config carries both spellings of these facts: transformers' (``layer_types``,
``mlp_layer_types``, ``rope_parameters``, ``sliding_window``) and the checkpoint's that vLLM's
``mimo_v2`` module reads (``hybrid_layer_pattern``, ``moe_layer_freq``, ``swa_*``,
``sliding_window_size``, ``add_swa_attention_sink_bias``, ``layernorm_epsilon``, ``rope_theta``,
``swa_rope_theta``; ``topk_method`` and ``scoring_func``, read by sglang's), equal. The sinks (N(0, 1)) and the score-correction bias (N(0, 0.1)) are drawn
here (transformers initialises them at 0.02 and 0), so that both matter.
"""
from engine_support import tiny

WINDOW = 64
EXPERTS, TOP_K = 8, 2
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
MLP_TYPES = ["dense", "sparse", "sparse", "sparse"]


def config_fields(**overrides):
    fields = dict(
        vocab_size=tiny.VOCAB, hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2, head_dim=192,
        v_head_dim=128, sliding_window=WINDOW, layer_types=LAYER_TYPES, mlp_layer_types=MLP_TYPES,
        n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=1, topk_group=1, norm_topk_prob=True,
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.1, attention_value_scale=0.707,
        rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 5e6, "partial_rotary_factor": 0.334},
                         "sliding_attention": {"rope_type": "default", "rope_theta": 1e4,
                                               "partial_rotary_factor": 0.334}},
        # the checkpoint's names, read by vLLM's mimo_v2 module
        hybrid_layer_pattern=[int(t == "sliding_attention") for t in LAYER_TYPES],
        moe_layer_freq=[int(t == "sparse") for t in MLP_TYPES],
        swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_head_dim=192, swa_v_head_dim=128,
        sliding_window_size=WINDOW, add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
        layernorm_epsilon=1e-5, rope_theta=5e6, swa_rope_theta=1e4, partial_rotary_factor=0.334,
        # the router as the checkpoint names it (sglang's mimo_v2 reads them; vLLM's takes sigmoid itself)
        topk_method="noaux_tc", scoring_func="sigmoid")
    fields.update(overrides)
    return fields


def save_mimo_v2_flash(folder, **overrides):
    import torch
    from safetensors.torch import load_file, save_file
    from transformers import MiMoV2FlashConfig, MiMoV2FlashForCausalLM

    torch.manual_seed(0)
    MiMoV2FlashForCausalLM(MiMoV2FlashConfig(**config_fields(**overrides))).to(torch.float32).save_pretrained(folder)
    path = folder + "/model.safetensors"
    weights = load_file(path)
    generator = torch.Generator().manual_seed(1)
    drawn = 0
    for name in sorted(weights):
        if name.endswith("self_attn.attention_sink_bias"):
            weights[name] = torch.randn(weights[name].shape, generator=generator)
            drawn += 1
        elif name.endswith("mlp.gate.e_score_correction_bias"):
            weights[name] = 0.1 * torch.randn(weights[name].shape, generator=generator)
            drawn += 1
    fields = config_fields(**overrides)
    expected = fields["layer_types"].count("sliding_attention") + fields["mlp_layer_types"].count("sparse")
    if drawn != expected:
        raise RuntimeError("the saved MiMo-V2-Flash has %d sink/bias tensors, expected %d (names changed?)"
                           % (drawn, expected))
    save_file(weights, path, metadata={"format": "pt"})
    tiny.save_tokenizer(folder)
    return folder


def model_class(**config):
    """transformers' ``MiMoV2FlashForCausalLM``, its loading checked: every weight of the checkpoint
    read, none left at initialisation (the checkpoint's names are converted on load); eager
    attention and experts; ``config``: attributes of the saved config to replace (transformers'
    ``from_pretrained`` keywords)."""
    from transformers import MiMoV2FlashForCausalLM

    class Checked(MiMoV2FlashForCausalLM):
        @classmethod
        def from_pretrained(cls, folder, **kwargs):
            # eager attention (the sinks and the window as written) and eager experts (a loop over
            # the experts; the grouped matmul takes no float64)
            model, info = MiMoV2FlashForCausalLM.from_pretrained(folder, output_loading_info=True,
                                                                 attn_implementation="eager",
                                                                 experts_implementation="eager", **config, **kwargs)
            left = {k: v for k, v in info.items() if v and k in ("missing_keys", "unexpected_keys", "mismatched_keys")}
            if left:
                raise RuntimeError("transformers' MiMoV2FlashForCausalLM did not load the tiny checkpoint: %r" % left)
            return model

    return Checked


def reference_steps(model_dir, prompts, max_new=tiny.MAX_NEW, window=WINDOW):
    """transformers' MiMoV2FlashForCausalLM in float64 (eager attention with sinks and the sliding
    window; its router computes the gate in float32, as the model defines it), greedy: per prompt,
    per step, ``(token, log-probability, margin)``. ``window``: the keys a sliding layer's query
    attends, itself included (transformers' ``sliding_window``; the checkpoint's by default)."""
    return tiny.reference_steps(model_dir, prompts, max_new, model_class=model_class(sliding_window=window))
