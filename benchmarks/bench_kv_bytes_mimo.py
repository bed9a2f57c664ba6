"""MiMo-V2-Flash's KV-cache bytes per token and host reads per decode step: native (K 192 + V 128,
``vllm.mimo_v2_v_head_dim``'s default) vs padded (K 192 + V 192, ``NPU_SHIM_VLLM_MIMO_PAD_V=1``) vs
upstream's vLLM 0.19 path, side by side.

    python benchmarks/bench_kv_bytes_mimo.py [--out FILE]

Run in a vLLM lane venv (``VLLM_PLUGINS=npu_shim``, ``NPU_SHIM_LANE`` set; see the preamble of the
lane tests). What it builds: vLLM's own ``MiMoV2Attention`` layers with MiMo-V2-Flash's attention
shapes (full layers: 64 query heads, 4 KV heads; sliding-window layers: 64 query heads, 8 KV
heads, learnable sinks; K head dim 192, V 128; bfloat16 cache), a tiny hidden size (the KV cache
does not depend on it), on CPU (:mod:`npu_shim.testing.mimo`). Per layer kind it reads the
KV-cache spec vLLM builds (``Attention.get_kv_cache_spec``), bytes per token = the spec's
``page_size_bytes / block_size``; model total = 8 full + 40 sliding-window layers (MiMo-V2-Flash's
48 layers, one full layer per five sliding-window layers) per token held.

Rows, where the lane has the code:

* ``native``: the spec of the shim's patched layer by default (0.20+; vllm-ascend's backend,
  ``head_size_v`` 128: separate K 192 / V 128 caches);
* ``padded``: the spec with ``NPU_SHIM_VLLM_MIMO_PAD_V=1``. The sliding-window layers (learnable
  sinks) are then refused at build (the op's page does not take V_D 192 with sinks, GQA or
  paging); their spec here is built with ``NPU_SHIM_VLLM_MIMO_PAD_SINKS=1`` as well;
* ``upstream``: the spec upstream's model builds where it pads V itself (0.14 - 0.19).

Host reads per decode step: the layer's forward for one decode token, counted with
:func:`npu_shim.testing.syncs.count_host_syncs` (the layer's parameters and inputs stand for
device tensors), the attention op standing in as a device-only computation over the tensors it is
handed (what the model side adds, pad and cut, is what differs between the rows). Then vllm-ascend's
own impl (``AscendAttentionBackendImpl.forward`` on the emulated ops, tiny sizes): one decode step's
reads and the prefill + decode error against the float64 reference, for the native full and
sliding-window layers (window 16, past the sequence) and the padded full layer (the emulation,
following the op's page, refuses the padded sliding-window layer's call).
"""
import argparse
import importlib.metadata
import os
import sys

os.environ.setdefault("VLLM_PLUGINS", "")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

FULL_LAYERS, SWA_LAYERS = 8, 40
SHAPES = {
    "full": dict(hidden_size=64, num_heads=64, num_kv_heads=4, head_dim=192, v_head_dim=128),
    "swa": dict(hidden_size=64, num_heads=64, num_kv_heads=8, head_dim=192, v_head_dim=128),
}


def _spec_bytes(mimo, layer):
    spec = mimo.kv_cache_spec(layer)
    return spec, spec.page_size_bytes / spec.block_size


