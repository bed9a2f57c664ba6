"""The release family of ``vllm.mm_merge_310p`` (on ``vllm.model_executor.models.utils``).

``_merge_multimodal_embeddings(inputs_embeds, multimodal_embeddings, is_multimodal)``
flattens the embeddings with the module's ``_flatten_embeddings``, assigns them
through the boolean mask inside a ``try``, and on a ``RuntimeError`` raises a
``ValueError`` built with ``_embedding_count_expression``. ``check`` looks for that
shape: the three parameters, both helpers, a subscript store, and no
``masked_scatter_`` (the releases before 0.20 merge with it: "not needed", no
IndexPut there).
"""
import dis
import inspect
import sys

import torch

from npu_shim.patch import NotNeeded, TargetMismatch
from npu_shim.patches._shared.code import names_in_code
from npu_shim.patches._shared.host_data import is_host
from npu_shim.patches.vllm.mm_merge_310p import FUNCTION

PARAMS = ("inputs_embeds", "multimodal_embeddings", "is_multimodal")
HELPERS = ("_flatten_embeddings", "_embedding_count_expression")
MASKED_SCATTER = "masked_scatter_"

# Upstream's two messages: the ValueError must read as upstream's does.
COUNT_MISMATCH = "Attempted to assign {expr} = {actual} multimodal tokens to {expected} placeholders"
INDEX_PUT_FAILED = "Error during index put operation"


def on_310p():
    """Whether torch_npu, already imported by this process, reports a 310P SoC."""
    torch_npu = sys.modules.get("torch_npu")
    if torch_npu is None:
        return False
    from npu_shim.kernels._torch_npu import SOC_310P, soc_version

    try:
        return soc_version(torch_npu) in SOC_310P
    except RuntimeError:
        return False


def _function(module):
    function = vars(module).get(FUNCTION)
    if not inspect.isfunction(function):
        raise TargetMismatch("%s.%s is not a function" % (module.__name__, FUNCTION))
    return function


def _stores_subscript(function):
    return any(ins.opname == "STORE_SUBSCR" for ins in dis.get_instructions(function))


class _BooleanMaskAssignment:
    def check(self, module, context):
        function = _function(module)
        params = tuple(inspect.signature(function).parameters)
        if params != PARAMS:
            raise TargetMismatch("%s takes %s; the family knows %s" % (FUNCTION, params, PARAMS))
        names = names_in_code(function.__code__, nested=False)
        if MASKED_SCATTER in names:
            raise NotNeeded("%s merges with masked_scatter_, not the boolean-mask assignment whose 310P "
                            "IndexPut kernel fails" % FUNCTION)
        missing = [n for n in HELPERS if n not in names or not callable(getattr(module, n, None))]
        if missing:
            raise TargetMismatch("%s does not use %s" % (FUNCTION, ", ".join(missing)))
        if not _stores_subscript(function):
            raise TargetMismatch("%s does not assign through a subscript" % FUNCTION)

    def build(self, module, context):
        upstream = _function(module)

        def merge(inputs_embeds, multimodal_embeddings, is_multimodal):
            current = vars(module).get(FUNCTION)
            if current is not merge:
                # A model module that imported the function by name holds this replacement;
                # after uninstall (or a re-install's new replacement) it follows the target:
                # upstream's function, or the replacement now in place.
                return current(inputs_embeds, multimodal_embeddings, is_multimodal)
            if not (on_310p() and _plain_mask(inputs_embeds, is_multimodal)):
                context.count("upstream_calls")
                return upstream(inputs_embeds, multimodal_embeddings, is_multimodal)
            context.count("calls")
            if len(multimodal_embeddings) == 0:
                return inputs_embeds
            flat = module._flatten_embeddings(multimodal_embeddings)
            if not is_host(is_multimodal):
                context.count("host_copies")          # nonzero of a device mask: its size is read back
                context.count("upstream_host_copies")  # upstream's index_put_ makes the same read
            positions = torch.nonzero(is_multimodal, as_tuple=True)[0].to(inputs_embeds.device,
                                                                           non_blocking=True)
            try:
                values = flat.to(dtype=inputs_embeds.dtype)
                # upstream's assignment broadcasts the values to the selected rows
                values = values.expand((positions.shape[0],) + tuple(inputs_embeds.shape[1:]))
                inputs_embeds.index_copy_(0, positions, values)
            except RuntimeError as exc:
                if len(flat) != positions.shape[0]:
                    raise ValueError(COUNT_MISMATCH.format(
                        expr=module._embedding_count_expression(multimodal_embeddings),
                        actual=len(flat), expected=positions.shape[0])) from exc
                raise ValueError(INDEX_PUT_FAILED) from exc
            return inputs_embeds

        context.present(merge, upstream,
                        "on 310P, torch.nonzero + index_copy_ instead of the boolean-mask assignment; "
                        "elsewhere upstream's")
        return {FUNCTION: merge}


def _plain_mask(inputs_embeds, is_multimodal):
    """A 1-D boolean mask over the rows of ``inputs_embeds``: what the positions replace exactly."""
    return (isinstance(is_multimodal, torch.Tensor) and is_multimodal.dtype == torch.bool
            and is_multimodal.dim() == 1 and inputs_embeds.dim() >= 1
            and is_multimodal.shape[0] == inputs_embeds.shape[0])


BOOLEAN_MASK_ASSIGNMENT = _BooleanMaskAssignment()
