"""The CPU host-sync counter against a real GPU: the same forwards counted by
``npu_shim.testing.count_host_syncs`` on CPU (stand-in device tensors, as the tests count) and
by CUDA's own sync-debug mode on a CUDA device (``npu_shim.testing.cuda_syncs``), upstream vs
shim, side by side.

    python benchmarks/bench_cuda_syncs.py [--cases calibration,mm_encoder,towers,census,ops] [--out FILE]

Run in lane latest-vllm's (or latest-vllm-py3.12's) venv, on a machine with a CUDA GPU; without
CUDA it prints the CPU counts only (a dry run). Each case builds its inputs twice, on the CPU
(stand-ins for device tensors, exactly as the tests and ``bench_towers`` / ``bench_census``
mark them) and on ``cuda``, and runs the same code on both. Per forward it prints:

* ``cpu``: the CPU counter, device->host reads + blocking host->device copies (CUDA reports
  both kinds: a blocking copy to the device synchronises the stream);
* ``ctr@cuda``: the same counter over the CUDA run (real device tensors, no stand-ins);
* ``cuda``: the synchronisations CUDA reported (``torch.cuda.set_sync_debug_mode("warn")``),
  with the emulated torch_npu op bodies silenced (they stand in for device kernels; a CUDA
  tensor passed where torch_npu reads host data is read back at the call and counted);
* ``=``: whether ``cpu`` and ``cuda`` agree in total and site by site (``dir/file.py:line``); a
  disagreement lists the sites of each side.

What stands in, besides the emulated torch_npu ops: vLLM's platform is its ``UnspecifiedPlatform``
on both sides (the one the CPU lanes get; vLLM's CUDA platform needs the compiled ``vllm._C``
the lanes' thin wheel leaves out), triton is hidden from vLLM (the lanes do not install it;
``--with-triton`` lets it import), and everything else is as in ``npu_shim.testing.towers``
(read its docstring).

Case ``ops`` calls each emulated op on CUDA tensors with host lengths and the sync-debug mode on
inside the body: which of the emulation's own bodies synchronise on CUDA (a real NPU kernel
launch would not).
"""
import argparse
import contextlib
import os
import platform
import sys
from collections import Counter

os.environ.setdefault("VLLM_PLUGINS", "")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

HEADS, HEAD_DIM, LAYERS = 16, 80, 27
IMAGES = [4, 1, 9, 2]
CASES = ("calibration", "mm_encoder", "towers", "census", "ops")


class Result:
    def __init__(self, case, side, forward, cpu, cuda, ctr, error=None, split=None):
        self.case, self.side, self.forward = case, side, forward
        self.split = split                                  # (reads, blocking copies) of the CPU counter
        self.cpu, self.cuda, self.ctr = cpu, cuda, ctr      # Counter(site) or None
        self.error = error                                  # why the case did not run to the end

    def agree(self):
        return self.cuda is not None and self.cpu == self.cuda


def _cpu_sites(syncs):
    """The CPU counter's events (reads and blocking copies) as Counter('site')."""
    return Counter([e.location for e in syncs.events] + [e.location for e in syncs.h2d_events])


def _cuda_sites(counter):
    return Counter(e.location for e in counter.events)


def _total(sites):
    return "-" if sites is None else str(sum(sites.values()))


def _pin_platform():
    """vLLM's UnspecifiedPlatform, as on the CPU lanes (declared in the module docstring).

    ``import vllm`` resolves the platform itself (``vllm.utils.torch_utils`` asks for pinned
    memory at import), through NVML: on a GPU machine its CUDA platform, which imports the
    compiled ``vllm._C_stable_libtorch`` the thin wheel leaves out. So vLLM's NVML module
    (``vllm.third_party.pynvml``) is a stand-in whose ``nvmlInit`` raises: vLLM then finds no
    platform plugin and takes ``UnspecifiedPlatform``, as on a CPU machine."""
    import types

    if "vllm" not in sys.modules:
        nvml = types.ModuleType("vllm.third_party.pynvml")

        def no_nvml(*args, **kwargs):
            raise RuntimeError("npu-shim bench_cuda_syncs: NVML hidden, vLLM stays on UnspecifiedPlatform")
        def attribute(name):
            if name.startswith("nvml"):
                return no_nvml
            raise AttributeError(name)
        nvml.__getattr__ = attribute
        sys.modules["vllm.third_party.pynvml"] = nvml
    import vllm.platforms as platforms

    name = type(platforms.current_platform).__name__
    if name != "UnspecifiedPlatform":
        raise SystemExit("vLLM's platform is %s, not UnspecifiedPlatform" % name)


