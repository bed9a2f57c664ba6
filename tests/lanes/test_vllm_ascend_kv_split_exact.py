"""``vllm.ascend_kv_split_exact`` on the real vllm-ascend wheels: ``vllm_ascend.utils.calc_split_factor``,
whose ratios the model runner divides each layer's KV-cache bytes by (``int(size // factor)`` for K and
for V), exact for head dims that do not divide their sum.

Before (upstream's function, float ratios): K 192 / V 128 loses a byte at every layer size, so the
runner's page assertion fails (the whole allocation, run by the runner's own code:
test_mimo_v2_runner_kv_cache.py). After: every split exact against integer arithmetic from the
layout, and the same numbers as upstream's wherever its floats were exact (K == V, DeepSeek's 512 / 64).
"""
import pytest

PATCH = "vllm.ascend_kv_split_exact"
pytestmark = [pytest.mark.claimed(PATCH), pytest.mark.patch(PATCH)]

SIZES = [blocks * block * heads * 2 for blocks in (1, 7, 60, 4096) for block in (16, 128) for heads in (1, 4, 8)]


# (K, V) head dims whose float ratios (sum / dim) are exact in binary: upstream's split is right there
EXACT_FLOATS = {(512, 64), (128, 128)}


def _split(factors, size):
    """What the runner does with the two factors: ``int(size // factor)`` bytes for K and for V."""
    k, v = factors
    return int(size // k), int(size // v)


@pytest.fixture(scope="module")
def utils():
    import importlib

    import npu_shim
    from npu_shim import emulation

    emulation.install()
    npu_shim.install()
    return importlib.import_module("vllm_ascend.utils")


def test_applied(utils):
    import npu_shim
    from npu_shim.testing.claims import claimed_family

    row = next(r for r in npu_shim.status() if r["name"] == PATCH)
    assert row["state"] == "applied" and row["family"] == claimed_family(PATCH).name, row
    assert utils.calc_split_factor.__npu_shim_patch__ == PATCH


def test_upstream_split_of_192_128_loses_a_byte(utils):
    upstream = utils.calc_split_factor.__wrapped_upstream__
    for unit in SIZES:
        size = unit * (192 + 128)
        k, v = _split(upstream([192, 128]), size)
        assert k == size * 192 // 320 - 1 and v == size * 128 // 320        # one byte short: the defect
        assert (k + v) % (320 * 2) != 0


@pytest.mark.parametrize("dims", [(192, 128), (512, 64), (128, 128), (576, 512), (96, 64)])
def test_split_is_exact(utils, dims):
    k_dim, v_dim = dims
    upstream = utils.calc_split_factor.__wrapped_upstream__
    for unit in SIZES:
        size = unit * (k_dim + v_dim)
        k, v = _split(utils.calc_split_factor([k_dim, v_dim]), size)
        assert (k, v) == (size * k_dim // (k_dim + v_dim), size * v_dim // (k_dim + v_dim))
        if dims in EXACT_FLOATS:
            assert (k, v) == _split(upstream([k_dim, v_dim]), size)           # upstream's numbers there
