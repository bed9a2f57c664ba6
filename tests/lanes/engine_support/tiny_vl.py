"""The tiny Qwen2.5-VL the engine tests serve with an image (vLLM's and sglang's), and its
independent reference.

``save(folder, vision_head, text_head)``: a random-weight ``Qwen2_5_VLForConditionalGeneration`` (text:
2 layers, 4 heads of ``text_head``, 2 KV heads, mrope sections in Qwen2.5-VL's proportions; vision:
``VISION_DEPTH`` blocks, 2 heads of ``vision_head`` (80 is Qwen2.5-VL's own), patch 14, spatial merge
2, window 112 with block 1 full attention), float32, seeded, saved with transformers, with a
word-level tokenizer made here (``t0`` .. ``t127`` and Qwen2.5-VL's special tokens
``<|vision_start|>``, ``<|vision_end|>``, ``<|image_pad|>``, ``<|video_pad|>`` at the config's ids)
and the slow (PIL/numpy) Qwen2-VL image processor (no torchvision needed). No download. ``image()``:
an RGB picture made here (numpy). ``processed``: the processor's inputs for the prompt and image
(input ids with the image pads expanded, pixel values, ``image_grid_thw``). ``reference_steps``:
transformers' greedy decoding in float64 on the same weights and inputs, per generated token
``(token, log-probability, margin)``.
"""
VOCAB_WORDS = 128
VISION_START, VISION_END, IMAGE_PAD, VIDEO_PAD = 128, 129, 130, 131
END, UNK = 132, 133
VOCAB = 136
SPECIALS = {"<|vision_start|>": VISION_START, "<|vision_end|>": VISION_END, "<|image_pad|>": IMAGE_PAD,
            "<|video_pad|>": VIDEO_PAD, "<|endoftext|>": END, "<unk>": UNK}
# 168 x 112 pixels: a 12 x 8 grid of 14-pixel patches, 96 patches, 24 image tokens after the 2 x 2
# merge; the window of 112 pixels (4 x 4 merged tokens) cuts it into two windows.
IMAGE_HW = (112, 168)
PROMPT = "t5 t17 <|vision_start|><|image_pad|><|vision_end|> t9 t2 t44"
MAX_NEW = 6
GAIN = 2.0  # matrices of this gain (transformers' 0.02 init makes every logit a near-tie)
VISION_DEPTH = 2


def save(folder, vision_head=80, text_head=64):
    """``vision_head``: the tower's head size (hidden 2 x ``vision_head``). ``text_head``: the
    decoder's head size (hidden 4 x ``text_head``); its mrope sections are Qwen2.5-VL's proportions of
    ``text_head / 2`` (16/24/24 at 128, 8/12/12 at 64)."""
    import torch
    from transformers import Qwen2_5_VLConfig, Qwen2_5_VLForConditionalGeneration

    hidden = 4 * text_head
    sections = [text_head // 8, 3 * text_head // 16, 3 * text_head // 16]
    text = dict(vocab_size=VOCAB, hidden_size=hidden, intermediate_size=256, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=512,
                rope_theta=10000.0, tie_word_embeddings=False, bos_token_id=END, eos_token_id=END,
                rope_scaling={"type": "mrope", "mrope_section": sections})
    vision = dict(depth=VISION_DEPTH, hidden_size=2 * vision_head, num_heads=2, intermediate_size=256,
                  out_hidden_size=hidden, patch_size=14, spatial_merge_size=2, temporal_patch_size=2,
                  window_size=112, fullatt_block_indexes=[1], in_chans=3)
    config = Qwen2_5_VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE_PAD,
                              video_token_id=VIDEO_PAD, vision_start_token_id=VISION_START,
                              vision_end_token_id=VISION_END, **text)
    torch.manual_seed(0)
    model = Qwen2_5_VLForConditionalGeneration(config).to(torch.float32)
    with torch.no_grad():
        for param in model.parameters():
            if param.dim() > 1:
                param.copy_(torch.randn_like(param) * param[0].numel() ** -0.5 * GAIN)
    model.save_pretrained(folder)
    save_processor(folder)
    return folder


def _tokenizer_class():
    """The fast tokenizer class the tiny tokenizer is saved as. transformers 4's Qwen2.5-VL processor
    declares the tokenizer classes it accepts (``tokenizer_class``: Qwen2's, the class Qwen2.5-VL's
    checkpoints name) and refuses any other: there the word-level tokenizer is Qwen2's fast class
    (the tokenizer object, ``tokenizer.json``, is the same). transformers 5's processor declares none
    (it checks the tokenizer base class): the generic ``PreTrainedTokenizerFast``."""
    import transformers
    from transformers import Qwen2_5_VLProcessor

    names = getattr(Qwen2_5_VLProcessor, "tokenizer_class", None)
    fast = [n for n in (names if isinstance(names, tuple) else (names,)) if n and n.endswith("Fast")]
    return getattr(transformers, fast[0]) if fast else transformers.PreTrainedTokenizerFast


