"""The attention backend published for one forward, as sglang's ``ModelRunner._forward_raw`` does.

For tests that enter through ``RadixAttention.forward``: from the releases that have
``sglang.srt.model_executor.forward_context.ForwardContext`` the layer asks the active context for
the backend (``get_attn_backend()``); before, it reads ``forward_batch.attn_backend``. Both are set.
"""
import contextlib
import importlib
import inspect


def published(backend, forward_batch):
    """Context manager: ``forward_batch.attn_backend`` set to ``backend`` and, where the release has a
    ``ForwardContext``, one holding ``backend`` active inside the block (sglang's own
    ``forward_context``)."""
    forward_batch.attn_backend = backend
    try:
        context = importlib.import_module("sglang.srt.model_executor.forward_context")
    except ImportError:
        return contextlib.nullcontext()
    if not hasattr(context, "ForwardContext"):
        return contextlib.nullcontext()
    extra = {"forward_batch": forward_batch} if "forward_batch" in inspect.signature(
        context.forward_context).parameters else {}          # a later release's argument
    return context.forward_context(context.ForwardContext(attn_backend=backend), **extra)
