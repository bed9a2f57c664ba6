"""``vllm.mm_merge_310p`` reached through its caller: vLLM's ``SupportsMultiModal.embed_input_ids``.

test_mm_merge_310p.py calls ``_merge_multimodal_embeddings`` itself. In serving the model runner calls
the model's ``embed_input_ids(input_ids, mm_embeds, is_multimodal=...)``; for the models that do not
override it (Qwen2.5-VL, Qwen3-VL, GLM-4.1V, ...) that is the mixin's own method, which embeds the
text ids through the language model's ``embed_input_ids`` and then imports
``_merge_multimodal_embeddings`` from ``vllm.model_executor.models.utils`` at call time and merges.
Here that method runs unedited, ``self`` a model whose language model is vLLM's own
``VocabParallelEmbedding`` (tiny vocabulary, deterministic weights): the stand-in is the rest of the
model (no decoder layers, no tower: the merge reads neither), because building a whole multimodal
model needs its checkpoint config.

On an emulated 310P (``NPU_SHIM_EMULATE_SOC``) with the aicpu IndexPut defect reproduced
(:func:`npu_shim.emulation.index_put.aicpu_index_put_defect`, as in test_mm_merge_310p.py),
float16 embeddings: the merged rows equal the float64 definition of the merge (the text rows the
embedding table's rows, the multimodal rows the items' rows in order), with no device->host read;
with the patch off (``NPU_SHIM_DISABLE=vllm.mm_merge_310p``) the mixin's merge fails as the
hardware's kernel does.
"""
import sys

import pytest

from npu_shim.patches.vllm.mm_merge_310p import NAME, TARGET

pytestmark = [pytest.mark.claimed(NAME), pytest.mark.patch(NAME)]

from mm_merge_310p_case import HIDDEN, ROWS, SOC_310P, SPANS  # noqa: E402  (tests/lanes/conftest.py)

VOCAB = 64                         # vLLM pads the vocabulary to a multiple of 64
IMAGE_TOKEN = 7


@pytest.fixture(scope="module")
def model():
    import mm_merge_310p_case
    import torch

    mm_merge_310p_case.setup()
    from vllm.model_executor.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from vllm.model_executor.models.interfaces import SupportsMultiModal

    class LanguageModel(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.embed_tokens = VocabParallelEmbedding(VOCAB, HIDDEN, params_dtype=torch.float16)
            gen = torch.Generator().manual_seed(0)
            with torch.no_grad():
                self.embed_tokens.weight.copy_(torch.randn(VOCAB, HIDDEN, generator=gen).half())

        def embed_input_ids(self, input_ids):
            return self.embed_tokens(input_ids)

    class Model(torch.nn.Module, SupportsMultiModal):
        """A multimodal model reduced to what ``embed_input_ids`` reads: its language model."""

        def __init__(self):
            super().__init__()
            self.language_model = LanguageModel()

        def get_language_model(self):
            return self.language_model

    assert "embed_input_ids" not in Model.__dict__     # the mixin's own method runs
    return Model()


def _case():
    import torch

    gen = torch.Generator().manual_seed(1)
    is_multimodal = torch.zeros(ROWS, dtype=torch.bool)
    for start, stop in SPANS:
        is_multimodal[start:stop] = True
    input_ids = torch.randint(0, VOCAB, (ROWS,), generator=gen)
    input_ids[is_multimodal] = IMAGE_TOKEN
    items = [torch.randn(stop - start, HIDDEN, generator=gen).half() for start, stop in SPANS]
    return input_ids, items, is_multimodal


def _reference(model, input_ids, items, is_multimodal):
    """The merge from its definition, float64: row i is the embedding table's row of id i, except the
    multimodal rows, which are the items' rows in order."""
    import torch

    table = model.language_model.embed_tokens.weight.detach().double()
    out = table[input_ids].clone()
    rows = torch.cat([item.double() for item in items])
    out[is_multimodal.nonzero().flatten()] = rows
    return out


def test_embed_input_ids_merges_on_310p_without_reads(model, monkeypatch):
    import torch

    import npu_shim
    from npu_shim.emulation.index_put import aicpu_index_put_defect
    from npu_shim.testing import count_host_syncs

    utils = sys.modules[TARGET]
    assert getattr(utils._merge_multimodal_embeddings, "__npu_shim_patch__", None) == NAME, \
        "vllm.mm_merge_310p is not applied to %s" % TARGET
    monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", SOC_310P)
    input_ids, items, is_multimodal = _case()
    before = npu_shim.stats()[NAME]["calls"]
    with count_host_syncs(device_tensors=items, device_modules=[model], follow_placement=True) as syncs:
        with aicpu_index_put_defect(syncs.is_device):
            merged = model.embed_input_ids(input_ids, items, is_multimodal=is_multimodal)
    assert npu_shim.stats()[NAME]["calls"] == before + 1      # the mixin reached the patched merge
    assert merged.dtype == torch.float16
    assert torch.equal(merged.double(), _reference(model, input_ids, items, is_multimodal))
    assert syncs.count == 0, syncs.summary()


def test_upstream_merge_fails_on_310p_through_the_same_caller(model, monkeypatch):
    """The check can fail: upstream's merge, reached the same way, fails on the emulated 310P defect."""
    utils = sys.modules[TARGET]
    patched = utils._merge_multimodal_embeddings
    monkeypatch.setattr(utils, "_merge_multimodal_embeddings", patched.__wrapped_upstream__)
    monkeypatch.setenv("NPU_SHIM_EMULATE_SOC", SOC_310P)
    from npu_shim.emulation.index_put import aicpu_index_put_defect
    from npu_shim.testing import count_host_syncs

    input_ids, items, is_multimodal = _case()
    with count_host_syncs(device_tensors=items, device_modules=[model], follow_placement=True) as syncs:
        with aicpu_index_put_defect(syncs.is_device):
            with pytest.raises(Exception) as raised:
                model.embed_input_ids(input_ids, items, is_multimodal=is_multimodal)
    assert "507018" in repr(raised.value) + repr(raised.value.__cause__), repr(raised.value)