def _tokenizer():
    from tokenizers import AddedToken, Tokenizer, models, pre_tokenizers

    vocab = {"t%d" % i: i for i in range(VOCAB_WORDS)}
    vocab.update(SPECIALS)
    core = Tokenizer(models.WordLevel(vocab=vocab, unk_token="<unk>"))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in SPECIALS])
    return _tokenizer_class()(tokenizer_object=core, eos_token="<|endoftext|>", unk_token="<unk>",
                              pad_token="<|endoftext|>")


def _image_processor_class():
    """The slow (PIL/numpy) Qwen2-VL image processor of the installed transformers: transformers 5
    names it ``Qwen2VLImageProcessorPil`` (its module ``image_processing_pil_qwen2_vl``); transformers 4's
    slow one is ``Qwen2VLImageProcessor``."""
    try:
        from transformers.models.qwen2_vl.image_processing_pil_qwen2_vl import Qwen2VLImageProcessorPil
    except ImportError:
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import Qwen2VLImageProcessor

        return Qwen2VLImageProcessor
    return Qwen2VLImageProcessorPil


def save_processor(folder):
    """The tokenizer and the slow (PIL/numpy) image processor, saved as Qwen2.5-VL's processor."""
    tokenizer = _tokenizer()
    tokenizer.save_pretrained(folder)
    images = _image_processor_class()(patch_size=14, merge_size=2, temporal_patch_size=2,
                                      min_pixels=28 * 28, max_pixels=256 * 28 * 28)
    images.save_pretrained(folder)


def image():
    """An RGB picture, 168 x 112, made here: smooth gradients and a square."""
    import numpy as np
    from PIL import Image

    h, w = IMAGE_HW
    y, x = np.mgrid[0:h, 0:w]
    rgb = np.stack([(x * 255 // w), (y * 255 // h), ((x + y) * 127 // (h + w))], -1).astype(np.uint8)
    rgb[30:70, 50:110] = (250, 20, 90)
    return Image.fromarray(rgb, "RGB")


def processed(model_dir, prompt=PROMPT, img=None):
    """The processor's inputs (``input_ids``, ``attention_mask``, ``pixel_values``, ``image_grid_thw``)."""
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(model_dir)
    images = _image_processor_class().from_pretrained(model_dir)
    pix = images(images=[img if img is not None else image()], return_tensors="pt")
    merged = int(pix["image_grid_thw"].prod()) // 4
    text = prompt.replace("<|image_pad|>", " ".join(["<|image_pad|>"] * merged))
    ids = tokenizer(text, return_tensors="pt")
    return {"input_ids": ids["input_ids"], "attention_mask": ids["attention_mask"],
            "pixel_values": pix["pixel_values"], "image_grid_thw": pix["image_grid_thw"]}


def rope_positions(model_dir, inputs):
    """transformers' 3-D rope positions of the prompt (3, length): the image's tokens take its grid."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(model_dir, torch_dtype=torch.float64).eval()
    ids = inputs["input_ids"]
    if _takes_mm_token_type_ids(model):
        positions, _ = model.model.get_rope_index(ids, (ids == IMAGE_PAD).int(), inputs["image_grid_thw"],
                                                  attention_mask=torch.ones_like(ids))
    else:   # transformers 4: the image's tokens are found in input_ids by the config's image token id
        positions, _ = model.model.get_rope_index(ids, inputs["image_grid_thw"], attention_mask=torch.ones_like(ids))
    return positions[:, 0].tolist()


def _takes_mm_token_type_ids(model):
    """Whether the installed transformers' Qwen2.5-VL reads the image tokens' places from
    ``mm_token_type_ids`` (transformers 5) rather than from ``input_ids`` (transformers 4)."""
    import inspect

    return "mm_token_type_ids" in inspect.signature(model.model.get_rope_index).parameters


def reference_steps(model_dir, inputs, max_new=MAX_NEW):
    """transformers' Qwen2.5-VL, float64, greedy (``tiny.greedy_steps``), the whole sequence each step
    (no cache): per generated token ``(token, log-probability, margin)``."""
    import torch
    from transformers import Qwen2_5_VLForConditionalGeneration

    from engine_support import tiny

    model = Qwen2_5_VLForConditionalGeneration.from_pretrained(
        model_dir, torch_dtype=torch.float64, attn_implementation="eager").eval()
    typed = _takes_mm_token_type_ids(model)

    def last_logits(ids):
        ids = torch.tensor([ids])
        # mm_token_type_ids (1: an image token): transformers 5 computes the 3-D rope positions
        # from it, and without it silently uses 1-D positions; transformers 4 reads input_ids
        extra = {"mm_token_type_ids": (ids == IMAGE_PAD).int()} if typed else {}
        return model(input_ids=ids, attention_mask=torch.ones_like(ids),
                     pixel_values=inputs["pixel_values"].to(torch.float64),
                     image_grid_thw=inputs["image_grid_thw"], use_cache=False, **extra).logits[0, -1]

    return tiny.greedy_steps(last_logits, inputs["input_ids"][0].tolist(), max_new)
