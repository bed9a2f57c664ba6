"""Host cost of one vision-encoder forward: upstream vllm-ascend forward_oot vs the patch.

Side by side in one process: 27 layers of vllm-ascend's real
``AscendMMEncoderAttention`` (a Qwen2.5/3-VL-sized tower: 16 heads of 80), once
as upstream ships it (the upstream file loaded under a second module name, so
the shim does not touch it) and once patched by ``vllm.mm_encoder_attn``, on
host-bound sizes (a few small images: the kernels have almost nothing to do,
so what is measured is what the host does around them). Two inputs: the images
packed into one sequence with a ``cu_seqlens`` tensor (Qwen-VL style), and the
same number of images as a uniform batch with ``cu_seqlens=None``
(Hunyuan-OCR style); both on the A2 path (patched: TND fusion attention) and
the 310P path (both: unpad).

Printed per forward:

* host syncs (``npu_shim.testing.count_host_syncs``, ``cu_seqlens`` as a device
  stand-in): upstream copies it to the host in every layer;
* host time: thread CPU time of the forward minus the time spent inside the
  emulated torch_npu ops (on an NPU those are queued kernels, not host work),
  median of repeated forwards, upstream and patched taking turns; and the
  patched/upstream ratio (goal <= 0.8x).

The CPU run cannot show the larger cost of an NPU sync -- a device->host copy
waits until all queued device work has finished, idling the NPU between layers
-- so the ratio here is what the host saves even before that.

Run on the vllm-0.13 lane (vllm 0.13.0 + vllm-ascend 0.13.0, emulated torch_npu):

    NPU_SHIM_EMULATE=1 VLLM_PLUGINS= /work/venvs/vllm-0.13/bin/python benchmarks/bench_mm_encoder.py
"""
import argparse
import contextlib
import importlib
import importlib.util
import os
import statistics
import time

LAYERS = 27
HEADS, HEAD_DIM = 16, 80
TARGET = "vllm_ascend.ops.mm_encoder_attention"
NPU_OPS = ("npu_fusion_attention", "_npu_flash_attention_unpad", "npu_fused_infer_attention_score")
REPRODUCE = ("NPU_SHIM_EMULATE=1 VLLM_PLUGINS= /work/venvs/vllm-0.13/bin/python "
             "benchmarks/bench_mm_encoder.py")


def load_modules():
    """The patched target and an untouched upstream copy of the same file.

    ``vllm_ascend/ops/__init__.py`` imports compiled Ascend ops; it is not run: an
    empty package module with the real ``__path__`` stands for ``vllm_ascend.ops``.
    """
    os.environ["VLLM_PLUGINS"] = ""
    import npu_shim
    from npu_shim import emulation

    emulation.install()
    npu_shim.install()
    from npu_shim.testing.isolation import import_vllm_ascend_ops_module

    patched = import_vllm_ascend_ops_module()
    row = next(r for r in npu_shim.status() if r["name"] == "vllm.mm_encoder_attn")
    if row["state"] != "applied":
        raise SystemExit("vllm.mm_encoder_attn is %s here: %s" % (row["state"], row["reason"]))
    spec = importlib.util.spec_from_file_location("bench_upstream_mm_encoder_attention",
                                                  patched.__file__)
    upstream = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(upstream)
    return patched, upstream, row


class KernelClock:
    """Accumulates the thread CPU time spent inside the emulated torch_npu ops
    (device work on an NPU). Thread CPU time, not wall time, so that other
    processes on the machine do not count."""

    def __init__(self):
        self.seconds = 0.0

    @contextlib.contextmanager
    def installed(self):
        import torch_npu

        originals = {name: getattr(torch_npu, name) for name in NPU_OPS}

        def timed(op):
            def call(*args, **kwargs):
                started = time.thread_time()
                try:
                    return op(*args, **kwargs)
                finally:
                    self.seconds += time.thread_time() - started
            return call

        for name, op in originals.items():
            setattr(torch_npu, name, timed(op))
        try:
            yield self
        finally:
            for name, op in originals.items():
                setattr(torch_npu, name, op)


def build_tower(cls):
    from vllm.config import DeviceConfig, VllmConfig, set_current_vllm_config

    with set_current_vllm_config(VllmConfig(device_config=DeviceConfig(device="cpu"))):
        return [cls(num_heads=HEADS, head_size=HEAD_DIM, prefix="visual.blocks.%d.attn" % i)
                for i in range(LAYERS)]


def measure(towers, q, k, v, make_cu, repeats):
    """Per tower: median thread CPU seconds per forward, total and host-only (total
    minus the emulated kernels). The towers take turns forward by forward, so slow
    phases of the machine hit them alike."""
    clock = KernelClock()
    totals = {name: [] for name in towers}
    hosts = {name: [] for name in towers}
    with clock.installed():
        for _ in range(repeats):
            for name, tower in towers.items():
                cu = make_cu()  # a new cu_seqlens per forward, as vLLM builds one per batch
                clock.seconds = 0.0
                started = time.thread_time()
                for layer in tower:
                    layer.forward_oot(q, k, v, cu)
                total = time.thread_time() - started
                totals[name].append(total)
                hosts[name].append(total - clock.seconds)
    return {name: (statistics.median(totals[name]), statistics.median(hosts[name]))
            for name in towers}


