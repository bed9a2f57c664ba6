"""Host cost of one CP prefill attention call (one layer), upstream vs the shim, on sglang 0.5.13 or 0.5.23.

On sglang 0.5.23 (lane latest-sglang; ``sglang.cp_fia_host_lengths`` applied),
side by side in one process: upstream's ``do_cp_attn_fia`` (the strategy
closure that calls ``.tolist()`` on the zigzag metadata's int32 tensors) and
the shim's (same strategy call, lengths from the metadata's host lists), both
ranks of cp_size 2 in turn, with sglang's ``ZigzagCPStrategy``,
``prepare_cp_forward`` and ``shard_hidden_states`` (see
tests/lanes/sglang_support/cp_strategy_case.py). Printed per layer: host syncs
(the metadata's tensors, q, caches, block table and mask as device
stand-ins) and host time (as below). On a CPU a ``.tolist()`` of a CPU tensor
costs microseconds; on an NPU each one waits for the device queue to drain,
which this machine cannot show: the sync count is the figure that carries over.

    nox -s "bench(cp_fia)"     (runs in the sglang-0.5.13 and latest-sglang venvs)

On sglang 0.5.13:

Side by side in one process on the sglang-0.5.13 lane: upstream's fixed
``AscendAttnBackend.do_cp_attn_fia`` (PR 26705) and the shim's replacement
(``sglang.cp_fia``, the method the shim installs on builds in the broken
window), on the same backend, layer, metadata and paged cache (built as in
npu_shim/testing/cp_case.py: real sglang metadata, ForwardBatch,
RadixAttention and block table), rank 0 of cp_size 2, for several batch sizes.

Printed per call:

* host syncs (``npu_shim.testing.count_host_syncs``; q, caches, block table and
  mask as device stand-ins): both should be 0 -- every length is a host list;
* host time: thread CPU time of the call minus the time inside the two emulated
  ``npu_fused_infer_attention_score`` calls (device work on an NPU), median of
  repeated calls, the two methods taking turns; and the shim/upstream ratio.
  The shim validates the lengths on the host before the op (the kernels
  layer's checks); the ratio says what that costs.

The broken-window builds, where the shim actually applies, cannot run the
upstream method at all (AttributeError), so 0.5.13's fixed method is the only
meaningful baseline.

    nox -s "bench(cp_fia)"      (from a fresh clone: makes or reuses the sglang-0.5.13 lane venv)
"""
import argparse
import importlib
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
REPRODUCE = 'nox -s "bench(cp_fia)"'   # the sglang-0.5.13 and latest-sglang venvs, emulated torch_npu
BATCHES = {1: (64,), 4: (40, 17, 33, 22), 16: tuple(12 + (7 * i) % 29 for i in range(16))}


def load_cp_case():
    from npu_shim.testing import cp_case

    return cp_case


class KernelClock:
    """Adds up thread CPU time inside ``npu_fused_infer_attention_score`` of ``namespace``
    (default ``torch.ops.npu``, the spelling both 0.5.13 methods use; 0.5.23 calls
    ``torch_npu.npu_fused_infer_attention_score``) by wrapping the attribute while active.
    Thread CPU time, so other processes on the machine do not count."""

    OP = "npu_fused_infer_attention_score"

    def __init__(self, namespace=None):
        self.seconds = 0.0
        self.namespace = namespace

    def __enter__(self):
        import torch

        if self.namespace is None:
            self.namespace = torch.ops.npu
        self.original = getattr(self.namespace, self.OP)

        def timed(*args, **kwargs):
            started = time.thread_time()
            try:
                return self.original(*args, **kwargs)
            finally:
                self.seconds += time.thread_time() - started

        setattr(self.namespace, self.OP, timed)
        return self

    def __exit__(self, *exc):
        setattr(self.namespace, self.OP, self.original)


def load_support():
    """npu_shim.testing.cp_case and tests/lanes/sglang_support's cp_strategy_case."""
    lanes = os.path.join(REPO, "tests", "lanes")
    if lanes not in sys.path:
        sys.path.insert(0, lanes)
    from sglang_support import cp_strategy_case

    from npu_shim.testing import cp_case

    return cp_case, cp_strategy_case


def time_methods(methods, call_args, repeats, clock):
    """Median (total, host) thread seconds per call of each method, the methods taking turns."""
    totals = {name: [] for name in methods}
    hosts = {name: [] for name in methods}
    with clock:
        for _ in range(repeats):
            for name, method in methods.items():
                clock.seconds = 0.0
                started = time.thread_time()
                method(*call_args)
                total = time.thread_time() - started
                if clock.seconds <= 0.0:
                    raise SystemExit("%s did not go through the timed op" % name)
                totals[name].append(total)
                hosts[name].append(total - clock.seconds)
    return {name: (statistics.median(totals[name]), statistics.median(hosts[name])) for name in methods}


