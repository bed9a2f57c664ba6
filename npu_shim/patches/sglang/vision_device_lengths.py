"""sglang.vision_device_lengths — sglang's vision attention before the metadata (0.5.11 - 0.5.15): a device cu_seqlens read back once per tower forward, not once per layer.

Why: before 0.5.16 sglang's ``VisionAscendAttention.forward`` takes the tower's
  ``cu_seqlens`` in every layer and, when it is on the device, reads it back there:
  0.5.11 - 0.5.13 ``seq_lens.to("cpu")`` for ``_npu_flash_attention_unpad`` (its
  ``seq_len`` is host data), 0.5.14 - 0.5.15 ``cu_seqlens[1:].tolist()`` for FIA.
  Measured on the real wheels with sglang's own towers (CPU, emulated ops,
  ``npu_shim.testing.sglang_towers``): Qwen2.5-VL and GLM-4V move ``cu_seqlens`` to
  "cpu" on NPU and the attention reads nothing; Qwen3-VL moves its host lengths to
  "cpu" and then copies them to the device itself (``qwen3_vl.py``:
  ``cu_seqlens.to(self.device, non_blocking=True)``), so the attention reads the same
  tensor back in every layer: 1 read per layer of the tower.
How: ``VisionAscendAttention.forward`` is wrapped; upstream's forward runs every time,
  with upstream's op call and arguments. A host ``cu_seqlens`` (or none, or a
  ``SingletonCache``, or the NPU-graph mode) goes to it unchanged. A device one is
  read back once (upstream's own read, ``.to("cpu")``) and the host copy is kept for
  that tensor (a weak reference, on this thread, checked against the tensor's version
  counter where it has one); every later layer that hands the same tensor gets the
  host copy, on which upstream's forward reads nothing. 1 read per tower forward.
  Not 0: the numbers exist on the host only inside the tower (``token_cu_seqlens``),
  which this patch does not touch.
Upstream fix: none (0.5.16 replaced this path by the vision attention metadata, which
  reads back in every layer as well: ``sglang.vision_host_lengths``).
Remove when: these releases are no longer served.

``sglang.vision_host_lengths`` is the fix for 0.5.16 - 0.5.23; it is a separate patch
because it also replaces ``prepare_vision_attention_metadata``, which these releases
do not have (a patch's declared attributes must exist in its target).
"""
import inspect
import threading
import weakref

from npu_shim.patch import Defect, Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.structure import own_function
from npu_shim.patches._shared.code import names_in_code
from npu_shim.patches._shared.host_data import is_host
from npu_shim.patches.sglang.vision_host_lengths import FIA, version_of

TARGET = "sglang.srt.layers.attention.vision"
FORWARD = "VisionAscendAttention.forward"
METADATA = "prepare_vision_attention_metadata"


class _HostCopy(threading.local):
    """The host copy of the last device ``cu_seqlens`` the attention read back on this thread:
    (a weak reference to the device tensor, its version then, the host tensor)."""
    slot = None

    def get(self, tensor):
        slot = self.slot
        if slot is None or slot[0]() is not tensor or version_of(tensor) != slot[1]:
            return None
        return slot[2]

    def put(self, tensor, host):
        self.slot = (weakref.ref(tensor), version_of(tensor), host)


