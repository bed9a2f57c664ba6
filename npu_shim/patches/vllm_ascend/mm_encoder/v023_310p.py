"""Family v023_310p: ``AscendMMEncoderAttention310``, vllm-ascend 0.23.0rc1 and later.

Upstream there (the same file in 0.23.0rc1, 0.23.0, 0.24.0rc1, 0.25.1rc1 and
0.26.0rc1): the 0.18.0 ``forward_oot`` (see :mod:`.v018_310p`: per-layer
``torch.diff(cu_seqlens).to("cpu")``, ``sequence_lengths`` ignored, K/V
repeated, 64 < D < 128 padded to 128, ``scale_value = head_size ** -0.5``)
with one change: ``__init__`` records
``self.support_approximate_calculation = is_approximate_calculation_supported()``
(torch_npu has ``_npu_flash_attention_unpad_v2``) and ``forward_oot`` then calls
``torch_npu._npu_flash_attention_unpad_v2(..., kernel_type=2)`` (ATB's
KERNELTYPE_EXP_M8V2: exp by a polynomial approximation, Atlas inference
series only) with the same arguments, else ``_npu_flash_attention_unpad``.

Replaced: ``forward_oot`` only, as in :mod:`.v018_310p`, choosing the op as
upstream does: the layer's ``support_approximate_calculation`` when upstream's
``__init__`` set it, else upstream's own ``is_approximate_calculation_supported()``
(a layer made with ``__new__``), decided once per layer.

npu-shim's torch_npu emulation has no ``_npu_flash_attention_unpad_v2``: the
torch_npu API reference does not document it (op-plugin's source and ATB's
"approximate exp" page exist, but not the approximation's coefficients), so
off the NPU upstream and the patch both take the ``_npu_flash_attention_unpad``
branch.
"""
from npu_shim.patch import TargetMismatch
from npu_shim.patches.vllm_ascend.mm_encoder import v018_310p as F

APPROXIMATE_EXP_KERNEL = 2                 # upstream's kernel_type: ATB KERNELTYPE_EXP_M8V2
CAPABILITY_ATTR = "support_approximate_calculation"
CAPABILITY_PROBE = "is_approximate_calculation_supported"
UNPAD_V2_CALL = F.OpCall(F.UNPAD_V2, kernel_type=APPROXIMATE_EXP_KERNEL)


def check(cls, context):
    F.check_family(cls, (F.UNPAD, F.UNPAD_V2, CAPABILITY_ATTR))
    if not callable(vars(cls)["forward_oot"].__globals__.get(CAPABILITY_PROBE)):
        raise TargetMismatch("%s's module no longer defines %s()" % (cls.__name__, CAPABILITY_PROBE))


def build(cls, context):
    module_globals = vars(cls)["forward_oot"].__globals__

    def choose_op(layer):
        supported = getattr(layer, CAPABILITY_ATTR, None)
        if supported is None:   # a layer upstream's __init__ did not build
            supported = module_globals[CAPABILITY_PROBE]()
        return UNPAD_V2_CALL if supported else F.UNPAD_CALL

    return F.build_family(cls, F.state_maker(pads=True, choose_op=choose_op), context)
