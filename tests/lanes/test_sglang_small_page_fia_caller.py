"""``sglang.small_page_fia`` reached through its caller: sglang's ``RadixAttention.forward``.

test_sglang_small_page_fia.py calls ``AscendAttnBackend.forward_extend`` (the patched method) itself.
In serving a model's attention layer calls its ``RadixAttention`` with q, k, v and the
``ForwardBatch``; ``RadixAttention.forward`` reshapes k and v to heads and hands them to
``forward_batch.attn_backend.forward``, whose dispatch on the forward mode calls ``forward_extend`` for
a prefill. Here that chain runs unedited on the release's own classes (sglang_support/prefill_case.py:
``RadixAttention``, ``ForwardBatch`` with the real ``init_forward_metadata``, ``NPUMHATokenToKVPool``
on CPU); the stand-ins are prefill_case's: the backend's attributes set without ``__init__`` (it needs
a ModelRunner and an NPU) and ``save_kv_cache=False`` (the pool's scatter op is not emulated; the new
tokens' K/V are already in the cache).

Checked at page sizes 16 and 64 (GQA, cached prefixes, shuffled pages): the layer's output equals the
float64 causal reference within the dtype's tolerance and the one NPU call made is sglang's FIA prefill
(TND, ``block_size`` the page size). With the patch off (``NPU_SHIM_DISABLE=sglang.small_page_fia``) the
same caller makes upstream's ``_npu_flash_attention_qlens`` call, the op reported wrong at these page
sizes on the hardware (sglang #38196 / PR #39905), and the test fails.
"""
import pytest

NAME = "sglang.small_page_fia"
pytestmark = [pytest.mark.claimed(NAME), pytest.mark.patch(NAME)]

from sglang_support import prefill_case, shim  # noqa: E402  (tests/lanes/conftest.py)
from sglang_support.published import published  # noqa: E402

from npu_shim.testing import cp_case  # noqa: E402

TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
POOL = "sglang.srt.hardware_backend.npu.memory_pool_npu"
FIA, QLENS = "npu_fused_infer_attention_score", "_npu_flash_attention_qlens"

SPECS = [
    cp_case.Spec(extend_lens=(37, 20, 29), prefix_lens=(0, 16, 5), page_size=16, num_heads=8,
                 num_kv_heads=2, qk_head_dim=128, v_head_dim=128, seed=11),
    cp_case.Spec(extend_lens=(45, 30), prefix_lens=(64, 3), page_size=64, num_heads=8, num_kv_heads=1,
                 qk_head_dim=128, v_head_dim=128, seed=12),
]


@pytest.fixture(scope="module")
def modules():
    return shim.install(TARGET, POOL)


@pytest.fixture(autouse=True)
def sglang_fia_unset(monkeypatch):
    monkeypatch.delenv("ASCEND_USE_FIA", raising=False)


@pytest.mark.parametrize("spec", SPECS, ids=lambda s: s.label())
def test_radix_attention_forward_takes_the_fia_prefill(modules, spec):
    import torch_npu

    from npu_shim.testing import record_npu_calls, recorded_not_run

    batch = cp_case.make_batch(spec)
    backend, layer, forward_batch, q, k, v = prefill_case.prefill_inputs(*modules, batch)
    assert type(layer).__name__ == "RadixAttention" and forward_batch.forward_mode.is_extend()
    with published(backend, forward_batch), recorded_not_run(torch_npu, QLENS), record_npu_calls() as calls:
        out = layer(q, k, v, forward_batch, save_kv_cache=False)
    assert [c.name for c in calls] == [FIA], [c.name for c in calls]
    assert calls[0].kwargs["block_size"] == spec.page_size and calls[0].kwargs["input_layout"] == "TND"
    expected = prefill_case.expected(batch)
    out = out.reshape(expected.shape)
    assert cp_case.max_abs_err(out, expected) <= cp_case.tolerance(spec.dtype)
