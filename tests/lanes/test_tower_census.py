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
ATTENTION_READ = "mm_encoder/common.py"     # vllm.mm_encoder_attn's one read of a cu_seqlens tensor

# tower: ((upstream, shim) for forward 0, (upstream, shim) for forward 1), the same in vLLM
# 0.26.0 and 0.30.0. Upstream reads cu_seqlens back once per layer (3 layers here).
EXPECTED = {
    # 0 left: cu_seqlens is built with NumPy on the host and copied by the tower itself
    # (0.26: .to(device, non_blocking=True); 0.30: async_tensor_h2d); vllm.qwen2_vl_host_lengths
    # keeps the host array on the copy, so the attention reads nothing (without it: 1).
    "Qwen2-VL": ((3, 0), (3, 0)),
    # 0 left: cu_seqlens is built on the host from the host grid (repeat_interleave) and copied
    # by the tower (0.26: .to(device, non_blocking=True); 0.30: async_tensor_h2d);
    # vllm.qwen3_omni_vision_host_lengths keeps the grid's host lengths on the copy (without it: 1).
    "Qwen3-Omni": ((3, 0), (3, 0)),
    # 0 left: upstream builds cu_seqlens on the device (grid list -> torch.tensor(device=...), a
    # blocking copy), so repeat_interleave with device repeats reads them back (shape), and the
    # attention reads cu_seqlens once per layer; vllm.dots_ocr_host_lengths builds it on the host
    # from the list and keeps the host tensor on its non-blocking copy (without it: 2).
    "dots.ocr": ((4, 0), (4, 0)),
    # 1 left, none of them the attention's: cu_seqlens goes through maybe_recompute_cu_seqlens
    # (0 attention reads); _build_window_cu_seqlens reads the device image_grid_thw (.tolist()).
    "LLaVA-OneVision-2": ((4, 1), (4, 1)),
    # 30 / 48 left: the grid is on the device (Ernie's field config), and rot_pos_emb iterates
    # it (torch.arange, expand and reshape sized by device scalars: 9 reads per frame row), the
    # rotary table reads max(grid), cu_seqlens is built on the device (repeat_interleave: shape),
    # and the attention reads cu_seqlens once. (Counted 26 / 40 and 24 / 38 before the counter
    # counted both sizes a reshape reads in one call: benchmarks/results/cuda-syncs.txt.)
    "Ernie4.5-VL": ((32, 30), (50, 48)),
}


# The towers beyond the first four (GLM-OCR, Keye-VL, PaddleOCR-VL, HunYuan-Vision, RADIO): (upstream, shim) per forward, by vLLM release where they differ.
# None: the release has no module for the tower (checked, not skipped).
EXPECTED_BY_RELEASE = {
    # 0 left: cu_seqlens is built on the host from the host grid (repeat_interleave) and copied
    # by GLM-OCR's own forward (.to(self.device, non_blocking=True)); vllm.glm_ocr_host_lengths
    # keeps the grid's host lengths on the copy (without it: 1, the attention's).
    "GLM-OCR": {"0.26.0": ((3, 0), (3, 0)), "0.30.0": ((3, 0), (3, 0))},
    # The grid is on the device (field config): _process_image_input reads it back (0.26: .cpu()
    # per row; 0.30: one .tolist()), the projector's rearrange reads t, h, w (4 per image: einops
    # reshapes by two device sizes in one call), the attention reads cu_seqlens once; 0.26 also
    # reads max(position ids) for the rotary table and slices the output with device
    # cu_seqlens[i] (2 per image).
    "Keye-VL": {"0.26.0": ((18, 16), (25, 23)), "0.30.0": ((12, 10), (16, 14))},
    # Per image: encode_image builds cu_seqlens on the host and copies it; 0.30 copies it with
    # async_tensor_h2d, whose host values vllm.paddleocr_vl_host_lengths keeps on the copy (0 left;
    # without it: the attention's read, once per image). 0.26 copies with torch.tensor(...).to()
    # (not patched: the attention reads it once per image), reads the device grid row (.tolist():
    # its field config sends the grid to the device; 0.30's keeps it on the host) and
    # max(position ids) for the rotary table.
    "PaddleOCR-VL": {"0.26.0": ((10, 6), (15, 9)), "0.30.0": ((6, 0), (9, 0))},
    # Upstream's 1, the tower's own: (cu_seqlens[1:] - cu_seqlens[:-1]).tolist() of the copy it just
    # made; vllm.hunyuan_vision_host_lengths splits by the host tensor's (0). The attention runs per
    # image without cu_seqlens (no read upstream either).
    "HunYuan-Vision": {"0.26.0": ((1, 0), (1, 0)), "0.30.0": None},
    # 0 left: with more than one image, radio.py's _inter_image_mask_metadata_from_seq_lens
    # builds cu_seqlens with torch.tensor(accumulate(host seq_lens), device=...) (the 1 blocking
    # copy, both sides); vllm.radio_host_lengths keeps the host lengths on that tensor, so the
    # attention reads nothing (without it: 1, vllm.mm_encoder_attn's; upstream reads once per
    # layer, in _maybe_compute_cu_seqlens on A2).
    "RADIO": {"0.26.0": ((3, 0), (3, 0)), "0.30.0": ((3, 0), (3, 0))},
}