def count_syncs(tower, q, k, v, make_cu):
    """Host syncs of one forward. A cu_seqlens tensor stands in for a device tensor; with
    cu_seqlens=None every tensor the layers build counts as a device tensor, because
    upstream 0.13 builds the uniform lengths on query.device (the NPU)."""
    from npu_shim.testing import count_host_syncs

    cu = make_cu()
    counter = (count_host_syncs(device_tensors=[cu]) if cu is not None
               else count_host_syncs(cpu_is_device=True))
    with counter as syncs:
        for layer in tower:
            layer.forward_oot(q, k, v, cu)
    return syncs.count


def check_outputs(patched_tower, upstream_tower, q, k, v, cum, cu):
    """Both towers agree with the float64 reference on these inputs (first layer each)."""
    from npu_shim.testing import attention_f64

    bsz, seq = q.shape[:2]
    flat = [x.reshape(bsz * seq, HEADS, HEAD_DIM) for x in (q, k, v)]
    ref = attention_f64(*flat, cum).reshape(q.shape)
    errors = [(tower[0].forward_oot(q, k, v, cu).double() - ref).abs().max().item()
              for tower in (upstream_tower, patched_tower)]
    if max(errors) > 1e-4:
        raise SystemExit("outputs disagree with the float64 reference: %r" % errors)
    return errors


def scenarios(images, torch):
    """(name, q, k, v, cum, make_cu): the images packed with a cu_seqlens tensor, and
    the same count of images padded to one size in a batch with cu_seqlens=None."""
    from npu_shim.testing import dense_segments

    gen = torch.Generator().manual_seed(0)
    cum = dense_segments(images)
    packed = [torch.randn(1, cum[-1], HEADS, HEAD_DIM, generator=gen) for _ in range(3)]
    side = max(images)
    uniform = [torch.randn(len(images), side, HEADS, HEAD_DIM, generator=gen) for _ in range(3)]
    return [
        ("packed, cu_seqlens tensor", *packed, cum, lambda: torch.tensor(cum, dtype=torch.int32)),
        ("batch %dx%d, cu_seqlens=None" % (len(images), side), *uniform,
         dense_segments([side] * len(images)), lambda: None),
    ]


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=60, help="forwards per tower")
    parser.add_argument("--images", default="4,1,9,2",
                        help="comma-separated tokens per image (host-bound: keep them small)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)

    patched_module, upstream_module, row = load_modules()
    import torch

    torch.set_num_threads(args.threads)
    images = [int(x) for x in args.images.split(",")]
    print("bench_mm_encoder: one vision-encoder forward, %d x AscendMMEncoderAttention "
          "(%d heads x %d), images of %s tokens, float32, %d thread(s)"
          % (LAYERS, HEADS, HEAD_DIM, "/".join(map(str, images)), args.threads))
    print("stack: vllm-ascend %s, emulated torch_npu on CPU; median of %d forwards"
          % (row["versions"]["vllm-ascend"], args.repeats))
    header = "%-30s %-24s %9s %10s %11s %10s" % ("inputs", "SoC: tower (kernel)", "syncs/fwd",
                                               "cpu ms/fwd", "host ms/fwd", "host ratio")
    print()
    print(header)
    print("-" * len(header))
    ratios = []
    for soc in ("Ascend910B1", "Ascend310P3"):
        os.environ["NPU_SHIM_EMULATE_SOC"] = soc
        upstream_tower = build_tower(upstream_module.AscendMMEncoderAttention)
        patched_tower = build_tower(patched_module.AscendMMEncoderAttention)
        towers = {"upstream": upstream_tower, "patched": patched_tower}
        kernels = {"upstream": "unpad", "patched": patched_tower[0].npu_shim_kernel.varlen.backend}
        for label, q, k, v, cum, make_cu in scenarios(images, torch):
            check_outputs(patched_tower, upstream_tower, q, k, v, cum, make_cu())
            measure(towers, q, k, v, make_cu, 3)  # warm-up
            timings = measure(towers, q, k, v, make_cu, args.repeats)
            ratio = timings["patched"][1] / timings["upstream"][1]
            ratios.append((soc, label, ratio))
            for name, tower in towers.items():
                total, host = timings[name]
                print("%-30s %-24s %9d %10.2f %11.2f %10s" % (
                    label, "%s: %s (%s)" % (soc[6:], name, kernels[name]),
                    count_syncs(tower, q, k, v, make_cu), total * 1e3, host * 1e3,
                    "%.2fx" % ratio if name == "patched" else "1.00x"))
    os.environ.pop("NPU_SHIM_EMULATE_SOC", None)
    print()
    print("host ratio = patched host ms / upstream host ms, goal <= 0.80x:")
    for soc, label, ratio in ratios:
        print("  %-12s %-30s %.2fx%s" % (soc, label, ratio, "" if ratio <= 0.8 else "  (above goal)"))
    print("cpu ms = thread CPU time of the forward; host ms = cpu ms minus the time inside the "
          "emulated torch_npu ops (device work on an NPU).")
    print("On an NPU each upstream sync also waits for the queued kernels: not visible here.")
    print("reproduce: %s" % REPRODUCE)


if __name__ == "__main__":
    main()
