"""Host cost of one vision-encoder forward: upstream vllm-ascend forward_oot vs the patch.

Side by side in one process: 27 layers of vllm-ascend's real
``AscendMMEncoderAttention`` (a Qwen2.5/3-VL-sized tower: 16 heads of 80), once
as upstream ships it (the upstream file loaded under a second module name, so
the shim does not touch it) and once patched by ``vllm.mm_encoder_attn`` with
the family that applies to the installed release, on host-bound sizes (a few
small images: the kernels have almost nothing to do, so what is measured is
what the host does around them). Inputs: the images packed into one sequence
with a ``cu_seqlens`` tensor (MoonViT style), the same with host
``sequence_lengths`` from ``maybe_compute_seq_lens`` where the release has it
(Qwen3-VL style), and a uniform batch with ``cu_seqlens=None`` (Hunyuan-OCR
style). Device classes: A2/A3 through ``AscendMMEncoderAttention``; 310P through
the same class where it serves 310P (vllm-ascend 0.13.0, 0.15.0rc1-0.17.0rc1) and
through the separate ``AscendMMEncoderAttention310`` (patch
``vllm.mm_encoder_attn_310p``) where vllm-ascend registers it (0.14.0rc1, 0.18.0+),
with the emulated SoC Ascend310P3. Both towers call the same op in every release
(upstream's).

Run it in each lane (the lane's python); it ends with one ``ROW`` line per
device class and input, for the release x device class table.

Printed per forward:

* host syncs (``npu_shim.testing.count_host_syncs``, ``cu_seqlens`` as a device
  stand-in): upstream copies it to the host in every layer;
* host time: thread CPU time of the forward minus the time spent inside the
  emulated torch_npu ops (on an NPU those are queued kernels, not host work),
  median of repeated forwards, upstream and patched taking turns; and the
  patched/upstream ratio.

The CPU run cannot show the larger cost of an NPU sync -- a device->host copy
waits until all queued device work has finished, idling the NPU between layers
-- so the ratio here is what the host saves even before that.

From a fresh clone, in every vllm-ascend lane's venv one after another (made if missing):

    nox -s "bench(mm_encoder)"
"""
import argparse
import contextlib
import importlib
import inspect
import importlib.util
import os
import statistics
import time

LAYERS = 27
HEADS, HEAD_DIM = 16, 80
TARGET = "vllm_ascend.ops.mm_encoder_attention"
TARGET_310P = "vllm_ascend._310p.ops.mm_encoder_attention"
NPU_OPS = ("npu_fusion_attention", "_npu_flash_attention_unpad", "npu_fused_infer_attention_score")
REPRODUCE = 'nox -s "bench(mm_encoder)"'   # every vllm-ascend lane, one after another


# (patch, target module, class): the main class, and the separate 310P class of
# vllm-ascend 0.14.0rc1 and 0.18.0+ (measured with the emulated SoC Ascend310P3).
CLASSES = (
    ("vllm.mm_encoder_attn", TARGET, "AscendMMEncoderAttention"),
    ("vllm.mm_encoder_attn_310p", TARGET_310P, "AscendMMEncoderAttention310"),
)


def load_modules():
    """``[(row, patched class, upstream class)]`` for each class whose patch applied here.

    Upstream: the same file loaded a second time under another module name, which the
    shim does not watch. ``vllm_ascend/ops/__init__.py`` imports compiled Ascend ops;
    it is not run: an empty package module with the real ``__path__`` stands for
    ``vllm_ascend.ops`` (npu_shim.testing.isolation).
    """
    os.environ["VLLM_PLUGINS"] = ""
    import npu_shim
    from npu_shim import emulation

    emulation.install()
    npu_shim.install()
    from npu_shim.testing.isolation import import_vllm_ascend_module

    found = []
    for patch, target, class_name in CLASSES:
        try:
            patched = import_vllm_ascend_module(target)
        except ImportError:
            continue            # no 310P module in this release
        row = next(r for r in npu_shim.status() if r["name"] == patch)
        if row["state"] != "applied":
            print("%s: %s (%s)" % (patch, row["state"], row["reason"]))
            continue
        spec = importlib.util.spec_from_file_location(
            "bench_upstream_" + target.replace(".", "_"), patched.__file__)
        upstream = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(upstream)
        found.append((row, getattr(patched, class_name), getattr(upstream, class_name)))
    if not found:
        raise SystemExit("no MMEncoderAttention patch applies here")
    return found


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
                inputs = make_cu()  # new lengths per forward, as vLLM builds them per batch
                clock.seconds = 0.0
                started = time.thread_time()
                for layer in tower:
                    layer.forward_oot(q, k, v, *inputs)
                total = time.thread_time() - started
                totals[name].append(total)
                hosts[name].append(total - clock.seconds)
    return {name: (statistics.median(totals[name]), statistics.median(hosts[name]))
            for name in towers}