# the releases the census measured, where vllm.mm_encoder_host_lengths applies
CENSUS_RELEASES = sorted({release for rows in EXPECTED_BY_RELEASE.values() for release in rows})
pytestmark = [pytest.mark.claimed("vllm.mm_encoder_host_lengths", pinned={"vllm": CENSUS_RELEASES}),
              pytest.mark.patch("vllm.mm_encoder_host_lengths", "vllm.mm_encoder_attn",
                                "vllm.qwen2_vl_host_lengths", "vllm.qwen3_omni_vision_host_lengths",
                                "vllm.glm_ocr_host_lengths", "vllm.hunyuan_vision_host_lengths",
                                "vllm.radio_host_lengths", "vllm.paddleocr_vl_host_lengths",
                                "vllm.dots_ocr_host_lengths")]

# vllm.mm_encoder_attn's reads of cu_seqlens per forward, where not 0: one per tensor (PaddleOCR-VL
# encodes each image alone: one tensor per image, 2 images then 3; by release where they differ).
ATTENTION_READS = {"Ernie4.5-VL": (1, 1), "Keye-VL": (1, 1),
                   "PaddleOCR-VL": {"0.26.0": (2, 3), "0.30.0": (0, 0)}}


# blocking host->device copies per forward (upstream, shim), where the shim's differ from upstream's:
# dots.ocr's grid list and rotary ids (vllm.dots_ocr_host_lengths copies both non-blocking)
BLOCKING_COPIES = {"dots.ocr": (2, 0)}


def expected_attention_reads(name):
    reads = ATTENTION_READS.get(name, (0, 0))
    return reads[release()] if isinstance(reads, dict) else reads


@pytest.fixture(scope="module")
def stack():
    from npu_shim.testing import census

    return census.setup()


def release():
    from importlib.metadata import version

    return version("vllm")


@pytest.mark.parametrize("name", list(EXPECTED) + list(EXPECTED_BY_RELEASE))
def test_census(stack, name):
    import importlib.util

    from npu_shim.testing import census

    expected = EXPECTED[name] if name in EXPECTED else EXPECTED_BY_RELEASE[name][release()]
    if expected is None:
        assert importlib.util.find_spec(census.CENSUS[name].module) is None and name not in census._MODULES
        return
    for run in census.side_by_side(stack, name):
        syncs, up_syncs = run.syncs, run.up_syncs
        print("census %s vllm %s A2 forward %d: upstream %s -> shim %s"
              % (name, release(), run.index, up_syncs.summary(), syncs.summary()))
        for event in syncs.events:
            print("    shim: %s" % (event,))
        assert (up_syncs.count, syncs.count) == expected[run.index], \
            (up_syncs.summary(), [str(e) for e in syncs.events])
        attention_reads = sum(ATTENTION_READ in e.location for e in syncs.events)
        assert attention_reads == expected_attention_reads(name)[run.index], syncs.summary()
        assert (up_syncs.h2d_count, syncs.h2d_count) == BLOCKING_COPIES.get(name, (up_syncs.h2d_count,) * 2)
        census.assert_matches_references(stack, name, run, TOWER_TOL)