@contextlib.contextmanager
def _nothing():
    yield


def _fresh_rope():
    """vLLM caches rotary embeddings process-wide (``get_rope``'s ``_ROPE_DICT``): a tower moved
    to CUDA would move the rope a later CPU tower shares. Each build gets its own, as in a fresh
    process."""
    from vllm.model_executor.layers import rotary_embedding

    getattr(rotary_embedding, "_ROPE_DICT", {}).clear()


class Runner:
    """Runs one forward on CPU with the stand-in counter and on CUDA with both counters."""

    def __init__(self, cuda):
        self.cuda = cuda
        self.results = []

    def measure(self, case, side, forward, make, rounds=1):
        """``make(device)`` -> (run, device_tensors, device_modules, context): run() is one
        forward; ``device`` is "cpu" (stand-ins: device_tensors / device_modules) or "cuda".
        ``rounds``: forwards of the same built objects, counted one by one. A case that
        raises is reported with its error; the others run."""
        try:
            self._measure(case, side, forward, make, rounds)
        except Exception as exc:        # noqa: BLE001 (reported in the table, never hidden)
            import traceback

            traceback.print_exc()
            self.results.append(Result(case, side, forward, None, None, None,
                                       "%s: %s" % (type(exc).__name__, str(exc).splitlines()[0] if str(exc) else "")))
        last = self.results[-1]
        print("  measured %s %s: cpu %s, cuda %s" % (case, side, _total(last.cpu), _total(last.cuda)), flush=True)

    def _measure(self, case, side, forward, make, rounds):
        from npu_shim.testing import count_host_syncs

        cpu, split = [], []
        run, tensors, modules, context = make("cpu")
        with context():
            for _ in range(rounds):
                with count_host_syncs(device_tensors=tensors, device_modules=modules) as syncs:
                    run()
                cpu.append(_cpu_sites(syncs))
                split.append((syncs.count, syncs.h2d_count))
        cudas, ctrs = [None] * rounds, [None] * rounds
        if self.cuda:
            from npu_shim.testing.cuda_syncs import count_cuda_syncs

            import torch

            run, tensors, modules, context = make("cuda")
            with context():
                for i in range(rounds):
                    torch.cuda.synchronize()
                    with count_cuda_syncs() as counter:
                        run()
                    cudas[i] = _cuda_sites(counter)
            # the CPU counter over CUDA tensors: a fresh build, the same rounds
            run, tensors, modules, context = make("cuda")
            with context():
                for i in range(rounds):
                    with count_host_syncs() as syncs:
                        run()
                    ctrs[i] = _cpu_sites(syncs)
        for i in range(rounds):
            self.results.append(Result(case, side, forward + i, cpu[i], cudas[i], ctrs[i], split=split[i]))


# ------------------------------------------------------------------------------- calibration


def calibration(runner):
    """Single operations whose answer is known: what each counter says of them."""
    import torch

    from npu_shim.testing.syncs import DEVICE

    def op(body):
        def make(device):
            place = DEVICE if device == "cpu" else torch.device(device)
            t = torch.arange(12, dtype=torch.int32)
            if device == "cuda":
                t = t.cuda()
            return (lambda: body(t, place)), ([t] if device == "cpu" else []), (), _nothing
        return make

    items = {
        "t[3].item()": lambda t, d: t[3].item(),
        "t.tolist()": lambda t, d: t.tolist(),
        "t.cpu()": lambda t, d: t.cpu(),
        "t.to('cpu', non_blocking=True)": lambda t, d: t.to("cpu", non_blocking=True),
        "int(t.sum())": lambda t, d: int(t.sum()),
        "t.nonzero()": lambda t, d: t.nonzero(),
        "t[t > 5]": lambda t, d: t[t > 5],
        "t.repeat_interleave(t)": lambda t, d: t.repeat_interleave(t),
        "torch.equal(t, t.clone())": lambda t, d: torch.equal(t, t.clone()),
        "t.reshape(t[2], t[6])  (two device sizes, one call)": lambda t, d: t.reshape(t[2], t[6]),
        "t[torch.arange(3)]  (host index into a device tensor)": lambda t, d: t[torch.arange(3)],
        "torch.arange(t[3]).to(d)  (arange of a device scalar)": lambda t, d: torch.arange(t[3]).to(d),
        "torch.tensor([1, 2], device=d)": lambda t, d: torch.tensor([1, 2], device=d),
        "torch.tensor([1, 2]).to(d, non_blocking=True)": lambda t, d: torch.tensor([1, 2]).to(d, non_blocking=True),
        "t + 1": lambda t, d: t + 1,
    }
    for name, body in items.items():
        runner.measure("calibration: %s" % name, "-", 0, op(body))


