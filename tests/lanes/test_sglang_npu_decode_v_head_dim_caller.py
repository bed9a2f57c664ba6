"""``sglang.npu_decode_v_head_dim`` reached through its caller: sglang's ``RadixAttention.forward``.

test_sglang_npu_decode_v_head_dim.py calls ``AscendAttnBackend.forward_decode`` (the patched method)
itself. In serving, MiMo-V2-Flash's attention layer calls its ``RadixAttention`` with q, k, v and the
``ForwardBatch``; ``RadixAttention.forward`` reshapes k (192) and v (128) to heads and hands them,
with the layer's keyword arguments (the sinks), to the backend's ``forward``, whose dispatch on the
forward mode calls ``forward_decode`` for a decode step. Here that chain runs unedited, on the pool the
release's own builder made with the model's V width (sglang_support/v_head_dim_case.py says what is
real; the backend's attributes are set without ``__init__``, which needs a ModelRunner and an NPU).

Checked, eager, for a full layer and for a sliding-window layer with sinks (K 192 / V 128, bfloat16):
one decode step per sequence matches the float64 reference (npu_shim.testing.attention_f64; sglang's
window: the query at i sees keys i - W .. i; the sinks in each head's denominator), the step's V is
written into the pool, and the attention call is FIA v2 TND. With the patch off
(``NPU_SHIM_DISABLE=sglang.npu_decode_v_head_dim``) the same caller reaches upstream's
``forward_decode``, whose paged-attention call over caches of different widths the emulation refuses
as the op's documentation does not cover it: the test fails.
"""
import importlib

import pytest

PATCH = "sglang.npu_decode_v_head_dim"
pytestmark = [pytest.mark.claimed(PATCH), pytest.mark.patch(PATCH)]

from sglang_support import v_head_dim_case as case  # noqa: E402  (tests/lanes/conftest.py)
from sglang_support.published import published  # noqa: E402

from npu_shim.testing import cp_case  # noqa: E402

WINDOW = 6


@pytest.fixture(scope="module")
def decode():
    """test_sglang_npu_decode_v_head_dim (its case: spec, pool, layer, sinks, float64 expectation)."""
    case.install_shim()
    return importlib.import_module("test_sglang_npu_decode_v_head_dim")


@pytest.mark.parametrize("kind", ["full", "sliding-sinks"])
def test_radix_attention_forward_decodes_v_128(decode, kind):
    import torch

    from npu_shim.engine import counters
    from npu_shim.testing import record_npu_calls

    window = WINDOW if kind == "sliding-sinks" else -1
    batch = cp_case.make_batch(decode._spec("bfloat16", seed=5), write_new_tokens=True)
    pool = decode._pool(batch)
    case.append_token(batch, seed=1)
    sinks = decode._sinks(batch.spec) if window > -1 else None
    backend, layer, forward_batch, q, k, v = case.decode_inputs(batch, pool, use_fia=False, graph_mode=False,
                                                                layer=decode._layer(batch.spec, window))
    assert type(layer).__name__ == "RadixAttention" and forward_batch.forward_mode.is_decode()
    extra = {"sinks": sinks} if sinks is not None else {}
    before = counters.snapshot().get(PATCH, {}).get("tnd_calls", 0)
    with published(backend, forward_batch), record_npu_calls() as calls:
        out = layer(q, k, v, forward_batch, save_kv_cache=True, **extra)
    assert counters.snapshot()[PATCH]["tnd_calls"] == before + 1       # the layer reached the patched decode
    assert [(c.name, c.kwargs.get("input_layout")) for c in calls if "attention" in c.name] == \
        [("npu_fused_infer_attention_score_v2", "TND")], calls
    stored = pool.get_value_buffer(0).reshape(-1, batch.spec.num_kv_heads, batch.spec.v_head_dim)
    assert torch.equal(stored[forward_batch.out_cache_loc], v.reshape(stored[forward_batch.out_cache_loc].shape))
    expected = decode._decode_expected(batch, window, sinks)
    assert cp_case.max_abs_err(out.reshape(expected.shape), expected) <= cp_case.tolerance(batch.spec.dtype)
