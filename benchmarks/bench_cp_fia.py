"""Host cost of one CP prefill attention call: sglang 0.5.13's fixed method vs the shim's.

Side by side in one process on the sglang-0.5.13 lane: upstream's fixed
``AscendAttnBackend.do_cp_attn_fia`` (PR 26705) and the shim's replacement
(``sglang.cp_fia``, the method the shim installs on builds in the broken
window), on the same backend, layer, metadata and paged cache (built as in
tests/lanes/sglang_support/cp_case.py: real sglang metadata, ForwardBatch,
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
import importlib.util
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
REPRODUCE = 'nox -s "bench(cp_fia)"'   # the sglang-0.5.13 lane venv, emulated torch_npu
BATCHES = {1: (64,), 4: (40, 17, 33, 22), 16: tuple(12 + (7 * i) % 29 for i in range(16))}


def load_cp_case():
    path = os.path.join(REPO, "tests", "lanes", "sglang_support", "cp_case.py")
    spec = importlib.util.spec_from_file_location("bench_cp_case", path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module
    spec.loader.exec_module(module)
    return module


class KernelClock:
    """Adds up thread CPU time inside ``torch.ops.npu.npu_fused_infer_attention_score``
    (both methods call it under that spelling) by wrapping the attribute while active.
    Thread CPU time, so other processes on the machine do not count."""

    OP = "npu_fused_infer_attention_score"

    def __init__(self):
        self.seconds = 0.0

    def __enter__(self):
        import torch

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

    from npu_shim.patches import sglang_cp_fia
    from npu_shim.testing import count_host_syncs

    torch.set_num_threads(args.threads)
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
        totals = {name: [] for name in methods}
        hosts = {name: [] for name in methods}
        clock = KernelClock()
        with clock:
            for _ in range(args.repeats):
                for name, method in methods.items():
                    clock.seconds = 0.0
                    started = time.thread_time()
                    method(*call_args)
                    total = time.thread_time() - started
                    if clock.seconds <= 0.0:
                        raise SystemExit("%s did not go through the timed op" % name)
                    totals[name].append(total)
                    hosts[name].append(total - clock.seconds)
        base = statistics.median(hosts["upstream 0.5.13"])
        for name in methods:
            host = statistics.median(hosts[name])
            print("%-6d %-18s %10d %14.3f %14.3f %8s" % (
                bs, name, syncs[name], 1e3 * statistics.median(totals[name]), 1e3 * host,
                "%.2fx" % (host / base)))
    print("reproduce: %s" % REPRODUCE)


if __name__ == "__main__":
    main()
