"""Adapters of the MMEncoderAttention patches, one per vllm-ascend release family.

Used by ``vllm.mm_encoder_attn`` (``AscendMMEncoderAttention`` in
``vllm_ascend.ops.mm_encoder_attention``) and by the 310P patch, each with its
own list of adapters. This module is light (no torch): the patch declarations
import it when the machinery loads; adapter modules are imported only once the
target module has been imported.

The adapter interface
---------------------
An adapter is a module ``npu_shim.patches.vllm_ascend.mm_encoder.<name>`` that defines
``ADAPTER = Adapter(...)``:

``name``      short name shown by ``npu-shim status`` (column "adapter") and by
              ``npu_shim._stats.snapshot()``; by convention the module name,
              e.g. ``"v018"``.
``releases``  PEP 440 fence on ``dist`` (default ``vllm-ascend``), e.g.
              ``">=0.18.0,<0.19"``. Pre-releases count as inside. Leave the
              upper end open only for the newest family ("every later source
              that matches by structure").
``check``     ``check(cls)``: raise :class:`~npu_shim.patch.TargetMismatch`
              (shape unknown) or :class:`~npu_shim.patch.NotNeeded` (fixed
              upstream) unless ``cls`` has the shape the adapter was written
              for. Look at structure only (signatures, names the methods
              use), never at versions: the fence does that.
``build``     ``build(cls)``: ``{attribute name: replacement}`` for attributes
              of ``cls`` (e.g. ``{"forward_oot": f}``); every name must be in
              the patch's ``replaces`` as ``"<Class>.<name>"``. Build the
              replacements with :func:`npu_shim.patches.vllm_ascend.mm_encoder.common.wrap`
              (upstream's signature) and the shared per-forward host lengths,
              lazy layer state and counters of ``common``.

A patch declaration lists its adapters (module names, oldest family first) and
gets its ``check``/``build`` from :func:`dispatch`::

    ADAPTERS = ("v013", "v018", "v019")
    check, build = dispatch("vllm.mm_encoder_attn", "AscendMMEncoderAttention", ADAPTERS)

Adding a family = one module + one entry in that tuple. :func:`dispatch`
picks the adapter whose fence holds the installed version and whose ``check``
accepts the class; if none does, the patch is skipped with every adapter's
reason (a TargetMismatch, so ``NPU_SHIM_STRICT=1`` raises); ``build`` returns
:class:`~npu_shim.patch.Adapted` so that the machinery records the adapter.
"""
import importlib
import importlib.metadata
from dataclasses import dataclass
from typing import Any, Callable, Mapping

from npu_shim.patch import Adapted, NotNeeded, TargetMismatch

__all__ = ["Adapter", "dispatch", "select"]

PACKAGE = __name__


@dataclass(frozen=True)
class Adapter:
    name: str
    releases: str
    check: Callable[[type], None]
    build: Callable[[type], Mapping[str, Any]]
    dist: str = "vllm-ascend"

    def fence_holds(self, version):
        from packaging.specifiers import SpecifierSet
        from packaging.version import Version

        return SpecifierSet(self.releases).contains(Version(version), prereleases=True)


def load_adapters(modules):
    return [importlib.import_module("%s.%s" % (PACKAGE, name)).ADAPTER for name in modules]


def select(cls, adapters, versions=None):
    """The adapter for ``cls`` among ``adapters``, or raise with every adapter's reason.

    ``versions``: ``{dist: version}``; default: the installed distributions.
    """
    versions = dict(versions or {})
    reasons = []
    fixed = None
    for adapter in adapters:
        if adapter.dist not in versions:
            try:
                versions[adapter.dist] = importlib.metadata.version(adapter.dist)
            except importlib.metadata.PackageNotFoundError:
                versions[adapter.dist] = None
        version = versions[adapter.dist]
        if version is None:
            reasons.append("%s: %s not installed" % (adapter.name, adapter.dist))
            continue
        if not adapter.fence_holds(version):
            reasons.append("%s: %s %s outside %s" % (adapter.name, adapter.dist, version, adapter.releases))
            continue
        try:
            adapter.check(cls)
        except NotNeeded as exc:
            fixed = fixed or "%s: %s" % (adapter.name, exc)
            continue
        except TargetMismatch as exc:
            reasons.append("%s (%s %s): %s" % (adapter.name, adapter.dist, adapter.releases, exc))
            continue
        return adapter
    if fixed and not reasons:
        raise NotNeeded(fixed)
    raise TargetMismatch("no adapter accepts %s: %s" % (cls.__qualname__, "; ".join(
        ([fixed] if fixed else []) + reasons)))


def dispatch(patch_name, class_name, adapter_modules):
    """``(check, build)`` for a Patch whose target module defines ``class_name``."""

    def target_class(module):
        cls = getattr(module, class_name, None)
        if not isinstance(cls, type):
            raise TargetMismatch("%s.%s is not a class" % (module.__name__, class_name))
        return cls

    def check(module):
        select(target_class(module), load_adapters(adapter_modules))

    def build(module):
        cls = target_class(module)
        adapter = select(cls, load_adapters(adapter_modules))
        values = adapter.build(cls)
        return Adapted(adapter.name, {"%s.%s" % (class_name, name): value
                                      for name, value in values.items()})

    check.__qualname__ = "dispatch(%r).check" % patch_name
    build.__qualname__ = "dispatch(%r).build" % patch_name
    return check, build
