"""The release families of ``vllm.kimi_vl_host_grid`` (on ``vllm.model_executor.models.kimi_vl``).

``HOST_GRID`` (vLLM 0.18.0 .. 0.28.0): the processor's field config declares
``image_grid_hws=MultiModalFieldConfig.batched("image")``, ``MultiModalFieldConfig.batched``
takes ``keep_on_cpu``: both replacements.
``HOST_LENGTHS`` (vLLM 0.29.0 on): the field config declares
``batched("image", keep_on_cpu=True)`` itself (upstream's fix of the grid's placement), so
only the tower's forward is replaced, for the attention's read of ``cu_seqlens``.

Both check that MoonViT's encoder builds ``cu_seqlens`` from the grid with
``cat((zeros(1), (grid_hw[:, 0] * grid_hw[:, 1]).to(device)))``
``.cumsum(dim=0, dtype=torch.int32)`` and hands it to each block as the
second positional argument.
"""
import inspect
import sys

import torch

from npu_shim.patch import TargetMismatch
from npu_shim.patches.vllm.kimi_vl_host_grid import PROCESSOR, TOWER
from npu_shim.patches._shared import host_record
from npu_shim.patches._shared.code import source_text
from npu_shim.patches._shared.host_data import is_host

FIELD = "image_grid_hws"
DECLARED = 'image_grid_hws=MultiModalFieldConfig.batched("image")'
DECLARED_ON_HOST = 'image_grid_hws=MultiModalFieldConfig.batched("image", keep_on_cpu=True)'
ENCODER_SHAPE = ("(grid_hw[:, 0] * grid_hw[:, 1]).to(hidden_states.device)",
                 "cu_seqlens = lengths.cumsum(dim=0, dtype=torch.int32)",
                 "block( hidden_states, cu_seqlens,")


def _text(function):
    return source_text(function, "%s: no source to read" % function.__qualname__)


def host_cu_seqlens(grid_hw):
    """The encoder's ``cu_seqlens`` for a host ``grid_hw``, by its own integer ops, on the host."""
    lengths = torch.cat((torch.zeros(1, dtype=grid_hw.dtype), grid_hw[:, 0] * grid_hw[:, 1]))
    return lengths.cumsum(dim=0, dtype=torch.int32)


class _HostGrid:
    """``fields``: whether this family replaces the field config too (releases that send the
    grid to the device) or only the tower's forward (releases that keep it on the host)."""

    def __init__(self, fields):
        self.fields = fields

    def _functions(self, module):
        processor, tower = getattr(module, PROCESSOR, None), getattr(module, TOWER, None)
        if processor is None or tower is None:
            raise TargetMismatch("%s has no %s / %s" % (module.__name__, PROCESSOR, TOWER))
        fields, forward = vars(processor).get("_get_mm_fields_config"), vars(tower).get("forward")
        if not inspect.isfunction(fields) or not inspect.isfunction(forward):
            raise TargetMismatch("%s._get_mm_fields_config / %s.forward are not functions of the classes"
                                 % (PROCESSOR, TOWER))
        return fields, forward

    def check(self, module, context):
        fields, forward = self._functions(module)
        fields_text = _text(fields)
        if self.fields:
            if DECLARED_ON_HOST in fields_text:
                raise TargetMismatch("%s._get_mm_fields_config keeps image_grid_hws on the CPU already "
                                     "(the host-lengths family's shape)" % PROCESSOR)
            if DECLARED not in fields_text:
                raise TargetMismatch("%s._get_mm_fields_config does not declare %s" % (PROCESSOR, DECLARED))
            from vllm.multimodal.inputs import MultiModalFieldConfig

            if "keep_on_cpu" not in inspect.signature(MultiModalFieldConfig.batched).parameters:
                raise TargetMismatch("MultiModalFieldConfig.batched takes no keep_on_cpu")
        elif DECLARED_ON_HOST not in fields_text:
            raise TargetMismatch("%s._get_mm_fields_config does not declare %s" % (PROCESSOR, DECLARED_ON_HOST))
        tower_module = sys.modules[getattr(module, TOWER).__module__]
        encoder = getattr(tower_module, "MoonVitEncoder", None)
        if encoder is None or not inspect.isfunction(vars(encoder).get("forward")):
            raise TargetMismatch("%s has no MoonVitEncoder.forward" % tower_module.__name__)
        encoder_text = _text(encoder.forward)
        missing = [s for s in ENCODER_SHAPE if s not in encoder_text]
        if missing:
            raise TargetMismatch("MoonVitEncoder.forward does not build or pass cu_seqlens as %s" % missing)
        params = tuple(inspect.signature(forward).parameters)
        if params[:3] != ("self", "pixel_values", "grid_hw"):
            raise TargetMismatch("%s.forward takes %s" % (TOWER, params))

    def build(self, module, context):
        fields_original, forward_original = self._functions(module)
        from vllm.multimodal.inputs import MultiModalBatchedField, MultiModalFieldConfig

        def _get_mm_fields_config(self, hf_inputs, hf_processor_mm_kwargs):
            fields = fields_original(self, hf_inputs, hf_processor_mm_kwargs)
            config = fields.get(FIELD)
            if config is not None and type(config.field) is MultiModalBatchedField \
                    and not config.field.keep_on_cpu:
                fields = dict(fields)
                fields[FIELD] = MultiModalFieldConfig.batched(config.modality, keep_on_cpu=True)
            return fields

        def forward(self, pixel_values, grid_hw, *args, **kwargs):
            if args or kwargs.get("encoder_metadata") is not None or not is_host(grid_hw) or grid_hw.dim() != 2:
                return forward_original(self, pixel_values, grid_hw, *args, **kwargs)
            host = host_cu_seqlens(grid_hw)

            def keep(block, block_args):
                handle.remove()                                   # the first block's call only
                cu_seqlens = block_args[1] if len(block_args) > 1 else None
                if (isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.shape == host.shape
                        and cu_seqlens.dtype == host.dtype and host_record.ATTR not in cu_seqlens.__dict__):
                    host_record.remember(cu_seqlens, host)

            handle = self.encoder.blocks[0].register_forward_pre_hook(keep)
            try:
                return forward_original(self, pixel_values, grid_hw, *args, **kwargs)
            finally:
                handle.remove()

        replaced = ((_get_mm_fields_config, fields_original),) if self.fields else ()
        replaced += ((forward, forward_original),)
        for new, original in replaced:
            context.present(new, original, "upstream's, with the grid's host lengths kept")
        if not self.fields:
            return {TOWER + ".forward": forward}
        return {PROCESSOR + "._get_mm_fields_config": _get_mm_fields_config, TOWER + ".forward": forward}


HOST_GRID = _HostGrid(fields=True)
HOST_LENGTHS = _HostGrid(fields=False)
