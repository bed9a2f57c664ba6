"""A tiny random-weight MiMo-V2-Flash-shaped model for the engine tests, and its reference.

``save_mimo_v2_flash(folder)``: the checkpoint written here, with no model class: ``config.json``,
``model.safetensors`` in the layout MiMo-V2-Flash's checkpoints use (per-expert
``experts.<e>.gate_proj/up_proj/down_proj``, ``self_attn.attention_sink_bias``,
``mlp.gate.e_score_correction_bias``), every tensor drawn from one seeded generator in name order
(:func:`weights`), and the word-level tokenizer of :mod:`engine_support.tiny`. MiMo-V2-Flash's shape,
scaled down:

* query/key head dim 192, value head dim 128 (the model's), 4 query heads;
* 4 layers: full attention (layers 0 and 3, 2 KV heads, no sinks) and sliding-window attention
  (layers 1 and 2, window :data:`WINDOW`, 4 KV heads -- the model doubles them there -- with learnable
  sinks), partial rotary 0.334 (64 of 192 channels), rope theta 5e6 full / 1e4 sliding;
* the MLP dense in layer 0 and MoE in layers 1-3 (:data:`EXPERTS` routed experts, top
  :data:`TOP_K`, sigmoid scores with the score-correction bias for the choice, renormalised; one
  group, no shared expert: the model's router), the value scale 0.707.

The config carries both spellings of these facts: transformers' (``layer_types``,
``mlp_layer_types``, ``sliding_window``; its ``rope_parameters`` left to its own defaults, which are
the model's thetas) and the checkpoint's that vLLM's MiMo module reads (``hybrid_layer_pattern``,
``moe_layer_freq``, ``swa_*``, ``sliding_window_size``, ``add_swa_attention_sink_bias``,
``layernorm_epsilon``, ``rope_theta``, ``swa_rope_theta``; ``topk_method`` and ``scoring_func``, read by
sglang's), equal. The weights: N(0, 0.1) for the
projections, embeddings and router; norms 1; the sinks N(0, 1) and the score-correction bias
N(0, 0.1), so that both matter.

A lane whose transformers has no MiMo-V2-Flash class (transformers 4) reads the config through the
checkpoint's own configuration code, as the model's repository ships it (``auto_map``, loaded with
``trust_remote_code``): here ``configuration_mimo_v2_flash.py`` (:data:`CONFIG_CODE`), a declared
stand-in that only names the model type (every field is the config file's). Its reference is
:func:`forward_f64` (the model's definition in float64 over :func:`npu_shim.testing.reference.attention_f64`);
where transformers has the class, its float64 model is the reference, and :func:`forward_f64` is
checked against it there (tests/lanes/test_engine_vllm_mimo.py).
"""
import json
import os

from engine_support import tiny

WINDOW = 64
EXPERTS, TOP_K = 8, 2
LAYER_TYPES = ["full_attention", "sliding_attention", "sliding_attention", "full_attention"]
MLP_TYPES = ["dense", "sparse", "sparse", "sparse"]


