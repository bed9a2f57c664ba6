"""Emulation of the rotary position-embedding ops: ``torch_npu.npu_rotary_mul`` and
``torch_npu.npu_mrope``.

vllm-ascend's calls: ``npu_mrope`` in ``rope_forward_oot`` (what ``AscendRotaryEmbedding``
runs through ``torch.ops.vllm.npu_rotary_embedding`` when Triton is absent; 1-D positions,
``mrope_section=[0, 0, 0]``) and in ``AscendMRotaryEmbedding.forward_oot`` (Qwen2/2.5-VL
M-RoPE, 2-D positions, ``mrope_section=[16, 24, 24]``); ``npu_rotary_mul`` in
``AscendApplyRotaryEmb.forward_oot`` (the vision towers' rotary).

Documented behaviour implemented:

* ``npu_rotary_mul(input, r1, r2, rotary_mode="half") -> Tensor`` (Ascend Extension for
  PyTorch API reference, torch_npu.npu_rotary_mul; CANN aclnnRotaryPositionEmbedding):
  ``r1`` is cos and ``r2`` sin, broadcast to ``input``; ``"half"``:
  ``out = x * cos + cat(-x[D/2:], x[:D/2]) * sin``; ``"interleave"``: the same on adjacent
  pairs, ``rotate(x)[2i] = -x[2i+1]``, ``rotate(x)[2i+1] = x[2i]``. Other modes are refused.
* ``npu_mrope(positions, query, key, cos_sin_cache, head_size, *, mrope_section=None,
  rotary_mode="half", cache_mode="default") -> (query_out, key_out)`` (op-plugin
  ``_mrope_v1``; CANN aclnnRopeWithSinCosCache): ``query`` (T, Nq * head_size) and ``key``
  (T, Nk * head_size); ``rotary_dim = cos_sin_cache.shape[-1]``; ``cos, sin =
  cos_sin_cache[positions].chunk(2, -1)``. With 2-D positions (3, T) the three rows are
  taken section by section: ``cos = cat(cos[0, :, :s0], cos[1, :, s0:s0+s1],
  cos[2, :, s0+s1:s0+s1+s2])`` (sin alike). The first ``rotary_dim`` of each head is
  rotated (``"half"``: neox pairs ``(i, i + rotary_dim/2)``; ``"interleave"``: adjacent
  pairs), the rest passes through. op-plugin checks ``rotary_mode`` is "half" or
  "interleave" and ``cache_mode`` "default" or "interleave"; the emulation implements
  ``cache_mode="default"`` and refuses the interleaved M-RoPE cache layout (not emulated).

* ``_npu_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style)``
  (vllm-ascend 0.18's ``rope_forward_oot``; the in-place rotary of vLLM's ``rotary_embedding``
  kernel, which it replaces): ``query`` (T, Nq * head_size) and ``key`` (T, Nk * head_size) are
  rotated in place, every head by ``cos, sin = cos_sin_cache[positions].chunk(2, -1)``, neox
  pairs when ``is_neox_style`` else adjacent pairs; ``cos_sin_cache.shape[-1]`` is the rotary
  dim (the caller passes the rotary slice with ``head_size = rotary_dim`` for partial rotary).

* ``npu_apply_rotary_pos_emb(query, key, cos, sin, layout="BSH", rotary_mode="half") -> (query, key)``
  (op-plugin ``ApplyRotaryPosEmbNpuOpApi.cpp``; CANN aclnnApplyRotaryPosEmb / aclnnApplyRotaryPosEmbV2,
  "计算结果执行原地更新"): query and key 4-D in ``layout`` (``"BSH"``/``"BSND"``, ``"SBND"``,
  ``"BNSD"``; TND is not emulated), rotated **in place** and returned: ``q_embed = q * cos +
  rotate(q) * sin`` (key alike), ``cos`` and ``sin`` broadcast to them (one head axis of 1);
  ``"half"``: ``rotate(x) = cat(-x2, x1)`` of the two halves; ``"quarter"``: the same within each
  half (``cat(-x2, x1, -x4, x3)`` of the four quarters); ``"interleave"``: adjacent pairs. dtypes:
  float16, float32, and bfloat16 on A2 only ("Atlas 推理系列产品: 不支持BFLOAT16"). vllm-ascend's 310P
  M-RoPE (``AscendMRotaryEmbedding310``) calls it with rotary dims 64 or 128.

Computed in float32 (float64 in a test) and rounded to the input dtype once.
"""
import torch

from npu_shim.emulation import dtypes

