"""sglang's ``MRotaryEmbedding`` built as its Qwen2-VL / Qwen2.5-VL models build it, on an emulated NPU.

``get_rope(head, rotary_dim, max_position, base, is_neox_style=True, rope_scaling={"type": "default",
"mrope_section": [...]})`` (the models' call; Qwen2-VL's ``rope_scaling`` carries ``mrope_section``),
with sglang's rotary modules answering "NPU" (their module-level ``_is_npu``, and ``torch_npu`` the
emulation), sglang's server args published where none are, and sglang's ``get_rope`` cache set aside
so each call builds a fresh layer. The layer's ``forward_npu`` is then looked up on the class as it
stands (the shim's, when installed). Multimodal positions (3, T) as Qwen2-VL's ``get_rope_index``
makes them: text tokens share one position on the three rows, image tokens run over (t, h, w).
"""
import contextlib
import importlib

import torch

from npu_shim.testing.attributes import attributes_set

HEAD, ROTARY_DIM, MAX_POSITION, BASE = 64, 64, 2048, 10000.0
SECTION = (8, 12, 12)                 # the tiny VL model's (tests/lanes/engine_support/tiny_vl.py)
HEADS, KV_HEADS = 4, 2
MODULES = ("sglang.srt.layers.rotary_embedding.base", "sglang.srt.layers.rotary_embedding.mrope")


@contextlib.contextmanager
def npu_rotary():
    """sglang's rotary modules see an NPU and the emulated torch_npu; yields ``make(dtype)``,
    which builds a fresh ``MRotaryEmbedding`` through ``get_rope``."""
    from npu_shim import emulation

    emulation.install()
    import torch_npu
    from sglang.srt import server_args

    factory = importlib.import_module("sglang.srt.layers.rotary_embedding.factory")
    with attributes_set() as put:
        try:
            server_args.get_global_server_args()
        except (ValueError, RuntimeError):     # none published (from 0.5.22 the accessor is retired and raises)
            server_args.set_global_server_args_for_scheduler(server_args.ServerArgs(model_path="dummy", device="cpu"))
        for name in MODULES:
            module = importlib.import_module(name)
            put(module, "_is_npu", True)
            put(module, "torch_npu", torch_npu)
        if hasattr(factory, "_ROPE_DICT"):
            put(factory, "_ROPE_DICT", {})

        def make(dtype=torch.float32):
            from sglang.srt.layers.rotary_embedding import get_rope

            if hasattr(factory, "_ROPE_DICT"):
                factory._ROPE_DICT.clear()
            return get_rope(HEAD, ROTARY_DIM, MAX_POSITION, BASE, True,
                            {"type": "default", "mrope_section": list(SECTION)}, dtype)

        yield make


def case(dtype=torch.float32, seed=0):
    """(positions (3, T), query, key): 3 text tokens, a 2 x 3 image grid (t=1), 2 text tokens."""
    text0 = [[0, 1, 2]] * 3
    t, h, w = [3] * 6, [3 + i // 3 for i in range(6)], [3 + i % 3 for i in range(6)]
    text1 = [[6, 7]] * 3
    positions = torch.tensor([a + b + c for a, b, c in zip(text0, (t, h, w), text1)], dtype=torch.long)
    g = torch.Generator().manual_seed(seed)
    tokens = positions.shape[1]
    query = torch.randn(tokens, HEADS * HEAD, generator=g).to(dtype)
    key = torch.randn(tokens, KV_HEADS * HEAD, generator=g).to(dtype)
    return positions, query, key
