"""The tiny model the engine tests serve, and its independent reference.

``save_qwen2(folder)``: a random-weight Qwen2-shaped causal LM (2 layers, hidden 64, 4 heads, 2 KV
heads, vocab 128), float32, seeded, saved with transformers; ``with_tokenizer=True`` also saves a
tokenizer built here (a word-level ``tokenizers`` model over the vocabulary, no download), for
engines that load one. ``reference_tokens``: transformers' greedy argmax in float64 on the same
weights, the token ids each prompt continues with.
"""
import json
import os
import subprocess

import pytest

PROMPTS = [[5, 17, 3], [9, 2, 44, 61, 7, 7, 30, 12, 100], [1] + list(range(20, 60))]
MAX_NEW = 6
VOCAB = 128


def save_qwen2(folder, with_tokenizer=False, **config_overrides):
    """``config_overrides``: Qwen2Config fields that differ from the tiny defaults (an engine whose
    attention kernels take only some head sizes asks for one, e.g. ``hidden_size=256``: head 64)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    fields = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                  num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                  tie_word_embeddings=False)
    fields.update(config_overrides)
    config = Qwen2Config(**fields)
    torch.manual_seed(0)
    Qwen2ForCausalLM(config).to(torch.float32).save_pretrained(folder)
    if with_tokenizer:
        save_tokenizer(folder)
    return folder


def save_tokenizer(folder):
    """A word-level tokenizer whose ids are the model's vocabulary (``t000`` .. ``t127``), made here.

    The words are of one width: transformers matches special tokens inside words, so with ``t1`` as
    a special token ``t17`` would split into ``t1`` and ``7``."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {"t%03d" % i: i for i in range(VOCAB)}
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="t002"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=core, bos_token="t000", eos_token="t001",
                                        unk_token="t002", pad_token="t001")
    tokenizer.save_pretrained(folder)


def reference_tokens(model_dir, prompts=PROMPTS, max_new=MAX_NEW):
    """transformers, float64, greedy argmax: the independent reference's tokens per prompt."""
    return [[token for token, _, _ in steps] for steps in reference_steps(model_dir, prompts, max_new)]


def greedy_steps(last_logits, prompt, max_new=MAX_NEW):
    """Greedy decoding of one ``prompt`` (token ids) with ``last_logits(ids)``, the float64 logits of
    the token after ``ids`` (the whole sequence each step): per generated token ``(token,
    log-probability, margin)``, the margin being the greedy logit minus the runner-up's (how far
    from a tie)."""
    import torch

    ids, out = list(prompt), []
    with torch.no_grad():
        for _ in range(max_new):
            logits = last_logits(ids)
            top = logits.topk(2)
            nxt = int(top.indices[0])
            out.append((nxt, float(torch.log_softmax(logits, -1)[nxt]), float(top.values[0] - top.values[1])))
            ids.append(nxt)
    return out


def reference_steps(model_dir, prompts=PROMPTS, max_new=MAX_NEW, model_class=None):
    """transformers, float64, greedy (:func:`greedy_steps`): per prompt, per generated token,
    ``(token, log-probability, margin)``. ``model_class``: transformers' class for the saved model
    (default ``Qwen2ForCausalLM``)."""
    import torch

    if model_class is None:
        from transformers import Qwen2ForCausalLM as model_class

    model = model_class.from_pretrained(model_dir, torch_dtype=torch.float64).eval()
    return [greedy_steps(lambda ids: model(torch.tensor([ids])).logits[0, -1], prompt, max_new)
            for prompt in prompts]


def scored_steps(model_dir, prompt, tokens, model_class=None):
    """transformers, float64, one forward over ``prompt + tokens`` (an engine's continuation): per
    generated token, ``(log-probability, gap)``, the gap being float64's top logit minus that token's
    (0 where the token is float64's greedy pick). For a dtype whose error can swap near-ties: each of the
    engine's tokens is scored where the engine stood, so no step is left unchecked after a tie."""
    import torch

    if model_class is None:
        from transformers import Qwen2ForCausalLM as model_class

    model = model_class.from_pretrained(model_dir, torch_dtype=torch.float64).eval()
    with torch.no_grad():
        logits = model(torch.tensor([list(prompt) + list(tokens)])).logits[0]
    steps = []
    for i, token in enumerate(tokens):
        row = logits[len(prompt) - 1 + i]
        steps.append((float(torch.log_softmax(row, -1)[token]), float(row.max() - row[token])))
    return steps


def child_env(shim_on, *, pythonpath=(), drop=("NPU_SHIM",), **extra):
    """The engine child's environment: this one without ``NPU_SHIM*``, the ``drop`` prefixes and
    ``PYTHONPATH``; the emulated device on, the shim on or off (``NPU_SHIM``), its bootstrap last on
    ``PYTHONPATH`` after ``pythonpath``; then ``extra``."""
    import npu_shim

    bootstrap = os.path.join(os.path.dirname(npu_shim.__file__), "_bootstrap")
    env = {k: v for k, v in os.environ.items() if not k.startswith(tuple(drop)) and k != "PYTHONPATH"}
    env.update(NPU_SHIM_EMULATE="1", NPU_SHIM_EMULATE_DEVICE="1", NPU_SHIM="1" if shim_on else "0",
               PYTHONPATH=os.pathsep.join([*pythonpath, bootstrap]), **extra)
    return env


def engine_result(rc, output):
    """The last ``ENGINE_RESULT <json>`` line an engine child printed, parsed; the child must have
    exited 0 and printed one (the assertion shows the output's tail)."""
    results = [line for line in output.splitlines() if line.startswith("ENGINE_RESULT ")]
    assert rc == 0 and results, output[-3000:]
    return json.loads(results[-1][len("ENGINE_RESULT "):])


def run_child(argv, env, cwd, timeout_s, what):
    """Run an engine's child process; a hang past ``timeout_s`` fails the test (never a pass).
    Returns (returncode, stdout + stderr)."""
    try:
        proc = subprocess.run(argv, env=env, capture_output=True, text=True, timeout=timeout_s, cwd=cwd)
    except subprocess.TimeoutExpired as exc:
        tail = exc.stderr or b""
        if isinstance(tail, bytes):
            tail = tail.decode(errors="replace")
        pytest.fail("%s on the emulated device did not finish within %d s: %s" % (what, timeout_s, tail[-3000:]))
    return proc.returncode, proc.stdout + proc.stderr