# ------------------------------------------------------------------------------- mm_encoder


def mm_encoder(runner):
    """27 layers of vllm-ascend's AscendMMEncoderAttention (16 heads of 80), upstream vs the
    shim's patch, images of 4/1/9/2 tokens packed with a cu_seqlens tensor on the device, and a
    uniform batch with cu_seqlens=None; A2 (FIA) and 310P (unpad)."""
    import torch
    from vllm.config import set_current_vllm_config

    from npu_shim.testing import dense_segments, towers

    stack = towers.setup()
    cum = dense_segments(IMAGES)
    side = max(IMAGES)
    for device_class in towers.DEVICE_CLASSES:
        towers.emulate_device_class(device_class)
        dtype = towers.hardware_dtype(device_class)
        for label, cls in (("upstream", stack.upstream[device_class]), ("shim", stack.attention[device_class])):
            with set_current_vllm_config(stack.config):
                layers = [cls(num_heads=HEADS, head_size=HEAD_DIM, prefix="visual.blocks.%d.attn" % i)
                          for i in range(LAYERS)]
            for scenario in ("packed", "batch"):
                def make(device, scenario=scenario, layers=layers):
                    gen = torch.Generator().manual_seed(0)
                    if scenario == "packed":
                        shape, cu = (1, cum[-1], HEADS, HEAD_DIM), torch.tensor(cum, dtype=torch.int32)
                    else:
                        shape, cu = (len(IMAGES), side, HEADS, HEAD_DIM), None
                    q, k, v = (torch.randn(shape, generator=gen).to(dtype) for _ in range(3))
                    if device == "cuda":
                        q, k, v = q.cuda(), k.cuda(), v.cuda()
                        cu = cu.cuda() if cu is not None else None
                    stand_ins = [cu] if cu is not None else [q, k, v]

                    def run():
                        for layer in layers:
                            layer.forward_oot(q, k, v, cu)
                    return run, stand_ins, (), _nothing
                name = "mm_encoder %s %s: %d layers" % (device_class, "cu_seqlens tensor" if scenario == "packed"
                                                         else "cu_seqlens=None", LAYERS)
                runner.measure(name, label, 0, make)
    os.environ.pop("NPU_SHIM_EMULATE_SOC", None)


# ------------------------------------------------------------------------------- towers