def config_fields(**overrides):
    fields = dict(
        model_type="mimo_v2_flash", architectures=["MiMoV2FlashForCausalLM"],
        vocab_size=tiny.VOCAB, hidden_size=256, intermediate_size=256, moe_intermediate_size=64,
        num_hidden_layers=len(LAYER_TYPES), num_attention_heads=4, num_key_value_heads=2, head_dim=192,
        v_head_dim=128, sliding_window=WINDOW, layer_types=LAYER_TYPES, mlp_layer_types=MLP_TYPES,
        n_routed_experts=EXPERTS, num_experts_per_tok=TOP_K, n_group=1, topk_group=1, norm_topk_prob=True,
        routed_scaling_factor=1.0, hidden_act="silu", attention_bias=False, rms_norm_eps=1e-5,
        max_position_embeddings=512, tie_word_embeddings=False, initializer_range=0.1, attention_value_scale=0.707,
        bos_token_id=1, torch_dtype="float32",
        # the checkpoint's names, read by vLLM's MiMo module
        hybrid_layer_pattern=[int(t == "sliding_attention") for t in LAYER_TYPES],
        moe_layer_freq=[int(t == "sparse") for t in MLP_TYPES],
        swa_num_attention_heads=4, swa_num_key_value_heads=4, swa_head_dim=192, swa_v_head_dim=128,
        sliding_window_size=WINDOW, add_swa_attention_sink_bias=True, add_full_attention_sink_bias=False,
        layernorm_epsilon=1e-5, rope_theta=5e6, swa_rope_theta=1e4, partial_rotary_factor=0.334,
        # the router as the checkpoint names it (sglang's mimo_v2 reads them; vLLM's takes sigmoid itself)
        topk_method="noaux_tc", scoring_func="sigmoid",
        auto_map={"AutoConfig": "configuration_mimo_v2_flash.MiMoV2FlashConfig"})
    fields.update(overrides)
    return fields


# The checkpoint's configuration code for a transformers without the model (see the module docstring).
CONFIG_CODE = '''"""npu-shim test stand-in for MiMo-V2-Flash's configuration code: the model type only."""
from transformers import PretrainedConfig


class MiMoV2FlashConfig(PretrainedConfig):
    model_type = "mimo_v2_flash"
'''


def _attention_shapes(fields, layer):
    sliding = fields["layer_types"][layer] == "sliding_attention"
    heads = fields["swa_num_attention_heads"] if sliding else fields["num_attention_heads"]
    kv_heads = fields["swa_num_key_value_heads"] if sliding else fields["num_key_value_heads"]
    return sliding, heads, kv_heads


def weights(fields):
    """The checkpoint's tensors for the config ``fields``, float32, by name: every tensor drawn from
    one generator (seed 0) in sorted name order."""
    import torch

    hidden, head, v_head = fields["hidden_size"], fields["head_dim"], fields["v_head_dim"]
    shapes = {"model.embed_tokens.weight": ((fields["vocab_size"], hidden), "normal"),
              "model.norm.weight": ((hidden,), "ones"),
              "lm_head.weight": ((fields["vocab_size"], hidden), "normal")}
    for i in range(fields["num_hidden_layers"]):
        base = "model.layers.%d." % i
        sliding, heads, kv_heads = _attention_shapes(fields, i)
        shapes.update({base + "input_layernorm.weight": ((hidden,), "ones"),
                       base + "post_attention_layernorm.weight": ((hidden,), "ones"),
                       base + "self_attn.q_proj.weight": ((heads * head, hidden), "normal"),
                       base + "self_attn.k_proj.weight": ((kv_heads * head, hidden), "normal"),
                       base + "self_attn.v_proj.weight": ((kv_heads * v_head, hidden), "normal"),
                       base + "self_attn.o_proj.weight": ((hidden, heads * v_head), "normal")})
        if sliding and fields["add_swa_attention_sink_bias"]:
            shapes[base + "self_attn.attention_sink_bias"] = ((heads,), "sinks")
        if fields["mlp_layer_types"][i] == "sparse":
            inter = fields["moe_intermediate_size"]
            shapes[base + "mlp.gate.weight"] = ((fields["n_routed_experts"], hidden), "normal")
            shapes[base + "mlp.gate.e_score_correction_bias"] = ((fields["n_routed_experts"],), "bias")
            for e in range(fields["n_routed_experts"]):
                expert = base + "mlp.experts.%d." % e
                shapes.update({expert + "gate_proj.weight": ((inter, hidden), "normal"),
                               expert + "up_proj.weight": ((inter, hidden), "normal"),
                               expert + "down_proj.weight": ((hidden, inter), "normal")})
        else:
            inter = fields["intermediate_size"]
            shapes.update({base + "mlp.gate_proj.weight": ((inter, hidden), "normal"),
                           base + "mlp.up_proj.weight": ((inter, hidden), "normal"),
                           base + "mlp.down_proj.weight": ((hidden, inter), "normal")})
    generator = torch.Generator().manual_seed(0)
    scale = {"normal": fields["initializer_range"], "sinks": 1.0, "bias": 0.1}
    out = {}
    for name in sorted(shapes):
        shape, kind = shapes[name]
        out[name] = (torch.ones(shape) if kind == "ones"
                     else scale[kind] * torch.randn(shape, generator=generator, dtype=torch.float64)).float()
    return out