ROTARY_MUL = "npu_rotary_mul"
MROPE = "npu_mrope"
ROTARY_EMBEDDING = "_npu_rotary_embedding"
APPLY_ROTARY = "npu_apply_rotary_pos_emb"
MODES = ("half", "interleave")
APPLY_MODES = ("half", "quarter", "interleave")
APPLY_LAYOUTS = ("BSH", "BSND", "SBND", "BNSD")


def _dt(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _rotate(x, mode):
    if mode == "quarter":
        first, second = x.chunk(2, dim=-1)
        return torch.cat((_rotate(first, "half"), _rotate(second, "half")), dim=-1)
    if mode == "half":
        first, second = x.chunk(2, dim=-1)
        return torch.cat((-second, first), dim=-1)
    even, odd = x[..., 0::2], x[..., 1::2]
    return torch.stack((-odd, even), dim=-1).flatten(-2)


def _check_mode(op, mode):
    if mode not in MODES:
        raise ValueError("%s: rotary_mode %r is not one of %s" % (op, mode, MODES))


def npu_rotary_mul(input, r1, r2, rotary_mode="half"):
    dtypes.check(ROTARY_MUL, input=input, r1=r1, r2=r2)
    _check_mode(ROTARY_MUL, rotary_mode)
    if r1.shape != r2.shape:
        raise ValueError("%s: r1 %s and r2 %s must have one shape"
                         % (ROTARY_MUL, tuple(r1.shape), tuple(r2.shape)))
    if input.shape[-1] % 2 or r1.shape[-1] != input.shape[-1]:
        raise ValueError("%s: the last dim of input (%d) must be even and equal r1's (%d)"
                         % (ROTARY_MUL, input.shape[-1], r1.shape[-1]))
    try:
        torch.broadcast_shapes(input.shape, r1.shape)
    except RuntimeError:
        raise ValueError("%s: r1/r2 %s do not broadcast to input %s"
                         % (ROTARY_MUL, tuple(r1.shape), tuple(input.shape))) from None
    dt = _dt(input)
    x = input.to(dt)
    out = x * r1.to(dt) + _rotate(x, rotary_mode) * r2.to(dt)
    return out.to(input.dtype)


def _mrope_cos_sin(positions, cache, mrope_section):
    half = cache.shape[-1] // 2
    pos = positions.to(device=cache.device, dtype=torch.long)
    if bool(((pos < 0) | (pos >= cache.shape[0])).any()):
        raise ValueError("%s: a position is outside cos_sin_cache's %d rows" % (MROPE, cache.shape[0]))
    cos, sin = cache[pos].chunk(2, dim=-1)           # (T, half) or (3, T, half)
    if positions.dim() == 1:
        return cos, sin
    sections = [int(s) for s in (mrope_section or ())]
    if len(sections) != positions.shape[0] or sum(sections) != half:
        raise ValueError("%s: mrope_section %s must have one entry per positions row (%d) and sum "
                         "to rotary_dim / 2 = %d" % (MROPE, sections, positions.shape[0], half))
    bounds = [0]
    for s in sections:
        bounds.append(bounds[-1] + s)
    pick = lambda t: torch.cat([t[i, :, bounds[i]:bounds[i + 1]] for i in range(len(sections))], dim=-1)
    return pick(cos), pick(sin)


def _apply(x, head_size, cos, sin, mode):
    t = x.shape[0]
    heads = x.reshape(t, -1, head_size).to(cos.dtype)
    rot = cos.shape[-1] * 2
    xr, xp = heads[..., :rot], heads[..., rot:]
    if mode == "half":
        c, s = torch.cat((cos, cos), -1), torch.cat((sin, sin), -1)
    else:
        c, s = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)
    out = xr * c[:, None, :] + _rotate(xr, mode) * s[:, None, :]
    return torch.cat((out, xp), dim=-1).reshape(x.shape)


