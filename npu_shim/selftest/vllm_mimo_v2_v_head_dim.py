"""Selftest of ``vllm.mimo_v2_v_head_dim`` / ``vllm.mimo_v2_flash_v_head_dim`` / ``vllm.ascend_attention_v_head_dim``
/ ``vllm.mimo_v2_flash_sinks_refuse``: MiMo-V2-Flash's attention on vllm-ascend.

Builds tiny ``MiMoV2Attention`` layers (:mod:`npu_shim.testing.mimo`: key head dim 192, value head
dim 128, bfloat16) with the patched ``__init__`` on vllm-ascend's ``AscendAttentionBackend`` (the
platform's answer; the selector stands in for it, see :mod:`npu_shim.testing.mimo`), and runs one
sequence through vllm-ascend's own ``AscendAttentionBackendImpl.forward``: a prefill of 6 tokens and
one decode step over the paged K/V caches (:func:`npu_shim.testing.mimo.ascend_prefill_decode`),
compared with attention with V 128 from the definition in float64
(:func:`npu_shim.testing.mimo.sink_attention_f64`), sinks included:

* by default (native): the full layer and the sliding-window layer (learnable sinks, GQA, window
  4), each with a 192-wide K cache and a 128-wide V cache, served by vllm-ascend's FIA v2 call
  (``vllm.ascend_attention_v_head_dim`` must be applied). The shapes reach the window edge across
  the null block: 19 prefill tokens and a decode step at position 19 in 16-token blocks, block 0
  the null block (large random K/V), the sequence's first block pointed at it for the decode step
  as vLLM's KV manager does once that block lies wholly before the window; the key the op's band
  reading adds to pre_tokens = W (key 15) is that block's last row. The sliding layer must give
  the model's W keys (the patch passes pre_tokens = W - 1);
* ``NPU_SHIM_VLLM_MIMO_PAD_V=1``: V padded to 192 before the impl and the output cut back after it;
  the sliding-window layer's build must then be refused (NotImplementedError naming the op page's
  rules: V_D 192 not with GQA or page attention, ``learnable_sink`` only with V_D <= 128; error 0
  for the check when the refusal names them), or, with ``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1``, built
  padded and run (the emulation, following the page, refuses that call: the selftest then fails,
  naming the layer).

Window probe (:func:`npu_shim.testing.window_edge.probe_window_edge`, reported in ``detail``):
which reading the installed ``npu_fused_infer_attention_score_v2`` has for ``pre_tokens=W,
next_tokens=0`` (sparse_mode 4, TND), W or W + 1 keys, in a prefill call and in a decode-only call
(Q_S 1, where the page says pre_tokens has no effect), whether it ignores the window there. It
decides NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE (W + 1: turn it on for the V == K sliding layers too;
W: the sliding layer above fails, and upstream's call was right); it does not change the verdict
by itself.

Error: max |out - ref| over the layers run; the tolerance scales with max |ref|: the bfloat16
rounding of the output, 2**-7 * max |ref|. Host syncs: counted over the decode step (pad, impl,
cut), the metadata's and caches' tensors standing in for device tensors; none expected.
"""
import time

from npu_shim import _config

MODULES = {"vllm.mimo_v2_v_head_dim": "mimo_v2", "vllm.mimo_v2_flash_v_head_dim": "mimo_v2_flash",
           "vllm.mimo_v2_flash_sinks_refuse": "mimo_v2_flash"}
# the vllm-ascend patch serving the native layers: its selftest is the model patch's, on the model
# module the installed vLLM has
IMPL_PATCH = "vllm.ascend_attention_v_head_dim"
TOKENS = 19
WINDOW = 4
KINDS = {"full": {}, "swa": {"sliding_window_size": WINDOW}}
# the window edge across the null block (see the module docstring)
EDGE = dict(tokens=TOKENS, block_size=16, num_blocks=3, null_block=True)
# what the refusal must name: the op and the rules of its page
REFUSAL = ("npu_fused_infer_attention_score_v2", "5e735e5", "GQA和PA场景不支持V_D等于192",
           "仅支持value的d小于等于128", "NPU_SHIM_VLLM_MIMO_PAD_SINKS=1")


