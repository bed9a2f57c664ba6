"""A census of vLLM vision towers beyond Qwen2.5-VL, Qwen3-VL, Kimi-VL and
GLM-4.1V, and the device->host reads one whole forward makes, upstream (vLLM's tower code, vllm-ascend's
untouched ``AscendMMEncoderAttention``) -> with ``vllm.mm_encoder_host_lengths`` +
``vllm.mm_encoder_attn``.

Towers, stand-ins and how each is called: :mod:`npu_shim.testing.census`. A2, in
``torch.inference_mode()``, two forwards with different grids, each with a
multi-frame item. The attention change reaches the ``cu_seqlens`` vLLM copies
through ``MMEncoderAttention.maybe_recompute_cu_seqlens``, and the copies Qwen2-VL's,
Qwen3-Omni's, GLM-OCR's, RADIO's and PaddleOCR-VL's vision towers make themselves
(``vllm.qwen2_vl_host_lengths``, ``vllm.qwen3_omni_vision_host_lengths``,
``vllm.glm_ocr_host_lengths``, ``vllm.radio_host_lengths``, ``vllm.paddleocr_vl_host_lengths``),
the lengths dots.ocr's tower builds from its host grid (``vllm.dots_ocr_host_lengths``),
and HunYuan-Vision's split of its output (``vllm.hunyuan_vision_host_lengths``); where a tower builds ``cu_seqlens`` on
the device, vllm.mm_encoder_attn's one read per tensor per forward stays, and
the counts below say so.

Gate: the shim's count per forward as measured (the comment on each row says
what remains and why), upstream's beside it; outputs ``torch.equal`` to
upstream's, close to vLLM's own TORCH_SDPA tower and to a float64 copy whose
attention is ``npu_shim.testing.attention_f64``.
"""

import pytest


# |tower - float64 tower| and |tower - TORCH_SDPA tower|, relative to max |float64 tower| (no
# floor); measured worst over the census towers (latest-vllm and vllm-0.30, benchmarks/results/
# census-*.json): bfloat16 1.6e-2, float16 2.0e-3
TOWER_TOL = {"bfloat16": 1e-1, "float16": 8e-3}
ATTENTION_READ = "mm_encoder/common.py"             # vllm.mm_encoder_attn's one read of a cu_seqlens tensor
UPSTREAM_ATTENTION_READ = "ops/mm_encoder_attention.py"  # vllm-ascend's read of cu_seqlens, once per layer

# Upstream's reads are measured on upstream's own code in the same run (census.side_by_side), not
# written down per release: the gate is what the shim leaves of them. Per forward, the shim's reads
# are upstream's, less
#  * the attention's reads: upstream reads each cu_seqlens tensor back once per layer (checked: a
#    positive multiple of the tower's layers); the shim reads it at most once (mm_encoder/common.py),
#    and not at all where the tower's cu_seqlens reaches the attention with its host values;
#  * the reads of the tower's own code its tower patch removes (OWN_READS_REMOVED, each checked
#    present upstream: a tower patch whose defect upstream fixed would fail here).
# The shim's other reads are upstream's, site for site (function and file).

# Towers whose cu_seqlens is a device tensor the shim cannot give host values (built on the device
# from a device grid): the attention reads it once per forward per tensor, not once per layer.
# PaddleOCR-VL is one where vllm.paddleocr_vl_host_lengths does not apply (ATTENTION_LEFT_UNLESS).
ATTENTION_LEFT = {
    # where the field config sends the grid to the device (0.26.0), cu_seqlens is built there
    # (repeat_interleave), rot_pos_emb iterates the device grid (torch.arange, expand and reshape sized
    # by device scalars) and the rotary table reads max(grid): upstream's reads, and they stay; where
    # it keeps the grid on the host (0.30.0 on), cu_seqlens is built there and sent to the device by
    # async_tensor_h2d, which no patch keeps the host values of yet
    "Ernie4.5-VL",
    # the grid is on the device (field config): _process_image_input reads it back, the projector's
    # rearrange reads t, h, w (einops reshapes by device sizes), and the tower's own forward reads
    # some releases' position ids and output slices: upstream's, and they stay
    "Keye-VL",
}
# tower -> the patch that gives its cu_seqlens copy host values; where it applies, nothing is left
ATTENTION_LEFT_UNLESS = {"PaddleOCR-VL": "vllm.paddleocr_vl_host_lengths"}

# tower -> the sites (function, file) of upstream's own reads that its tower patch removes
OWN_READS_REMOVED = {
    # upstream builds cu_seqlens on the device (grid list -> torch.tensor(device=...), a blocking
    # copy), so repeat_interleave with device repeats reads them back (shape);
    # vllm.dots_ocr_host_lengths builds it on the host from the list
    "dots.ocr": {("forward", "models/dots_ocr.py")},
    # (cu_seqlens[1:] - cu_seqlens[:-1]).tolist() of the copy the tower just made;
    # vllm.hunyuan_vision_host_lengths splits by the host tensor's. Its attention runs per image
    # without cu_seqlens (no attention read upstream either)
    "HunYuan-Vision": {("forward", "models/hunyuan_vision.py")},
}
# Towers whose attention takes no cu_seqlens (upstream reads none there)
NO_CU_SEQLENS = {"HunYuan-Vision"}