def save_mimo_v2_flash(folder, **overrides):
    """The checkpoint (:func:`weights` of :func:`config_fields` with ``overrides``), its config,
    configuration code and tokenizer, written to ``folder``; returns ``folder``."""
    from safetensors.torch import save_file

    fields = config_fields(**overrides)
    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(fields, f, indent=1)
    with open(os.path.join(folder, "configuration_mimo_v2_flash.py"), "w") as f:
        f.write(CONFIG_CODE)
    save_file(weights(fields), os.path.join(folder, "model.safetensors"), metadata={"format": "pt"})
    tiny.save_tokenizer(folder)
    return folder


def transformers_has_the_model():
    """Whether the installed transformers has MiMo-V2-Flash (transformers 5.14 does, 4.57 does not)."""
    import transformers

    return hasattr(transformers, "MiMoV2FlashForCausalLM")


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


def forward_f64(model_dir, ids, window=None):
    """MiMo-V2-Flash's forward in float64 from the model's definition, on the checkpoint in
    ``model_dir``: the logits (T, vocab) of the token ids ``ids`` (one sequence from position 0);
    ``window``: the keys a sliding layer's query attends, itself included (default: the checkpoint's).

    Per layer: RMSNorm (``x / sqrt(mean(x^2) + eps) * w``); q/k/v projections, V times the value
    scale; rotary on the first ``int(192 * 0.334)`` = 64 channels of q and k (rotate-half, frequency
    ``j`` turning by ``p * theta ** (-2 j / 64)``, theta 5e6 full / 1e4 sliding); causal softmax
    attention (:func:`npu_shim.testing.reference.attention_f64`, scale ``192 ** -0.5``, GQA), in a
    sliding layer with its sinks and the window (query ``i`` sees keys ``i - W < j <= i``); o_proj;
    residual. MLP: SiLU(gate) * up, down; MoE: router scores ``sigmoid(x @ gate^T)``, the top-k experts
    chosen by score + correction bias, weighted by their scores renormalised (times the routed
    scaling factor), each expert an MLP; residual. Final norm, lm_head."""
    return _forward_f64(*_load_f64(model_dir), ids, window)


def _load_f64(model_dir):
    """The checkpoint's config (a dict) and its tensors in float64, by name."""
    from safetensors.torch import load_file

    with open(os.path.join(model_dir, "config.json")) as f:
        config = json.load(f)
    return config, {name: t.double() for name, t in load_file(os.path.join(model_dir, "model.safetensors")).items()}