def run(device=None, patch=None, model=None):
    import torch

    import npu_shim
    from npu_shim import emulation
    from npu_shim.selftest import applied_target, on_upstream
    from npu_shim.testing import collect_host_syncs, mimo

    device = device or "cpu"
    settings = _config.settings()
    if patch == IMPL_PATCH:                 # the layers of the installed vLLM's model, served natively
        applied_target(patch)
        if settings.mimo_pad_v:
            raise RuntimeError("%s serves layers with V != K; NPU_SHIM_VLLM_MIMO_PAD_V=1 pads them, so none "
                               "reaches it: run this selftest without it" % patch)
        patch = next((name for name, module_name in MODULES.items()
                      if module_name == mimo.model_module().__name__.rpartition(".")[2]
                      and next(r for r in npu_shim.status() if r["name"] == name)["state"] == "applied"), None)
        if patch is None:
            raise RuntimeError("no MiMo model patch is applied here: nothing builds a layer with V != K for %s"
                               % IMPL_PATCH)
        model = MODULES[patch]
    module = applied_target(patch)
    if module.__name__.rpartition(".")[2] != model or MODULES.get(patch) != model:
        raise ValueError("%s serves vLLM's %s model module, not %s" % (patch, MODULES.get(patch), model))
    init = module.MiMoV2Attention.__init__
    replaces = next(r["replaces"] for r in npu_shim.status() if r["name"] == patch)
    if not on_upstream(patch) and not all(hasattr(getattr(module.MiMoV2Attention, path.rpartition(".")[2]), "__wrapped_upstream__")
               for path in replaces):
        raise RuntimeError("%s reports applied but MiMoV2Attention is not the shim's" % patch)
    mimo.setup(emulate=emulation.is_emulated())
    counters = []
    counted = collect_host_syncs(counters)

    started = time.perf_counter()
    errors, tolerances = [], []
    # padded: by the switch, or by vLLM 0.15 - 0.19's model itself (vllm.mimo_v2_flash_sinks_refuse)
    pad_v = settings.mimo_pad_v or patch == "vllm.mimo_v2_flash_sinks_refuse"
    pad_sinks = pad_v and settings.mimo_pad_sinks
    for kind, overrides in KINDS.items():
        with mimo.ascend_backend():
            try:
                layer = mimo.build_layer(kind, init=init, dtype=torch.bfloat16, **overrides)
            except NotImplementedError as exc:
                if kind == "swa" and pad_v and not pad_sinks and all(rule in str(exc) for rule in REFUSAL):
                    errors.append(0.0)          # refused as it should be
                    continue
                raise
        if kind == "swa" and pad_v and not pad_sinks:
            raise RuntimeError("the sliding-window layer (learnable sinks) was built with V padded to %d: "
                               "the patch should refuse it at build" % layer.head_dim)
        if kind == "swa" and getattr(layer, "attention_sink_bias", None) is None:
            raise RuntimeError("the sliding-window layer was built without its learnable sinks")
        try:
            got, expected = mimo.ascend_prefill_decode(layer, around_decode=counted, device=device, **EDGE)
        except NotImplementedError as exc:      # an op refusing the padded call: say which layer
            raise RuntimeError("the %s layer (%d heads, %d KV heads, V %d wide in the impl%s): %s"
                               % (kind, layer.num_heads, layer.num_kv_heads, layer.attn.head_size_v,
                                  ", learnable sinks" if kind == "swa" else "", exc)) from exc
        if got.shape != expected.shape:
            raise RuntimeError("%s layer: output %s, reference %s" % (kind, tuple(got.shape), tuple(expected.shape)))
        errors.append((got - expected).abs().max().item())
        tolerances.append(2 ** -7 * expected.abs().max().item())
    if device != "cpu":
        torch.npu.synchronize()
    seconds = time.perf_counter() - started
    probe = _window_probe(device)
    return {
        "max_abs_err": max(errors),
        "tolerance": min(tolerances),
        "host_syncs": sum(c.count for c in counters),
        "seconds": seconds,
        "detail": "MiMoV2Attention (%s) K 192 / V 128%s, %s through AscendAttentionBackendImpl.forward: "
                  "prefill %d tokens + 1 decode step, bfloat16 on %s; tolerance 2**-7 * max|ref|%s"
                  % (model, " padded to 192" if pad_v else " (separate 192 / 128 caches)",
                     "the full layer" if pad_v and not pad_sinks else
                     "a full layer and a sliding-window layer with sinks (window %d)" % WINDOW, TOKENS, device,
                     "" if not pad_v else "; NPU_SHIM_VLLM_MIMO_PAD_SINKS=1" if pad_sinks else
                     "; the sliding-window layer (sinks) refused at build as it should be")
                  + "; decode at position %d, 16-token blocks, the first one the null block; %s" % (TOKENS, probe),
    }


def _window_probe(device):
    """The window probe's sentence, with what it means for NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE."""
    from npu_shim.testing.window_edge import probe_window_edge

    try:
        found = probe_window_edge(device=device)
    except (AttributeError, NotImplementedError, ValueError, RuntimeError) as exc:
        return "window probe not run (%s: %s)" % (type(exc).__name__, exc)
    if found["prefill"] == found["decode"] == "W+1":
        advice = ("the op's band reading: NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE=1 gives every sliding layer "
                  "the model's W (on: %s)" % _config.settings().ascend_swa_window_edge)
    elif found["prefill"] == found["decode"] == "W":
        advice = "W keys for pre_tokens=W: upstream's call is right, keep NPU_SHIM_VLLM_ASCEND_SWA_WINDOW_EDGE off"
    else:
        advice = "a reading neither W nor W + 1 throughout: no pre_tokens gives every sliding layer W"
    return "%s; %s" % (found["detail"], advice)