# Towers measured (vLLM's modules, :mod:`npu_shim.testing.census`); one the installed vLLM has no
# module for is checked absent (HunYuan-Vision from 0.30), not skipped.
TOWERS = ("Qwen2-VL", "Qwen3-Omni", "dots.ocr", "LLaVA-OneVision-2", "Ernie4.5-VL", "GLM-OCR", "Keye-VL",
          "PaddleOCR-VL", "HunYuan-Vision", "RADIO")

# The releases the census was written on, where vllm.mm_encoder_host_lengths applies (the stand-ins of
# npu_shim.testing.census build each tower as these releases' models call it).
pytestmark = [pytest.mark.claimed("vllm.mm_encoder_host_lengths", pinned={"vllm": ["0.26.0", "0.30.0"]}),
              pytest.mark.patch("vllm.mm_encoder_host_lengths", "vllm.mm_encoder_attn",
                                "vllm.qwen2_vl_host_lengths", "vllm.qwen3_omni_vision_host_lengths",
                                "vllm.glm_ocr_host_lengths", "vllm.hunyuan_vision_host_lengths",
                                "vllm.radio_host_lengths", "vllm.paddleocr_vl_host_lengths",
                                "vllm.dots_ocr_host_lengths")]


# Towers whose patch removes upstream's blocking host->device copies (measured upstream, checked present):
# dots.ocr's grid list and rotary ids (vllm.dots_ocr_host_lengths copies both non-blocking). Elsewhere
# the shim makes upstream's blocking copies, no more and no fewer.
BLOCKING_COPIES_REMOVED = {"dots.ocr"}


def site(event):
    """``(function, "dir/file.py")`` of a read: where it is, without the line (a patch's edit moves lines)."""
    where, _, function = event.location.partition(" in ")
    return function, where.rsplit(":", 1)[0]


def attention_left(name):
    from npu_shim.testing.claims import claimed_family

    if name in ATTENTION_LEFT_UNLESS:
        return claimed_family(ATTENTION_LEFT_UNLESS[name]) is None
    return name in ATTENTION_LEFT


def expected_shim_sites(name, upstream_events, tower_layers):
    """The shim's reads (a Counter of sites) as upstream's events say they must be, by the rules above."""
    from collections import Counter

    upstream = Counter(site(e) for e in upstream_events)
    attention = sum(n for (_, where), n in upstream.items() if where == UPSTREAM_ATTENTION_READ)
    if name in NO_CU_SEQLENS:
        assert attention == 0, upstream
        tensors = 0
    else:
        assert attention > 0 and attention % tower_layers == 0, \
            "upstream reads cu_seqlens once per layer (%d layers): %s" % (tower_layers, upstream)
        tensors = attention // tower_layers
    for removed in OWN_READS_REMOVED.get(name, ()):
        assert upstream[removed] > 0, "upstream no longer reads at %s: %s" % (removed, upstream)
    expected = Counter({s: n for s, n in upstream.items()
                        if s[1] != UPSTREAM_ATTENTION_READ and s not in OWN_READS_REMOVED.get(name, ())})
    if attention_left(name):
        expected[("host_values", ATTENTION_READ)] = tensors
    return +expected


@pytest.fixture(scope="module")
def stack():
    from npu_shim.testing import census

    return census.setup()


@pytest.mark.parametrize("name", TOWERS)
def test_census(stack, name):
    import importlib.util
    from collections import Counter
    from importlib.metadata import version

    from npu_shim.testing import census

    if name not in census._MODULES:
        assert importlib.util.find_spec(census.CENSUS[name].module) is None, name
        return
    for run in census.side_by_side(stack, name):
        syncs, up_syncs = run.syncs, run.up_syncs
        print("census %s vllm %s A2 forward %d: upstream %s -> shim %s"
              % (name, version("vllm"), run.index, up_syncs.summary(), syncs.summary()))
        for event in syncs.events:
            print("    shim: %s" % (event,))
        expected = expected_shim_sites(name, up_syncs.events, run.layers)
        assert Counter(site(e) for e in syncs.events) == expected, \
            (up_syncs.summary(), [str(e) for e in syncs.events])
        assert syncs.count < up_syncs.count, (up_syncs.summary(), syncs.summary())
        if name in BLOCKING_COPIES_REMOVED:
            assert up_syncs.h2d_count > syncs.h2d_count == 0, (up_syncs.h2d_events, syncs.h2d_events)
        else:
            assert syncs.h2d_count == up_syncs.h2d_count, (up_syncs.h2d_events, syncs.h2d_events)
        census.assert_matches_references(stack, name, run, TOWER_TOL)