def vllm_towers(runner, device_classes):
    """vLLM's Qwen2.5-VL, Qwen3-VL, GLM-4.1V (bench_towers' way) and Kimi-VL's MoonViT
    (vLLM's batching of its inputs counted with the forward), two forwards each."""
    import torch

    from npu_shim.testing import towers
    from npu_shim.testing.syncs import DEVICE

    stack = towers.setup()
    for device_class in device_classes:
        towers.emulate_device_class(device_class)
        for name in towers.TOWERS:
            for label, cls in (("upstream", stack.upstream[device_class]), ("shim", stack.attention[device_class])):
                def make(device, name=name, cls=cls, label=label):
                    _fresh_rope()
                    tower = towers.build_tower(stack, name, cls)
                    xs = [towers.pixel_values(tower, towers.grids(f), seed=f) for f in range(2)]
                    if device == "cuda":
                        tower = tower.cuda()
                        xs = [x.cuda() for x in xs]
                    state = {"forward": 0}

                    def run():
                        f = state["forward"]
                        state["forward"] += 1
                        tower(xs[f], grid_thw=towers.grids(f))

                    @contextlib.contextmanager
                    def context():
                        code = towers.upstream_code(stack, name) if label == "upstream" else _nothing()
                        with torch.inference_mode(), towers.registered(cls), code:
                            yield
                    return run, xs, [tower], context
                runner.measure("tower %s %s" % (name, device_class), label, 0, make, rounds=2)
        for label, cls in (("upstream", stack.upstream[device_class]), ("shim", stack.attention[device_class])):
            def make(device, cls=cls, label=label):
                _fresh_rope()
                tower = towers.build_moonvit(stack, cls)
                xs = [towers.moonvit_pixel_values(tower, towers.moonvit_grid(f), seed=f) for f in range(2)]
                place = DEVICE
                if device == "cuda":
                    tower = tower.cuda()
                    place = torch.device("cuda")
                    tower.encoder.rope_2d.device = place
                state = {"forward": 0}

                def run():
                    f = state["forward"]
                    state["forward"] += 1
                    pixels, grid_hws = towers.kimi_vl_batch(stack, xs[f], towers.moonvit_grid(f), device=place,
                                                            upstream_fields=label == "upstream")
                    tower(pixels, grid_hws)

                @contextlib.contextmanager
                def context():
                    with torch.inference_mode(), towers.registered(cls):
                        yield
                return run, (), [tower], context
            runner.measure("tower Kimi-VL %s" % device_class, label, 0, make, rounds=2)
    os.environ.pop("NPU_SHIM_EMULATE_SOC", None)


def _on_device(spec, arg, device):
    """The census tower's grid argument with what vLLM has on the device moved there (CUDA)
    or marked (CPU: the stand-ins list). Returns (arg, stand-ins)."""
    import torch

    from npu_shim.testing import census

    if getattr(spec, "device_args", None) is not None:          # PaddleOCR-VL's inputs
        if isinstance(arg, census._Images):                      # per image (0.26.0, 0.30.0)
            if device == "cuda":
                arg = census._Images(grid=arg.grid.cuda(), sizes=arg.sizes)
            return arg, list(spec.device_args(arg))
        if not spec.device_args(arg):                            # the grid kept on the host (0.33.0)
            return arg, []
        if device == "cuda":
            arg = arg.cuda()
        return arg, [arg]
    if not spec.grid_on_device:
        return arg, []
    if isinstance(arg, tuple):
        if device == "cuda":
            arg = tuple(a.cuda() for a in arg)
        return arg, list(arg)
    if device == "cuda" and isinstance(arg, torch.Tensor):
        arg = arg.cuda()
    return arg, [arg]


def census_towers(runner, device_classes):
    """Every tower of npu_shim.testing.census, called the way its vLLM model calls it."""
    import torch

    from npu_shim.testing import census, towers

    stack = census.setup()
    for device_class in device_classes:
        towers.emulate_device_class(device_class)
        for name, spec in census.CENSUS.items():
            if name in census.UNIMPORTABLE or name not in census._MODULES:
                print("census %s: not measured (%s)" % (name, census.UNIMPORTABLE.get(name, "no module")))
                continue
            for label, cls in (("upstream", stack.upstream[device_class]), ("shim", stack.attention[device_class])):
                def make(device, name=name, spec=spec, cls=cls):
                    _fresh_rope()
                    tower = census.build(stack, name, cls, dtype=towers.hardware_dtype(device_class))
                    xs = [census.pixel_values(name, tower, census.grids(f, name), seed=f) for f in range(2)]
                    args, stand_ins = [], []
                    if device == "cuda":
                        tower = tower.cuda()
                        xs = [x.cuda() for x in xs]
                    for f in range(2):
                        arg, marked = _on_device(spec, spec.grid_arg(census.grids(f, name)), device)
                        args.append(arg)
                        stand_ins += marked
                    state = {"forward": 0}

                    def run():
                        f = state["forward"]
                        state["forward"] += 1
                        spec.call(tower, xs[f], args[f])

                    @contextlib.contextmanager
                    def context():
                        with torch.inference_mode(), towers.registered(cls):
                            yield
                    return run, xs + stand_ins, [tower], context
                runner.measure("census %s %s" % (name, device_class), label, 0, make, rounds=2)
    os.environ.pop("NPU_SHIM_EMULATE_SOC", None)