def _decode_reads(mimo, layer, forward=None):
    import torch

    from npu_shim.testing.syncs import count_host_syncs

    class DeviceAttention(torch.nn.Module):       # a stand-in op: same shapes, device-only math
        def forward(self, q, k, v):
            heads, kv_heads = layer.num_heads, layer.num_kv_heads
            n = q.shape[0]
            v = v.view(n, kv_heads, -1).repeat_interleave(heads // kv_heads, dim=1, output_size=heads)
            return v.reshape(n, -1) * 1.0

    real = layer.attn
    layer._modules["attn"] = DeviceAttention()
    try:
        hidden = torch.randn(1, layer.qkv_proj.input_size).to(next(layer.parameters()).dtype)
        positions = torch.tensor([5])
        with torch.no_grad(), count_host_syncs(device_tensors=(hidden, positions),
                                               device_modules=(layer,)) as counter:
            (forward or type(layer).forward)(layer, positions, hidden)
    finally:
        layer._modules["attn"] = real
    return counter.count


def _impl_decode_reads(mimo, kind, padded=False):
    """Reads over one decode step through vllm-ascend's impl forward (emulated ops), the patched
    layer (tiny sizes; native, or ``padded``), and the max error of prefill + decode against the
    float64 reference, relative to max |ref|."""
    import contextlib

    import torch

    from npu_shim.testing.syncs import collect_host_syncs

    counters = []

    with mimo.ascend_backend(), (mimo.padded() if padded else contextlib.nullcontext()):
        layer = mimo.build_layer(kind, dtype=torch.bfloat16, **({"sliding_window_size": 16} if kind == "swa" else {}))
    got, expected = mimo.ascend_prefill_decode(layer, around_decode=collect_host_syncs(counters))
    return counters[0].count, (got - expected).abs().max().item() / expected.abs().max().item()


def rows():
    import torch
    from packaging.version import Version

    from npu_shim.testing import mimo

    mimo.setup()
    version = Version(importlib.metadata.version("vllm"))
    padded_by_model = "functional.pad" in __import__("inspect").getsource(mimo.attention_class().forward)
    found = []

    def measure(name, build, forward=None):
        per_kind = {}
        for kind in ("full", "swa"):
            layer = build(kind)
            spec, per_token = _spec_bytes(mimo, layer)
            per_kind[kind] = (spec, per_token, _decode_reads(mimo, layer, forward))
        total = FULL_LAYERS * per_kind["full"][1] + SWA_LAYERS * per_kind["swa"][1]
        found.append((name, per_kind, total))

    def layer(kind):
        with mimo.ascend_backend():
            return mimo.build_layer(kind, dtype=torch.bfloat16, **SHAPES[kind])

    def padded_layer(kind):
        with mimo.padded(sinks=True):
            return layer(kind)

    if padded_by_model:
        measure("upstream %s (V padded by the model)" % version, layer)
        return version, found, {}
    measure("native (vllm.mimo_v2_v_head_dim, default)", layer)
    measure("padded (NPU_SHIM_VLLM_MIMO_PAD_V=1; swa: PAD_SINKS=1)", padded_layer)
    impl = {"native full": _impl_decode_reads(mimo, "full"), "native swa": _impl_decode_reads(mimo, "swa"),
            "padded full": _impl_decode_reads(mimo, "full", padded=True)}
    return version, found, impl


def report(version, found, impl):
    lines = ["MiMo-V2-Flash KV cache per token (bfloat16), vLLM %s: specs vLLM builds; "
             "model = %d full + %d sliding-window layers" % (version, FULL_LAYERS, SWA_LAYERS), ""]
    lines.append("%-54s %-26s %-26s %12s %10s" % ("path", "full layer (spec)", "swa layer (spec)",
                                                   "model B/tok", "reads/dec"))
    base = None
    for name, per_kind, total in found:
        cells = []
        for kind in ("full", "swa"):
            spec, per_token, _ = per_kind[kind]
            cells.append("%d B (K%d+V%d x%d)" % (per_token, spec.head_size, getattr(spec, "head_size_v", spec.head_size),
                                                 spec.num_kv_heads))
        reads = "%d/%d" % (per_kind["full"][2], per_kind["swa"][2])
        lines.append("%-54s %-26s %-26s %12d %10s" % (name, cells[0], cells[1], total, reads))
        base = total if "native" in name else base
    if base:
        for name, _, total in found:
            lines.append("  %s: %.3fx native" % (name.split(" (")[0], total / base))
    for kind, (reads, error) in impl.items():
        lines.append("vllm-ascend impl decode step, %s layer (tiny, emulated ops, bfloat16): %d device->host reads "
                     "(the patch's pad and cut included); prefill+decode max error %.4f of max |ref|"
                     % (kind, reads, error))
    if impl:
        lines.append("padded sliding-window layers (sinks): refused at build with NPU_SHIM_VLLM_MIMO_PAD_V=1; built "
                     "with NPU_SHIM_VLLM_MIMO_PAD_SINKS=1 too, vllm-ascend's FIA v2 call with V_D 192 and "
                     "learnable_sink is refused by the emulation (not on the op's page)")
    lines.append("")
    lines.append("reads/dec: device->host reads over one decode-step forward of the layer (full/swa), "
                 "the attention op a device-only stand-in")
    return "\n".join(lines)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", help="also write the report to this file")
    args = parser.parse_args(argv)
    text = report(*rows())
    print(text)
    if args.out:
        with open(args.out, "w") as handle:
            handle.write(text + "\n")


if __name__ == "__main__":
    main()