def count_syncs(tower, q, k, v, make_cu, uniform_on_device):
    """Host syncs of one forward. A cu_seqlens tensor stands in for a device tensor. With
    cu_seqlens=None: upstream 0.13.0/0.14.0rc1 build the uniform lengths on query.device
    (the NPU), so every tensor the layers build counts as a device tensor
    (``uniform_on_device``); later releases build them on the host, so only q/k/v count."""
    from npu_shim.testing import count_host_syncs

    inputs = make_cu()
    if inputs[0] is not None:
        counter = count_host_syncs(device_tensors=[inputs[0]])
    elif uniform_on_device:
        counter = count_host_syncs(cpu_is_device=True)
    else:
        counter = count_host_syncs(device_tensors=[q, k, v])
    with counter as syncs:
        for layer in tower:
            layer.forward_oot(q, k, v, *inputs)
    return syncs.count


def check_outputs(patched_tower, upstream_tower, q, k, v, cum, inputs):
    """Both towers agree with the float64 reference on these inputs (first layer each)."""
    from npu_shim.testing import attention_f64

    bsz, seq = q.shape[:2]
    flat = [x.reshape(bsz * seq, HEADS, HEAD_DIM) for x in (q, k, v)]
    ref = attention_f64(*flat, cum).reshape(q.shape)
    errors = [(tower[0].forward_oot(q, k, v, *inputs).double() - ref).abs().max().item()
              for tower in (upstream_tower, patched_tower)]
    if max(errors) > 1e-4:
        raise SystemExit("outputs disagree with the float64 reference: %r" % errors)
    return errors


def scenarios(images, torch, cls):
    """(name, q, k, v, cum, make_inputs): make_inputs() gives forward_oot's arguments after
    q, k, v: the images packed with a cu_seqlens tensor; the same with host
    sequence_lengths where the class computes them (0.18.0+); the same count of images
    padded to one size in a batch with cu_seqlens=None."""
    import numpy as np

    from npu_shim.testing import dense_segments

    gen = torch.Generator().manual_seed(0)
    cum = dense_segments(images)
    packed = [torch.randn(1, cum[-1], HEADS, HEAD_DIM, generator=gen) for _ in range(3)]
    side = max(images)
    uniform = [torch.randn(len(images), side, HEADS, HEAD_DIM, generator=gen) for _ in range(3)]
    out = [("packed, cu_seqlens tensor", *packed, cum,
            lambda: (torch.tensor(cum, dtype=torch.int32),))]
    if "maybe_compute_seq_lens" in vars(cls):
        def with_host_lengths():
            lengths = cls.maybe_compute_seq_lens(None, np.array(cum, dtype=np.int32), "cpu")
            return torch.tensor(cum, dtype=torch.int32), None, lengths
        out.append(("packed, host sequence_lengths", *packed, cum, with_host_lengths))
    out.append(("batch %dx%d, cu_seqlens=None" % (len(images), side), *uniform,
                dense_segments([side] * len(images)), lambda: (None,)))
    return out