# ------------------------------------------------------------------------------- emulated ops


def emulated_ops(lines):
    """Each emulated op on CUDA tensors, host lengths, the sync-debug mode on in the body."""
    import torch

    from npu_shim import emulation
    from npu_shim.testing.cuda_syncs import count_cuda_syncs

    emulation.install()
    import torch_npu

    n, d, dt = 2, 64, torch.bfloat16     # 64: a head dim the TND layout takes (emulation checks it)
    c = "cuda"
    q7 = torch.randn(7, n, d, dtype=dt, device=c)
    qb = torch.randn(2, 4, n, d, dtype=dt, device=c)
    mask = torch.ones(2048, 2048, dtype=torch.bool, device=c).triu_(1)
    seq_len = torch.tensor([3, 4], dtype=torch.int32)
    caches = [torch.zeros(4, 4, n, d, dtype=dt, device=c) for _ in range(2)]
    slots = torch.tensor([0, 1, 2, 5, 6, -1, 9], dtype=torch.int32, device=c)
    target, indices, updates = (torch.zeros(4, 3, dtype=dt, device=c), torch.tensor([[1], [3]], device=c),
                                torch.ones(2, 3, dtype=dt, device=c))
    calls = {
        "_npu_flash_attention_unpad (seq_len host tensor)": lambda: torch_npu._npu_flash_attention_unpad(
            q7, q7, q7, seq_len, 0.25, n, n, torch.empty_like(q7)),
        "npu_fusion_attention TND": lambda: torch_npu.npu_fusion_attention(
            q7, q7, q7, n, "TND", scale=0.25, actual_seq_qlen=[3, 7], actual_seq_kvlen=[3, 7]),
        "npu_fusion_attention TND causal (sparse_mode=3, compressed mask)": lambda: torch_npu.npu_fusion_attention(
            q7, q7, q7, n, "TND", scale=0.25, atten_mask=mask, sparse_mode=3,
            actual_seq_qlen=[3, 7], actual_seq_kvlen=[3, 7]),
        "npu_fused_infer_attention_score TND": lambda: torch_npu.npu_fused_infer_attention_score(
            q7, q7, q7, num_heads=n, scale=0.25, input_layout="TND", actual_seq_lengths=[3, 7],
            actual_seq_lengths_kv=[3, 7]),
        "torch.ops.npu.npu_fused_infer_attention_score TND": lambda: torch.ops.npu.npu_fused_infer_attention_score(
            q7, q7, q7, num_heads=n, scale=0.25, input_layout="TND", actual_seq_lengths=[3, 7],
            actual_seq_lengths_kv=[3, 7]),
        "npu_prompt_flash_attention BSND": lambda: torch_npu.npu_prompt_flash_attention(
            qb, qb, qb, num_heads=n, scale_value=0.25, input_layout="BSND", actual_seq_lengths=[3, 4],
            actual_seq_lengths_kv=[3, 4]),
        "npu_incre_flash_attention BSND": lambda: torch_npu.npu_incre_flash_attention(
            qb[:, :1], qb, qb, num_heads=n, scale_value=0.25, input_layout="BSND", actual_seq_lengths=[3, 4]),
        "_npu_reshape_and_cache (device slots)": lambda: torch_npu._npu_reshape_and_cache(
            q7, q7, caches[0], caches[1], slots),
        "npu_scatter_nd_update_ (device indices)": lambda: torch_npu.npu_scatter_nd_update_(target, indices, updates),
    }
    lines.append("")
    lines.append("emulated torch_npu ops on CUDA, sync-debug mode on inside the body (syncs per call, where):")
    for name, call in calls.items():
        call()                                      # warm-up
        torch.cuda.synchronize()
        with count_cuda_syncs(silence_ops=False) as counter:
            call()
        where = "; ".join("%s x%d" % kv for kv in sorted(counter.op_sites().items())) or "-"
        lines.append("  %-66s %2d  %s" % (name, len(counter.op_events), where))
        if counter.events:
            lines.append("  %-66s     outside the body: %s" % ("", "; ".join(map(str, counter.events))))


