"""Loading torch_npu and reading the device class, for the kernels.

The kernels call whatever ``import torch_npu`` resolves to: the real package on
an Ascend machine, or npu-shim's emulation where ``NPU_SHIM_EMULATE=1`` put it
on the path. They never import the emulation themselves.
"""
import torch

SOC_310P = range(200, 206)          # Atlas inference series (310P1..310P7)
SOC_TND = (range(220, 226),         # A2 (910B1..910B4-1)
           range(250, 256),         # A3 (910_93xx)
           range(260, 261))         # A5 (950)
BACKENDS = ("tnd", "unpad")


def load_torch_npu():
    try:
        import torch_npu  # noqa: F401
    except ImportError as exc:
        raise RuntimeError(
            "npu_shim.kernels call torch_npu ops, and torch_npu is not importable. On an Ascend "
            "machine install torch_npu; on a development machine set NPU_SHIM_EMULATE=1 "
            "(or call npu_shim.emulation.install()) to use the pure-PyTorch emulation."
        ) from exc
    return torch_npu


def soc_version(torch_npu):
    """The SoC version integer, the way vllm-ascend reads it."""
    npu = getattr(torch_npu, "npu", None)
    getter = getattr(npu, "get_soc_version", None)
    if getter is None:
        getter = getattr(getattr(torch_npu, "_C", None), "_npu_get_soc_version", None)
    if getter is None:
        raise RuntimeError("torch_npu exposes neither npu.get_soc_version() nor "
                           "_C._npu_get_soc_version(); pass backend='tnd' or 'unpad'")
    return int(getter())


def backend_for_soc(version):
    """'unpad' on 310P (no TND fusion attention there), 'tnd' on A2/A3/A5."""
    if version in SOC_310P:
        return "unpad"
    if any(version in r for r in SOC_TND):
        return "tnd"
    raise RuntimeError("SoC version %d has no known varlen attention path; pass "
                       "backend='tnd' or backend='unpad'" % version)


def detect_backend():
    return backend_for_soc(soc_version(load_torch_npu()))


def ops_namespace():
    """``torch.ops.npu`` after torch_npu has registered its ops there."""
    load_torch_npu()
    return torch.ops.npu
