"""sglang.qwen3_vl_host_lengths — sglang's Qwen3-VL vision tower hands its attention the host lengths it built (0.5.11 - 0.5.15).

Why: before 0.5.16, ``Qwen3VLMoeVisionModel.forward`` builds ``cu_seqlens`` on the host
  (NumPy, from the host grid), moves it to "cpu" on NPU ("because of the attention op"),
  and then copies it to the device anyway (``cu_seqlens.to(self.device,
  non_blocking=True)``) for the blocks, whose only use of it on NPU is
  ``VisionAscendAttention``: that reads it back (0.5.11 - 0.5.13 ``seq_lens.to("cpu")``
  for ``_npu_flash_attention_unpad``, 0.5.14 - 0.5.15 ``cu_seqlens[1:].tolist()`` for
  FIA) in every layer. ``sglang.vision_device_lengths`` brings that to 1 read per forward
  (its own read of the device copy, ``vision_device_lengths.py:116``); the host had the
  numbers all along. (From 0.5.16 the tower hands the host tensor to
  ``prepare_vision_attention_metadata``: ``sglang.vision_host_lengths``, 0 reads.)
How: ``Qwen3VLMoeVisionModel.forward`` is replaced, on NPU with an attention backend other
  than ``flashinfer_cudnn`` and outside the ViT graph mode, by upstream's body with the
  blocks handed the host ``cu_seqlens`` it built (what upstream's attention turns the
  device copy back into), as Qwen2.5-VL and GLM-4V hand theirs. Every op on the data path
  (patch embedding, position embedding, rotary table, blocks, deepstack mergers, merger) is
  upstream's, in upstream's order, with the same arguments; the attention's op call and
  arguments are upstream's (its host-lengths path). 0 reads per forward. A grid on the
  device goes to upstream's forward.
  ``check`` accepts only the bodies the replacement was written from (source parsed,
  docstring and comments left out, hashed): 0.5.11 - 0.5.12 (``x`` copied blocking),
  0.5.13 - 0.5.14 (``x`` copied non-blocking), 0.5.15 (and the vectorized position
  embedding for many images).
Upstream fix: 0.5.16 (the metadata takes the host ``cu_seqlens``; its own reads are
  ``sglang.vision_host_lengths``'s).
Remove when: the pinned sglang is 0.5.16 or later.
"""

from npu_shim.patch import Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.structure import expect_body, module_class, own_function, replace_own

TARGET = "sglang.srt.models.qwen3_vl"
TOWER = "Qwen3VLMoeVisionModel"
FORWARD = TOWER + ".forward"
MODULE_NAMES = ("np", "envs", "get_global_server_args")


def host_grid(grid_thw):
    import torch

    if isinstance(grid_thw, list):
        return True
    return (isinstance(grid_thw, torch.Tensor) and grid_thw.device.type == "cpu"
            and grid_thw.device.index is None)


