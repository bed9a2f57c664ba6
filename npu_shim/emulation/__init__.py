"""Pure-PyTorch emulation of the torch_npu ops (attention, KV cache, layer ops), for machines without an NPU.

``install()`` appends the directory holding the emulated ``torch_npu`` package
to the *end* of ``sys.path``, and only when no real torch_npu can be found, so a
real torch_npu always wins: it is either already importable (install() returns
False and changes nothing) or, if installed later on an earlier path entry, it is
found first. The core calls install() at start-up when ``NPU_SHIM_EMULATE=1``;
by default nothing named torch_npu is ever created.

This module must stay cheap: it runs at interpreter start-up, so it imports
neither torch nor the ops (the emulated package imports them when first used).

What the emulated package provides (details in each op module's docstring):
``npu_fusion_attention``, ``npu_prompt_flash_attention``,
``npu_fused_infer_attention_score``, ``npu_incre_flash_attention``,
``_npu_flash_attention_unpad``, ``_npu_flash_attention_qlens`` (``prefix_attention``),
``_npu_reshape_and_cache``, ``npu_scatter_nd_update_``,
and the decoder ops (``decoder_attention``): ``_npu_paged_attention``,
``npu_fused_infer_attention_score_v2``, ``npu_scatter_pa_kv_cache``; the layer ops vllm-ascend's
registered layers call (docs/emulation-ops.md): ``npu_rms_norm``, ``npu_add_rms_norm`` (``norms``),
``npu_swiglu`` (``activation``), ``npu_rotary_mul``, ``npu_mrope``, ``_npu_rotary_embedding``, ``npu_apply_rotary_pos_emb`` (``rotary``),
``npu_moe_gating_top_k``, ``npu_moe_init_routing_v2``, ``npu_grouped_matmul``,
``npu_moe_token_unpermute``, ``npu_moe_finalize_routing`` (``moe``), ``npu_format_cast`` (``formats``), all as ``torch_npu.X`` and ``torch.ops.npu.X``; vllm-ascend's
own ``torch.ops._C_ascend.npu_add_rms_norm_bias`` and ``torch.ops._C_ascend.moe_gating_top_k``; ``torch_npu.npu`` with ``is_available() == False``,
the emulated SoC (``NPU_SHIM_EMULATE_SOC``) and no-op streams/events
(``torch_npu.npu.streams``); ``torch_npu._C._npu_get_soc_version`` and
``torch_npu._C._weak_ref_tensor`` (a tensor that does not own its memory, see ``weak_ref``); import
placeholders (``placeholders``) for names upstream reads at import time only. It does
not create ``torch.npu`` by itself (see the package docstring for why):
:func:`register_device_module` does, for code that needs it (vllm-ascend).

sglang's NPU kernel package ``sgl_kernel_npu`` (Triton kernels, on no package index): the kernels its
engine's text path launches are emulated in :mod:`npu_shim.emulation.sgl_kernels`, which the tests'
import placeholder of that package hands out by name.

An emulated device (``npu`` as a device type backed by host memory, ``torch.npu`` a one-device
machine, hccl as one-rank gloo, device->host transfers counted at dispatch) is a second switch:
``NPU_SHIM_EMULATE_DEVICE=1`` with ``NPU_SHIM_EMULATE=1`` activates it when the emulated torch_npu
is imported (:mod:`npu_shim.emulation.device`; mechanism, cost and limits in its docstring and
docs/validation.md). Without it nothing changes.
"""
import importlib.util
import os
import sys

__all__ = ["SITE_DIR", "install", "is_emulated", "register_device_module", "uninstall"]

SITE_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_site")
_EMULATED_INIT = os.path.join(SITE_DIR, "torch_npu", "__init__.py")


def _is_ours(module):
    return bool(getattr(module, "__npu_shim_emulated__", False))


def _spec_is_ours(spec):
    origin = getattr(spec, "origin", None)
    return bool(origin) and os.path.realpath(origin) == os.path.realpath(_EMULATED_INIT)


def _find_spec():
    try:
        return importlib.util.find_spec("torch_npu")
    except (ImportError, ValueError):
        return None


def install():
    """Make ``import torch_npu`` resolve to the emulation if no real one exists.

    Returns True when torch_npu is (now) the emulation, False when a real
    torch_npu is importable or already imported (nothing is changed then).
    Idempotent.
    """
    module = sys.modules.get("torch_npu")
    if module is not None:
        return _is_ours(module)
    if SITE_DIR in sys.path:
        return _spec_is_ours(_find_spec())
    spec = _find_spec()
    if spec is not None:
        return False
    sys.path.append(SITE_DIR)
    return True


def is_emulated():
    """True if ``import torch_npu`` gives (or has given) the emulation. Imports nothing."""
    module = sys.modules.get("torch_npu")
    if module is not None:
        return _is_ours(module)
    if SITE_DIR not in sys.path:
        return False
    return _spec_is_ours(_find_spec())


def register_device_module():
    """Make ``torch.npu`` the emulated ``torch_npu.npu``, as the real torch_npu does on import.

    Not done by :func:`install`: sglang's ``is_npu()`` raises when ``torch.npu`` exists but
    ``torch.npu.is_available()`` is False (0.5.23), and transformers' accelerator probes read
    ``hasattr(torch, "npu")``. vllm-ascend, by contrast, names ``torch.npu`` in class
    annotations (``vllm_ascend.compilation.acl_graph``), so importing its attention backend
    off an NPU needs it: a process that runs vllm-ascend on the emulation calls this once.
    ``is_available()`` stays False. Returns the module; refuses (RuntimeError) when
    torch_npu is not the emulation, and leaves an existing ``torch.npu`` of another origin
    alone (RuntimeError too). Undone by :func:`uninstall`.
    """
    import torch

    if not install():
        raise RuntimeError("npu_shim.emulation.register_device_module: torch_npu is not the "
                           "emulation (a real torch_npu registers torch.npu itself)")
    import torch_npu

    existing = getattr(torch, "npu", None)
    if existing is not None and existing is not torch_npu.npu:
        raise RuntimeError("npu_shim.emulation.register_device_module: torch.npu is already "
                           "%r, not the emulation's" % (existing,))
    torch.npu = torch_npu.npu
    return torch.npu


def uninstall():
    """Take the emulation off ``sys.path`` and drop the emulated modules.

    The ``torch.ops.npu`` registrations stay for the life of the process
    (torch.library cannot take a definition back). Returns True if anything
    was removed.
    """
    removed = False
    while SITE_DIR in sys.path:
        sys.path.remove(SITE_DIR)
        removed = True
    torch = sys.modules.get("torch")
    if torch is not None and _is_ours(sys.modules.get("torch_npu")) and \
            getattr(torch, "npu", None) is sys.modules.get("torch_npu.npu"):
        del torch.npu
    if _is_ours(sys.modules.get("torch_npu")):
        for name in [n for n in sys.modules if n == "torch_npu" or n.startswith("torch_npu.")]:
            del sys.modules[name]
        removed = True
    return removed