def op_names(tower, q, k, v, inputs):
    from npu_shim.testing import record_npu_calls

    with record_npu_calls() as calls:
        tower[0].forward_oot(q, k, v, *inputs)
    return "/".join(sorted({c.name for c in calls}))


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=60, help="forwards per tower")
    parser.add_argument("--images", default="4,1,9,2",
                        help="comma-separated tokens per image (host-bound: keep them small)")
    parser.add_argument("--threads", type=int, default=1, help="torch intra-op threads")
    args = parser.parse_args(argv)

    found = load_modules()
    release = found[0][0]["versions"]["vllm-ascend"]
    import torch

    torch.set_num_threads(args.threads)
    images = [int(x) for x in args.images.split(",")]
    print("bench_mm_encoder: one vision-encoder forward, %d x MMEncoderAttention "
          "(%d heads x %d), images of %s tokens, float32, %d thread(s)"
          % (LAYERS, HEADS, HEAD_DIM, "/".join(map(str, images)), args.threads))
    print("stack: vllm-ascend %s, %s, emulated torch_npu on CPU; median of %d forwards"
          % (release, ", ".join("%s family %s" % (row["name"], row["family"]) for row, _, _ in found),
             args.repeats))
    header = "%-30s %-34s %9s %10s %11s %10s" % ("inputs", "SoC: tower (NPU op)", "syncs/fwd",
                                               "cpu ms/fwd", "host ms/fwd", "host ratio")
    print()
    print(header)
    print("-" * len(header))
    ratios, rows = [], []
    for row, patched_cls, cls in found:
        uniform_on_device = "device=query.device" in inspect.getsource(cls.forward_oot)
        if row["name"] == "vllm.mm_encoder_attn_310p":
            socs = ["Ascend310P3"]
        elif row["name"] == "vllm.mm_encoder_attn" and release.startswith(("0.13", "0.15", "0.16", "0.17")):
            socs = ["Ascend910B1", "Ascend310P3"]  # no separate 310P class in 0.13, 0.15-0.17
        else:
            socs = ["Ascend910B1"]
        for soc in socs:
            os.environ["NPU_SHIM_EMULATE_SOC"] = soc
            upstream_tower = build_tower(cls)
            patched_tower = build_tower(patched_cls)
            towers = {"upstream": upstream_tower, "patched": patched_tower}
            for label, q, k, v, cum, make_cu in scenarios(images, torch, cls):
                check_outputs(patched_tower, upstream_tower, q, k, v, cum, make_cu())
                kernels = {name: op_names(tower, q, k, v, make_cu()) for name, tower in towers.items()}
                measure(towers, q, k, v, make_cu, 3)  # warm-up
                timings = measure(towers, q, k, v, make_cu, args.repeats)
                ratio = timings["patched"][1] / timings["upstream"][1]
                ratios.append((soc, label, ratio))
                syncs = {}
                for name, tower in towers.items():
                    total, host = timings[name]
                    syncs[name] = count_syncs(tower, q, k, v, make_cu, uniform_on_device)
                    print("%-30s %-34s %9d %10.2f %11.2f %10s" % (
                        label, "%s: %s (%s)" % (soc[6:], name, kernels[name]),
                        syncs[name], total * 1e3, host * 1e3,
                        "%.2fx" % ratio if name == "patched" else "1.00x"))
                rows.append("ROW vllm-ascend %s | %s | %s family %s | %s | copies per %d-layer "
                            "forward upstream/patched %d/%d | host time patched/upstream %.2fx"
                            % (release, "310P" if "310P" in soc else "A2/A3", row["name"],
                               row["family"], label, LAYERS, syncs["upstream"], syncs["patched"],
                               ratio))
    os.environ.pop("NPU_SHIM_EMULATE_SOC", None)
    print()
    print("host ratio = patched host ms / upstream host ms (reported; on CPU a copy of a host "
          "tensor costs little, so no target here):")
    for soc, label, ratio in ratios:
        print("  %-12s %-30s %.2fx" % (soc, label, ratio))
    print("cpu ms = thread CPU time of the forward; host ms = cpu ms minus the time inside the "
          "emulated torch_npu ops (device work on an NPU).")
    print("On an NPU each upstream sync also waits for the queued kernels: not visible here.")
    print("reproduce: %s" % REPRODUCE)
    print()
    for line in rows:
        print(line)


if __name__ == "__main__":
    main()