def _forward_f64(c, w, ids, window=None):
    """:func:`forward_f64` on a loaded config ``c`` and float64 tensors ``w``."""
    import torch

    from npu_shim.testing.reference import attention_f64

    t = len(ids)
    head, v_head = c["head_dim"], c["v_head_dim"]
    rotary = int(head * c["partial_rotary_factor"])
    positions = torch.arange(t, dtype=torch.float64)

    def norm(x, weight):
        return x / torch.sqrt((x * x).mean(-1, keepdim=True) + c["layernorm_epsilon"]) * weight

    def rope(x, theta):  # x (T, H, D): the first `rotary` channels turned, rotate-half pairs
        freq = theta ** (-torch.arange(0, rotary, 2, dtype=torch.float64) / rotary)
        angle = positions[:, None] * freq[None, :]
        cos, sin = torch.cat([angle.cos()] * 2, -1)[:, None, :], torch.cat([angle.sin()] * 2, -1)[:, None, :]
        x1, x2 = x[..., :rotary // 2], x[..., rotary // 2:rotary]
        turned = x[..., :rotary] * cos + torch.cat([-x2, x1], -1) * sin
        return torch.cat([turned, x[..., rotary:]], -1)

    def mlp(x, base):
        gate, up = x @ w[base + "gate_proj.weight"].T, x @ w[base + "up_proj.weight"].T
        return (torch.nn.functional.silu(gate) * up) @ w[base + "down_proj.weight"].T

    x = w["model.embed_tokens.weight"][torch.tensor(ids)]
    for i in range(c["num_hidden_layers"]):
        base = "model.layers.%d." % i
        sliding, heads, kv_heads = _attention_shapes(c, i)
        h = norm(x, w[base + "input_layernorm.weight"])
        q = (h @ w[base + "self_attn.q_proj.weight"].T).view(t, heads, head)
        k = (h @ w[base + "self_attn.k_proj.weight"].T).view(t, kv_heads, head)
        v = (h @ w[base + "self_attn.v_proj.weight"].T).view(t, kv_heads, v_head) * c["attention_value_scale"]
        theta = c["swa_rope_theta"] if sliding else c["rope_theta"]
        window_ = (window or c["sliding_window_size"]) if sliding else None
        allowed = (lambda seg, sq, skv, w=window_: torch.arange(skv)[None, :] > torch.arange(sq)[:, None] - w) \
            if window_ else None
        sinks = w[base + "self_attn.attention_sink_bias"] if sliding and c["add_swa_attention_sink_bias"] else None
        out = attention_f64(rope(q, theta), rope(k, theta), v, [0, t], causal=True, scale=head ** -0.5,
                            allowed=allowed, sinks=sinks)
        x = x + out.reshape(t, heads * v_head) @ w[base + "self_attn.o_proj.weight"].T
        h = norm(x, w[base + "post_attention_layernorm.weight"])
        if c["mlp_layer_types"][i] == "sparse":
            scores = torch.sigmoid(h @ w[base + "mlp.gate.weight"].T)
            chosen = (scores + w[base + "mlp.gate.e_score_correction_bias"]).topk(c["num_experts_per_tok"], -1).indices
            weight = scores.gather(1, chosen)
            if c["norm_topk_prob"]:
                weight = weight / weight.sum(-1, keepdim=True)
            weight = weight * c["routed_scaling_factor"]
            moe = torch.zeros_like(h)
            for row in range(t):
                for e, g in zip(chosen[row].tolist(), weight[row]):
                    moe[row] += g * mlp(h[row], base + "mlp.experts.%d." % e)
            x = x + moe
        else:
            x = x + mlp(h, base + "mlp.")
    return norm(x, w["model.norm.weight"]) @ w["lm_head.weight"].T


def reference_steps(model_dir, prompts, max_new=tiny.MAX_NEW, window=WINDOW):
    """The float64 reference, greedy: per prompt, per step, ``(token, log-probability, margin)``.
    transformers' MiMoV2FlashForCausalLM in float64 where transformers has it (eager attention with
    sinks and the sliding window; its router computes the gate in float32, as the model defines
    it); :func:`forward_f64` otherwise. ``window``: the keys a sliding layer's query attends, itself
    included (transformers' ``sliding_window``; the checkpoint's by default)."""
    if transformers_has_the_model():
        return tiny.reference_steps(model_dir, prompts, max_new, model_class=model_class(sliding_window=window))
    return own_reference_steps(model_dir, prompts, max_new, window)


def own_reference_steps(model_dir, prompts, max_new=tiny.MAX_NEW, window=None):
    """:func:`forward_f64`, greedy (``tiny.greedy_steps``): per prompt, per step, ``(token,
    log-probability, margin)``; the checkpoint read once."""
    config, weights = _load_f64(model_dir)
    return [tiny.greedy_steps(lambda ids: _forward_f64(config, weights, ids, window)[-1], prompt, max_new)
            for prompt in prompts]