class _Tower:
    """One body of the tower's forward: ``x_non_blocking`` (0.5.13+: ``x`` copied with
    ``non_blocking=True``), ``vectorized`` (0.5.15: the vectorized position embedding when
    ``_use_vectorized_pos_embed`` says so)."""

    def __init__(self, digests, x_non_blocking, vectorized):
        self.digests, self.x_non_blocking, self.vectorized = digests, x_non_blocking, vectorized

    def check(self, module, context):
        tower = module_class(module, TOWER)
        expect_body(own_function(tower, "forward"), self.digests, "the %s replacement" % context.patch)
        missing = [name for name in MODULE_NAMES if not hasattr(module, name)]
        if missing or "_is_npu" not in vars(module):
            raise TargetMismatch("%s lacks %s" % (TARGET, ", ".join(missing + ["_is_npu"])))

    def build(self, module, context):
        return {FORWARD: replace_own(module, TOWER, "forward", self.make_forward, context,
                                     "the blocks take the host cu_seqlens the tower built (no read "
                                     "back in the attention)")}

    def make_forward(self, module, original, context):
        import torch

        x_copy = {"non_blocking": True} if self.x_non_blocking else {}
        vectorized = self.vectorized

        def forward(self, x, grid_thw):
            context.count("calls")
            if (module.envs.SGLANG_VIT_ENABLE_CUDA_GRAPH.get() or not module._is_npu or not host_grid(grid_thw)
                    or module.get_global_server_args().mm_attention_backend == "flashinfer_cudnn"):
                context.count("upstream_calls")
                return original(self, x, grid_thw)
            np = module.np
            x = x.to(device=self.device, dtype=self.dtype, **x_copy)
            x = self.patch_embed(x)

            if isinstance(grid_thw, list):
                grid_thw_list = grid_thw
                grid_thw = np.array(grid_thw, dtype=np.int32)
            else:
                grid_thw_list = grid_thw.tolist()
                grid_thw = grid_thw.cpu().numpy()

            if vectorized and self._use_vectorized_pos_embed(len(grid_thw_list)):
                pos_embeds = self.fast_pos_embed_interpolate_vectorized(grid_thw_list)
            else:
                pos_embeds = self.fast_pos_embed_interpolate_from_list(grid_thw_list)
            x += pos_embeds

            rotary_pos_emb_cos, rotary_pos_emb_sin = self.rot_pos_emb(grid_thw_list)

            token_cu_seqlens = np.repeat(grid_thw[:, 1] * grid_thw[:, 2], grid_thw[:, 0]).cumsum(
                axis=0, dtype=np.int32)
            token_cu_seqlens = np.concatenate([np.zeros(1, dtype=np.int32), token_cu_seqlens])
            # upstream: on NPU moved to "cpu", then copied to the device for the blocks, whose
            # attention reads it back in every layer; the blocks get the host tensor
            context.count("upstream_host_copies")
            cu_seqlens = torch.from_numpy(token_cu_seqlens)

            x = x.unsqueeze(1)

            deepstack_feature_lists = []
            num_deepstack_captured = 0
            for layer_num, blk in enumerate(self.blocks):
                x = blk(x, cu_seqlens=cu_seqlens, rotary_pos_emb_cos=rotary_pos_emb_cos,
                        rotary_pos_emb_sin=rotary_pos_emb_sin, max_seqlen=None, sequence_lengths=None)
                if layer_num in self.deepstack_visual_indexes:
                    deepstack_feature = self.deepstack_merger_list[num_deepstack_captured](x)
                    deepstack_feature_lists.append(deepstack_feature)
                    num_deepstack_captured += 1
            x = self.merger(x)
            hidden_states = torch.cat([x] + deepstack_feature_lists, dim=1)
            return hidden_states

        return forward


# body_digest of the upstream bodies the replacement was written from
FORWARD_0_5_11 = {"b34dacc032b7"}      # family blocking-x
FORWARD_0_5_13 = {"34710e038fb2"}      # family non-blocking-x
FORWARD_0_5_15 = {"6dece9da51ef"}      # family vectorized-pos-embed

BLOCKING_X = _Tower(FORWARD_0_5_11, x_non_blocking=False, vectorized=False)
NON_BLOCKING_X = _Tower(FORWARD_0_5_13, x_non_blocking=True, vectorized=False)
VECTORIZED_POS_EMBED = _Tower(FORWARD_0_5_15, x_non_blocking=True, vectorized=True)

KEEPS = "upstream's tower ops in upstream's order; the attention's op call on host lengths (upstream's path)"

PATCH = Patch(
    name="sglang.qwen3_vl_host_lengths",
    target=TARGET,
    replaces=(FORWARD,),
    requires={"sglang": ">=0.5.11,<0.5.16"},
    outside_window={"sglang": "above the window the tower hands its host cu_seqlens to the vision attention "
                              "metadata (sglang.vision_host_lengths); releases below the window were not read for this patch"},
    needs_npu=True,
    families=(
        Family(__name__ + ":BLOCKING_X", fence=">=0.5.11,<0.5.13", keeps=KEEPS),
        Family(__name__ + ":NON_BLOCKING_X", fence=">=0.5.13,<0.5.15", keeps=KEEPS),
        Family(__name__ + ":VECTORIZED_POS_EMBED", fence=">=0.5.15,<0.5.16", keeps=KEEPS),
    ),
    summary="Qwen3-VL's tower (before the vision attention metadata) hands its blocks the host cu_seqlens it built instead of a device "
            "copy its attention reads back: 0 reads per forward (upstream: 1 per layer; "
            "sglang.vision_device_lengths alone: 1)",
    # 0: what this patch is for; a read is the defect back.
    selftest=Selftest("npu_shim.selftest.sglang_tower:run", host_syncs=0, arguments={"tower": "Qwen3-VL"}),
)