class _BeforeMetadata:
    """0.5.11 - 0.5.15: no metadata; ``VisionAscendAttention.forward`` takes the tower's
    ``cu_seqlens`` in every layer and reads it back there when it is on the device
    (0.5.11 - 0.5.13: ``seq_lens.to("cpu")`` before ``_npu_flash_attention_unpad``; 0.5.14 -
    0.5.15: ``cu_seqlens[1:].tolist()`` for FIA). Of sglang's towers, Qwen3-VL hands it a
    device copy it made of its own host lengths (``qwen3_vl.py``: ``cu_seqlens.to(self.device,
    non_blocking=True)`` after moving them to "cpu"): 1 read per layer.

    ``op`` the NPU op upstream's forward calls (kept: upstream's forward runs, with a host
    ``cu_seqlens`` in place of the device one)."""

    def __init__(self, op):
        self.op = op

    def check(self, module, context):
        cls = getattr(module, "VisionAscendAttention", None)
        if cls is None:
            raise TargetMismatch("%s lacks VisionAscendAttention" % TARGET)
        if hasattr(module, METADATA):
            raise TargetMismatch("%s has %s (a metadata family's shape)" % (TARGET, METADATA))
        forward = own_function(cls, "forward")
        params = list(inspect.signature(forward).parameters)
        if params[:7] != ["self", "q", "k", "v", "cu_seqlens", "bsz", "seq_len"] or "forward_metadata" in params:
            raise TargetMismatch("VisionAscendAttention.forward takes %s" % params)
        names = names_in_code(forward.__code__)
        other = ({UNPAD, FIA} - {self.op}).pop()
        if self.op not in names or other in names or "resolve_seqlens" not in names:
            raise TargetMismatch("VisionAscendAttention.forward does not call %s alone on resolve_seqlens"
                                 % self.op)
        if not hasattr(getattr(module, "envs", None), "SGLANG_VIT_ENABLE_CUDA_GRAPH"):
            raise TargetMismatch("%s has no envs.SGLANG_VIT_ENABLE_CUDA_GRAPH" % TARGET)

    def build(self, module, context):
        upstream = own_function(module.VisionAscendAttention, "forward")
        forward = self.make_forward(module, upstream, context)
        context.present(forward, upstream,
                        "a device cu_seqlens read back once per tower forward, not once per layer")
        return {FORWARD: forward}

    def make_forward(self, module, upstream, context):
        copies = _HostCopy()

        def forward(self, q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=None, **kwargs):
            import torch

            context.count("calls")
            if (not isinstance(cu_seqlens, torch.Tensor) or is_host(cu_seqlens)
                    or module.envs.SGLANG_VIT_ENABLE_CUDA_GRAPH.get()):
                # host lengths (0 reads upstream too), None / SingletonCache, or graph mode
                context.count("upstream_calls")
                return upstream(self, q, k, v, cu_seqlens, bsz, seq_len, softmax_scale=softmax_scale, **kwargs)
            context.count("upstream_host_copies")
            host = copies.get(cu_seqlens)
            if host is None:
                context.count("host_copies")     # upstream's read, once per device tensor
                host = cu_seqlens.to("cpu")
                copies.put(cu_seqlens, host)
            return upstream(self, q, k, v, host, bsz, seq_len, softmax_scale=softmax_scale, **kwargs)

        return forward


UNPAD = "_npu_flash_attention_unpad"
BEFORE_METADATA_UNPAD = _BeforeMetadata(UNPAD)
BEFORE_METADATA_FIA = _BeforeMetadata(FIA)


PATCH = Patch(
    name="sglang.vision_device_lengths",
    target=TARGET,
    replaces=(FORWARD,),
    requires={"sglang": ""},
    outside_window={"sglang": "above the window the vision attention metadata carries the lengths "
                              "(sglang.vision_host_lengths); releases below it were not read"},
    needs_npu=True,
    families=(
        Family(__name__ + ":BEFORE_METADATA_UNPAD", fence=">=0.5.11,<0.5.14",
               keeps="torch_npu._npu_flash_attention_unpad in upstream's forward, upstream's arguments"),
        Family(__name__ + ":BEFORE_METADATA_FIA", fence=">=0.5.14,<0.5.16",
               keeps="torch_npu.npu_fused_infer_attention_score (input_layout TND) in upstream's forward, "
                     "upstream's arguments"),
    ),
    summary="VisionAscendAttention before the metadata: a device cu_seqlens is read back "
            "once per tower forward, not once per layer (Qwen3-VL: 1 read per forward)",
    selftest=Selftest("npu_shim.selftest.sglang_vision_device_lengths", host_syncs=1),
    defect=Defect("sglang's vision attention reads a device cu_seqlens back once per layer", shows="reads"),
)