# ------------------------------------------------------------------------------- report


def report(runner, lines):
    header = "%-66s %-8s %3s %5s %7s %8s %5s  %s" % ("case", "side", "fwd", "cpu", "(r+c)", "ctr@cuda", "cuda", "=")
    lines.append(header)
    lines.append("-" * len(header))
    disagree = []
    for r in runner.results:
        if r.error:
            lines.append("%-66s %-8s %3d  ERROR %s" % (r.case, r.side, r.forward, r.error))
            continue
        mark = "-" if r.cuda is None else ("yes" if r.agree() else "NO")
        lines.append("%-66s %-8s %3d %5s %7s %8s %5s  %s" % (
            r.case, r.side, r.forward, _total(r.cpu), "(%d+%d)" % r.split, _total(r.ctr), _total(r.cuda), mark))
        if r.cuda is not None and not r.agree():
            disagree.append(r)
    if disagree:
        lines.append("")
        lines.append("disagreements, site by site (cpu: the CPU counter's reads + blocking copies; cuda: CUDA's reports):")
        for r in disagree:
            lines.append("  %s, %s, forward %d:" % (r.case, r.side, r.forward))
            for site in sorted(set(r.cpu) | set(r.cuda)):
                if r.cpu[site] != r.cuda[site]:
                    lines.append("    %-90s cpu %d, cuda %d" % (site, r.cpu[site], r.cuda[site]))
    return disagree


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated, of: %s" % ", ".join(CASES))
    parser.add_argument("--device-classes", default="A2,310P")
    parser.add_argument("--out", help="also write the report to this file")
    parser.add_argument("--note", default="", help="a line on where the packages came from, for the header")
    parser.add_argument("--with-triton", action="store_true",
                        help="let vLLM import triton where installed (default: hidden, as on the CPU lanes, "
                             "which do not install it, so both runs take vLLM's same code paths)")
    args = parser.parse_args(argv)
    if not args.with_triton:
        sys.modules.setdefault("triton", None)      # import triton -> ImportError; find_spec -> None
    cases = args.cases.split(",")
    device_classes = args.device_classes.split(",")

    import torch

    cuda = torch.cuda.is_available()
    if any(c in cases for c in ("mm_encoder", "towers", "census")):
        _pin_platform()
    from importlib.metadata import version

    import datetime

    lines = ["ran %s UTC on %s, %d cores: python benchmarks/bench_cuda_syncs.py%s" % (
        datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M"), platform.system(), os.cpu_count() or 0,
        "".join(" " + a for a in (argv if argv is not None else sys.argv[1:]) if not a.startswith("--note")
                and a != args.note))]
    if args.note:
        lines.append(args.note)
    stack = ["torch %s" % torch.__version__, "Python %s" % platform.python_version()]
    for dist in ("vllm", "vllm-ascend", "transformers"):
        try:
            stack.append("%s %s" % (dist, version(dist)))
        except Exception:
            pass
    lines.append("bench_cuda_syncs: %s" % ", ".join(stack))
    lines.append("device: %s" % (torch.cuda.get_device_name(0) if cuda else "none (CPU counts only: a dry run)"))
    lines.append("cpu = CPU counter (stand-in device tensors): device->host reads + blocking host->device copies "
                 "(r+c: each); ctr@cuda = the same counter over the CUDA run (real device tensors); cuda = syncs "
                 "CUDA reported (set_sync_debug_mode('warn')), emulated op bodies silenced; = : cpu and cuda agree "
                 "site by site; per forward (fwd: 0, 1 = first, second forward of one built tower)")
    lines.append("")
    runner = Runner(cuda)
    if "calibration" in cases:
        calibration(runner)
    if "mm_encoder" in cases:
        mm_encoder(runner)
    if "towers" in cases:
        vllm_towers(runner, device_classes)
    if "census" in cases:
        census_towers(runner, device_classes)
    disagree = report(runner, lines)
    if "ops" in cases and cuda:
        emulated_ops(lines)
    text = "\n".join(lines)
    print(text)
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            handle.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