def main_strategy(module, args):
    """sglang 0.5.23: upstream's strategy closure vs sglang.cp_fia_host_lengths, per layer."""
    import torch

    import npu_shim
    from npu_shim.patches.sglang import cp_fia_host_lengths as patch
    from npu_shim.testing import count_host_syncs

    cp_case, cp_strategy_case = load_support()
    cp_case.set_cpu_server_args()
    patched = module.AscendAttnBackend.__dict__["do_cp_attn_fia"]
    npu_shim.uninstall()
    upstream = module.AscendAttnBackend.__dict__["do_cp_attn_fia"]
    npu_shim.install()
    if hasattr(upstream, "__npu_shim_patch__") or getattr(patched, "__npu_shim_patch__", None) != patch.NAME:
        raise SystemExit("expected upstream's method and %s's on sglang 0.5.23" % patch.NAME)
    methods = {"upstream 0.5.23": upstream, "npu-shim": patched}
    print("bench_cp_fia (sglang 0.5.23): one do_cp_attn_fia call = one layer, cp_size 2, 8 heads over "
          "2 KV heads x 128, page 128, float32, emulated torch_npu on CPU, %d thread(s); median of %d"
          % (args.threads, args.repeats))
    print("%-4s %-5s %-16s %16s %14s %14s %8s" % ("bs", "rank", "method", "syncs per layer",
                                                "total ms/layer", "host ms/layer", "ratio"))
    for bs, lens in BATCHES.items():
        spec = cp_case.Spec(extend_lens=lens, page_size=128, num_heads=8, num_kv_heads=2,
                            qk_head_dim=128, v_head_dim=128, seed=bs)
        batch = cp_case.make_batch(spec)
        for rank in range(spec.cp_size):
            with cp_strategy_case.zigzag_rank(rank, spec.cp_size) as strategy:
                backend, layer, fb, local_q = cp_strategy_case.rank_inputs(module, batch, strategy)
                call_args = (backend, local_q, batch.k_cache, batch.v_cache, layer, fb)
                stand_ins = cp_strategy_case.device_stand_ins(backend, fb, local_q, batch)
                outs, syncs = {}, {}
                for name, method in methods.items():
                    with count_host_syncs(device_tensors=stand_ins) as counter:
                        outs[name] = method(*call_args)
                    syncs[name] = counter.count
                if not torch.equal(*outs.values()):
                    raise SystemExit("the two methods disagree at bs=%d rank %d" % (bs, rank))
                figures = time_methods(methods, call_args, args.repeats, KernelClock(module.torch_npu))
            base = figures["upstream 0.5.23"][1]
            for name in methods:
                total, host = figures[name]
                print("%-4d %-5d %-16s %16d %14.3f %14.3f %8s" % (
                    bs, rank, name, syncs[name], 1e3 * total, 1e3 * host, "%.2fx" % (host / base)))
    print("reproduce: %s" % REPRODUCE)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=40)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    import npu_shim
    from npu_shim import emulation

    emulation.install()
    npu_shim.install()
    module = importlib.import_module(TARGET)
    import torch

    from npu_shim.patches.sglang import cp_fia as sglang_cp_fia
    from npu_shim.testing import count_host_syncs

    torch.set_num_threads(args.threads)
    if getattr(module.AscendAttnBackend.__dict__["do_cp_attn_fia"], "__npu_shim_patch__", None) \
            == "sglang.cp_fia_host_lengths":
        return main_strategy(module, args)
    cp_case = load_cp_case()
    cp_case.set_cpu_server_args()
    upstream = module.AscendAttnBackend.__dict__["do_cp_attn_fia"]
    if hasattr(upstream, "__npu_shim_patch__"):
        raise SystemExit("run this on sglang 0.5.13, where upstream's fixed method is installed")
    methods = {"upstream 0.5.13": upstream, "npu-shim": sglang_cp_fia.make_do_cp_attn_fia()}

    print("bench_cp_fia: one do_cp_attn_fia call (rank 0 of cp_size 2), 8 heads over 2 KV heads "
          "x 128, page 128, float32, emulated torch_npu on CPU, %d thread(s); median of %d calls"
          % (args.threads, args.repeats))
    print("%-6s %-18s %10s %14s %14s %8s" % ("bs", "method", "host syncs", "total ms/call",
                                          "host ms/call", "ratio"))
    for bs, lens in BATCHES.items():
        spec = cp_case.Spec(extend_lens=lens, page_size=128, num_heads=8, num_kv_heads=2,
                            qk_head_dim=128, v_head_dim=128, seed=bs)
        batch = cp_case.make_batch(spec)
        backend, layer, fb, local_q = cp_case.rank_inputs(module, batch, 0)
        call_args = (backend, local_q, batch.k_cache, batch.v_cache, layer, fb)
        outs, syncs = {}, {}
        for name, method in methods.items():
            device = [local_q, batch.k_cache, batch.v_cache, backend.forward_metadata.block_tables,
                      backend.fia_mask]
            with count_host_syncs(device_tensors=device) as counter:
                outs[name] = method(*call_args)
            syncs[name] = counter.count
        if not torch.equal(*outs.values()):
            raise SystemExit("the two methods disagree at bs=%d" % bs)
        figures = time_methods(methods, call_args, args.repeats, KernelClock())
        base = figures["upstream 0.5.13"][1]
        for name in methods:
            total, host = figures[name]
            print("%-6d %-18s %10d %14.3f %14.3f %8s" % (
                bs, name, syncs[name], 1e3 * total, 1e3 * host, "%.2fx" % (host / base)))
    print("reproduce: %s" % REPRODUCE)


if __name__ == "__main__":
    main()
