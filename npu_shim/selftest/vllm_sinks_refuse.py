"""Selftest of ``vllm.sinks_refuse``: vllm-ascend's attention refuses a layer with learnable sinks.

Builds two tiny ``MiMoV2Attention`` layers of vLLM's own model (:mod:`npu_shim.testing.mimo`) on
vllm-ascend's ``AscendAttentionBackend`` (the platform's answer; the selector stands in for it):
the full-attention layer (no sinks) must build with upstream's impl, the sliding-window layer
(learnable sinks, which this vllm-ascend would drop) must be refused at build with the shim's
``NotImplementedError``. No NPU op runs (error 0 when both outcomes are right); the builds must
read nothing back.
"""
import time

PATCH_NAME = "vllm.sinks_refuse"


def run(device=None):
    from vllm.config import set_current_vllm_config

    from npu_shim import emulation
    from npu_shim.selftest import applied_target, on_upstream
    from npu_shim.testing import count_host_syncs, mimo

    module = applied_target(PATCH_NAME)
    impl = module.AscendAttentionBackendImpl
    if not on_upstream(PATCH_NAME) and not hasattr(impl.__init__, "__wrapped_upstream__"):
        raise RuntimeError("%s reports applied but %s.__init__ is not the shim's" % (PATCH_NAME, impl.__name__))
    config = mimo.setup(emulate=emulation.is_emulated())
    with set_current_vllm_config(config):
        backend_impl = mimo.import_ascend_backend().get_impl_cls()
    started = time.perf_counter()
    refused = None
    with count_host_syncs(cpu_is_device=True) as syncs, mimo.ascend_backend():
        full = mimo.build_layer("full")
        try:
            mimo.build_layer("swa")
        except NotImplementedError as exc:
            refused = str(exc)
    seconds = time.perf_counter() - started
    if type(full.attn.impl) is not backend_impl:
        raise RuntimeError("the layer without sinks got %s, not vllm-ascend's %s"
                           % (type(full.attn.impl).__name__, backend_impl.__name__))
    if refused is None or "npu-shim (vllm.sinks_refuse)" not in refused or "learnable sinks" not in refused:
        raise RuntimeError("the layer with learnable sinks was not refused with the shim's message: %r" % refused)
    return {"max_abs_err": 0.0, "tolerance": 0.0, "host_syncs": syncs.count, "seconds": seconds,
            "detail": "MiMoV2Attention on AscendAttentionBackend: the sliding-window layer with learnable "
                      "sinks refused at build, the full layer built with upstream's impl (device %s not used)"
                      % (device or "cpu")}