def npu_mrope(positions, query, key, cos_sin_cache, head_size, *, mrope_section=None,
              rotary_mode="half", cache_mode="default"):
    dtypes.check(MROPE, query=query, key=key, cos_sin_cache=cos_sin_cache)
    _check_mode(MROPE, rotary_mode)
    if cache_mode != "default":
        if cache_mode == "interleave":
            raise NotImplementedError("%s: cache_mode='interleave' is not emulated" % MROPE)
        raise ValueError("%s: cache_mode %r is not 'default' or 'interleave'" % (MROPE, cache_mode))
    if positions.dtype not in (torch.int32, torch.int64):
        raise ValueError("%s: positions must be int32 or int64, got %s" % (MROPE, positions.dtype))
    if positions.dim() not in (1, 2):
        raise ValueError("%s: positions must be (T,) or (3, T), got %s" % (MROPE, tuple(positions.shape)))
    tokens = positions.shape[-1]
    head_size = int(head_size)
    for name, x in (("query", query), ("key", key)):
        if x.dim() != 2 or x.shape[0] != tokens or x.shape[1] % head_size:
            raise ValueError("%s: %s must be (T=%d, heads * head_size=%d), got %s"
                             % (MROPE, name, tokens, head_size, tuple(x.shape)))
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] % 2 or cos_sin_cache.shape[-1] > head_size:
        raise ValueError("%s: cos_sin_cache must be (max_position, rotary_dim <= head_size), rotary_dim "
                         "even; got %s" % (MROPE, tuple(cos_sin_cache.shape)))
    cos, sin = _mrope_cos_sin(positions, cos_sin_cache.to(_dt(query)), mrope_section)
    return (_apply(query, head_size, cos, sin, rotary_mode).to(query.dtype),
            _apply(key, head_size, cos, sin, rotary_mode).to(key.dtype))


def _npu_rotary_embedding(positions, query, key, head_size, cos_sin_cache, is_neox_style):
    dtypes.check(ROTARY_EMBEDDING, query=query, key=key, cos_sin_cache=cos_sin_cache)
    if positions.dtype not in (torch.int32, torch.int64) or positions.dim() != 1:
        raise ValueError("%s: positions must be 1-D int32/int64, got %s %s"
                         % (ROTARY_EMBEDDING, tuple(positions.shape), positions.dtype))
    tokens, head_size = positions.shape[0], int(head_size)
    for name, x in (("query", query), ("key", key)):
        if x.dim() != 2 or x.shape[0] != tokens or x.shape[1] % head_size:
            raise ValueError("%s: %s must be (T=%d, heads * head_size=%d), got %s"
                             % (ROTARY_EMBEDDING, name, tokens, head_size, tuple(x.shape)))
    if cos_sin_cache.dim() != 2 or cos_sin_cache.shape[-1] % 2 or cos_sin_cache.shape[-1] > head_size:
        raise ValueError("%s: cos_sin_cache must be (max_position, rotary_dim <= head_size), rotary_dim "
                         "even; got %s" % (ROTARY_EMBEDDING, tuple(cos_sin_cache.shape)))
    mode = "half" if is_neox_style else "interleave"
    cos, sin = _mrope_cos_sin(positions, cos_sin_cache.to(_dt(query)), None)
    query.copy_(_apply(query, head_size, cos, sin, mode))
    key.copy_(_apply(key, head_size, cos, sin, mode))


def npu_apply_rotary_pos_emb(query, key, cos, sin, layout="BSH", rotary_mode="half"):
    dtypes.check(APPLY_ROTARY, query=query, key=key, cos=cos, sin=sin)
    if rotary_mode not in APPLY_MODES:
        raise ValueError("%s: rotary_mode %r is not one of %s" % (APPLY_ROTARY, rotary_mode, APPLY_MODES))
    if layout not in APPLY_LAYOUTS:
        raise ValueError("%s: layout %r is not one of %s (TND is not emulated)" % (APPLY_ROTARY, layout, APPLY_LAYOUTS))
    for name, x in (("query", query), ("key", key), ("cos", cos), ("sin", sin)):
        if x.dim() != 4:
            raise ValueError("%s: %s must be 4-D (%s), got %s" % (APPLY_ROTARY, name, layout, tuple(x.shape)))
    d = query.shape[-1]
    if key.shape[-1] != d or cos.shape != sin.shape or cos.shape[-1] != d or d % (4 if rotary_mode == "quarter" else 2):
        raise ValueError("%s: the last dims of query %s, key %s, cos %s and sin %s must agree (and divide by the "
                         "mode's parts)" % (APPLY_ROTARY, tuple(query.shape), tuple(key.shape), tuple(cos.shape),
                                            tuple(sin.shape)))
    for name, x in (("query", query), ("key", key)):
        try:
            if torch.broadcast_shapes(x.shape, cos.shape) != x.shape:
                raise RuntimeError
        except RuntimeError:
            raise ValueError("%s: cos/sin %s do not broadcast to %s %s"
                             % (APPLY_ROTARY, tuple(cos.shape), name, tuple(x.shape))) from None
    dt = _dt(query)
    c, s = cos.to(dt), sin.to(dt)
    for x in (query, key):
        y = x.to(dt)
        x.copy_(y * c + _rotate(y, rotary_mode) * s)
    return query, key
