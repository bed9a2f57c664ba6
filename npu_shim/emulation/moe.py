"""Emulation of the MoE ops vllm-ascend's unquantised, single-device MoE path runs
(``AscendFusedMoE`` with the all-gather/"allgather" communication, TP 1):

router (``ops/fused_moe/router/fused_topk_router.py`` via ``DeviceOperator.moe_gating_top_k``)
-> ``npu_moe_gating_top_k``; dispatch (``TokenDispatcherWithAllGather.token_dispatch`` via
``DeviceOperator.npu_moe_init_routing``) -> ``npu_moe_init_routing_v2``; experts
(``routed_experts.py`` ``apply_gmm1`` / ``apply_gmm2``) -> ``npu_grouped_matmul`` with
``npu_swiglu`` between; combine (``token_combine`` via ``DeviceOperator.npu_moe_token_unpermute``)
-> ``npu_moe_token_unpermute``.

Documented behaviour implemented:

* ``npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0,
  renorm=0, norm_type=1, out_flag=False, routed_scaling_factor=1.0, eps=1e-20)
  -> (y, expert_idx, out)`` (torch_npu.npu_moe_gating_top_k; CANN aclnnMoeGatingTopK), and
  vllm-ascend's own ``torch.ops._C_ascend.moe_gating_top_k(x, k, k_group, group_count,
  group_select_mode, renorm, norm_type, out_flag, routed_scaling_factor, eps, bias_opt=None)``
  (csrc moe_gating_top_k; what ``BaseDeviceAdaptor.moe_gating_top_k`` calls on A2/A3, with
  ``renorm = int(renormalize)``): ``normOut = softmax(x)`` (norm_type 0) or ``sigmoid(x)`` (1);
  the selection value is ``normOut + bias``; with ``group_count > 1`` the experts are split into
  groups, each scored by its max (group_select_mode 0) or the sum of its top two (1), and all
  but the best ``k_group`` groups are masked to -inf; ``expert_idx`` (int32) = top-k of the
  selection value; ``y`` = ``normOut`` at those experts, divided by ``sum(y) + eps`` for
  sigmoid or renorm=1 (L1), then times ``routed_scaling_factor``; ``out`` = normOut (float32)
  when ``out_flag``. The renorm=1 and softmax steps are those of the kernel's reference in
  vllm-ascend's op test (``moe_gating_top_k_numpy_ref``); torch_npu's page documents renorm=0
  and the scaling for sigmoid only, so its spelling refuses renorm=1 and a scaling factor
  with softmax. With sigmoid the page's formula already divides ``y`` by its sum (+ eps), so
  renorm=1 there computes the same; sglang's NPU router passes ``renorm=renormalize`` with a
  sigmoid router and a correction bias (``fused_topk_npu``: DeepSeek-V3- and
  MiMo-V2-Flash-shaped routers), which the emulation therefore takes.
* ``npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1,
  expert_capacity=-1, expert_num=-1, drop_pad_mode=0, expert_tokens_num_type=0,
  expert_tokens_num_flag=False, quant_mode=0, active_expert_range=[], row_idx_type=0)
  -> (expanded_x, expanded_row_idx, expert_tokens, expanded_scale)`` (Ascend Extension for
  PyTorch 7.0.0, torch_npu.npu_moe_init_routing_v2; CANN aclnnMoeInitRoutingV2), dropless
  mode (drop_pad_mode 0) without quantisation (quant_mode -1; other modes refused):
  ``sortedExpertIdx, sortedRowIdx = stable keyValueSort(expert_idx.flatten())``;
  ``expanded_row_idx[sortedRowIdx[i]] = i`` (row_idx_type 0); ``expanded_x[i] =
  x[sortedRowIdx[i] // K]`` for the first ``active_num`` rows; ``expert_tokens`` = per-expert
  count (type 1) or cumulative count (type 0) over ``active_expert_range`` = [start, end).
  Expert ids outside that range are refused (the page leaves their rows undefined).
* ``npu_grouped_matmul(x, weight, *, bias=None, ..., group_list=None, split_item=0,
  group_type=None, group_list_type=0, act_type=0, ...) -> list`` (torch_npu.npu_grouped_matmul):
  the case MoE uses, one ``x`` (M, K), one ``weight`` (E, K, N), ``group_type=0`` (groups split
  M), ``split_item`` 2 or 3 (one output): rows ``[start_e, end_e)`` of ``x`` are multiplied
  by ``weight[e]``; ``group_list`` gives the counts (group_list_type 1) or the cumulative ends
  (0). Optional ``bias`` (one (E, N) tensor in a list) is added per group. Rows past the last
  group are zero in the output. ``output_dtype`` None or x's own dtype (the page's non-quantised
  rows: float16, bfloat16, float32 each give their own; sglang's NPU MoE runner passes it, the
  model's half dtype: inside ``dtypes.float32_not_on_hardware`` float32 x stands in for it).
  Quantisation arguments are refused.
* ``npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
  restore_shape=None) -> Tensor`` (CANN aclnnMoeTokenUnpermute): ``out[i] = sum_j
  permuted_tokens[sorted_indices[i*K + j]] * probs[i, j]`` (K = probs.shape[1], 1 without probs).
* ``npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales,
  expanded_src_to_dst_row, export_for_source_row, drop_pad_mode=0) -> Tensor``
  (torch_npu.npu_moe_finalize_routing; CANN aclnnMoeFinalizeRoutingV2), sglang's NPU MoE combine
  (``NPUFinalizeRouting``, ``drop_pad_mode=2`` after ``npu_moe_init_routing_v2``): ``out[i] =
  skip1[i] + skip2[i] + sum_k scales[i, k] * (expanded_permuted_rows[r(i, k)] +
  bias[export_for_source_row[i, k]])``, ``r(i, k) = expanded_src_to_dst_row[i + k * NUM_ROWS]``
  (the page's formula, drop_pad_mode 0: the row index laid out by choice, as v1 routing's
  ``row_idx`` is) or ``expanded_src_to_dst_row[i * K + k]`` (drop_pad_mode 2: laid out by row,
  as ``npu_moe_init_routing_v2`` flattens ``expert_idx``); the V2 page gives both modes the
  dropless range [0, NUM_ROWS * K - 1]. The drop/pad modes (1, 3) and a call without ``scales``
  are refused. vllm-ascend's all-gather MoE does not call it: its comment reports "accuracy
  issues" with it (no reproduction given), and it uses ``npu_moe_token_unpermute`` instead.
"""
import torch

from npu_shim.emulation import dtypes
from npu_shim.emulation._common import not_implemented

GATING = "npu_moe_gating_top_k"
C_GATING = "moe_gating_top_k"
INIT_ROUTING = "npu_moe_init_routing_v2"
GMM = "npu_grouped_matmul"
UNPERMUTE = "npu_moe_token_unpermute"
FINALIZE = "npu_moe_finalize_routing"
# drop_pad_mode -> how expanded_src_to_dst_row is laid out over (row i, choice k) of NUM_ROWS rows
FINALIZE_LAYOUTS = {0: "column", 2: "row"}


def _dt(x):
    return torch.float64 if x.dtype == torch.float64 else torch.float32


def _gating(op, x, k, bias, k_group, group_count, group_select_mode, renorm, norm_type, out_flag,
            routed_scaling_factor, eps):
    dtypes.check(op, x=x)
    if x.dim() != 2:
        raise ValueError("%s: x must be 2-D (tokens, experts), got %s" % (op, tuple(x.shape)))
    experts = x.shape[-1]
    k, k_group, group_count = int(k), int(k_group), int(group_count)
    if group_count < 1 or experts % group_count or not 1 <= k_group <= group_count:
        raise ValueError("%s: group_count %d must divide %d experts and 1 <= k_group (%d) <= group_count"
                         % (op, group_count, experts, k_group))
    if not 1 <= k <= experts // group_count * k_group:
        raise ValueError("%s: k=%d must be in [1, experts / group_count * k_group = %d]"
                         % (op, k, experts // group_count * k_group))
    if norm_type not in (0, 1):
        raise ValueError("%s: norm_type must be 0 (softmax) or 1 (sigmoid), got %r" % (op, norm_type))
    if group_select_mode not in (0, 1):
        raise ValueError("%s: group_select_mode must be 0 or 1, got %r" % (op, group_select_mode))
    if renorm not in (0, 1):
        raise ValueError("%s: renorm must be 0 or 1, got %r" % (op, renorm))
    dt = _dt(x)
    xs = x.to(dt)
    norm = torch.softmax(xs, dim=-1) if norm_type == 0 else torch.sigmoid(xs)
    value = norm
    if bias is not None:
        if bias.shape != (experts,) or bias.dtype != x.dtype:
            raise ValueError("%s: bias must be (%d,) of x's dtype %s, got %s %s"
                             % (op, experts, x.dtype, tuple(bias.shape), bias.dtype))
        value = norm + bias.to(dt)
    if group_count > 1:
        grouped = value.reshape(x.shape[0], group_count, -1)
        if group_select_mode == 0:
            score = grouped.max(dim=-1).values
        else:
            score = grouped.topk(min(2, grouped.shape[-1]), dim=-1).values.sum(dim=-1)
        keep = torch.zeros_like(score, dtype=torch.bool)
        keep.scatter_(1, score.topk(k_group, dim=-1).indices, True)
        value = grouped.masked_fill(~keep[..., None], float("-inf")).reshape(x.shape)
    expert_idx = value.topk(k, dim=-1).indices
    y = norm.gather(1, expert_idx)
    if norm_type == 1 or renorm == 1:
        y = y / (y.sum(dim=-1, keepdim=True) + eps)
    y = y * routed_scaling_factor
    out = norm.to(torch.float32) if out_flag else torch.empty(0, dtype=torch.float32, device=x.device)
    return y.to(x.dtype), expert_idx.to(torch.int32), out


def npu_moe_gating_top_k(x, k, *, bias=None, k_group=1, group_count=1, group_select_mode=0,
                         renorm=0, norm_type=1, out_flag=False, routed_scaling_factor=1.0, eps=1e-20):
    if renorm != 0 and norm_type != 1:
        raise not_implemented(GATING, "renorm", "renorm=%r with softmax; the page documents 0" % renorm)
    if norm_type == 0 and routed_scaling_factor != 1.0:
        raise not_implemented(GATING, "routed_scaling_factor",
                              "%r with softmax (the page gives no scaling step for it)" % routed_scaling_factor)
    return _gating(GATING, x, k, bias, k_group, group_count, group_select_mode, renorm, norm_type,
                   out_flag, routed_scaling_factor, eps)


def moe_gating_top_k(x, k, k_group, group_count, group_select_mode, renorm, norm_type, out_flag,
                     routed_scaling_factor, eps, bias_opt=None):
    return _gating(C_GATING, x, k, bias_opt, k_group, group_count, group_select_mode, renorm, norm_type,
                   out_flag, routed_scaling_factor, eps)


def npu_moe_init_routing_v2(x, expert_idx, *, scale=None, offset=None, active_num=-1,
                            expert_capacity=-1, expert_num=-1, drop_pad_mode=0,
                            expert_tokens_num_type=0, expert_tokens_num_flag=False, quant_mode=0,
                            active_expert_range=(), row_idx_type=0):
    dtypes.check(INIT_ROUTING, x=x)
    if quant_mode != -1:
        raise not_implemented(INIT_ROUTING, "quant_mode", "quant_mode=%r (only -1, no quantisation)" % quant_mode)
    if drop_pad_mode != 0:
        raise not_implemented(INIT_ROUTING, "drop_pad_mode", "drop mode")
    if row_idx_type != 0:
        raise not_implemented(INIT_ROUTING, "row_idx_type", "row_idx_type=%r" % row_idx_type)
    if offset is not None:
        raise not_implemented(INIT_ROUTING, "offset")
    if expert_tokens_num_type not in (0, 1):
        raise not_implemented(INIT_ROUTING, "expert_tokens_num_type", "%r (0 cumsum and 1 count are)"
                        % expert_tokens_num_type)
    if x.dim() != 2 or expert_idx.dim() != 2 or expert_idx.shape[0] != x.shape[0]:
        raise ValueError("%s: x must be (NUM_ROWS, H) and expert_idx (NUM_ROWS, K), got %s / %s"
                         % (INIT_ROUTING, tuple(x.shape), tuple(expert_idx.shape)))
    if expert_idx.dtype != torch.int32:
        raise ValueError("%s: expert_idx must be int32, got %s" % (INIT_ROUTING, expert_idx.dtype))
    rows, k = expert_idx.shape
    if scale is not None and (scale.shape != (rows,) or scale.dtype != torch.float32):
        raise ValueError("%s: scale must be (NUM_ROWS,) float32 without quantisation" % INIT_ROUTING)
    range_ = [int(v) for v in (active_expert_range or ())] or [0, int(expert_num)]
    if len(range_) != 2 or not 0 <= range_[0] < range_[1] or (expert_num > 0 and range_[1] > expert_num):
        raise ValueError("%s: active_expert_range %s must be [start, end) within expert_num %d"
                         % (INIT_ROUTING, list(active_expert_range or ()), expert_num))
    start, end = range_
    flat = expert_idx.reshape(-1).to(torch.long)
    if flat.numel() and bool(((flat < start) | (flat >= end)).any()):
        raise not_implemented(INIT_ROUTING, "expert_idx", "ids outside active_expert_range [%d, %d)" % (start, end))
    active = rows * k if active_num is None or active_num < 0 else min(int(active_num), rows * k)
    sorted_row = torch.sort(flat, stable=True).indices
    expanded_row_idx = torch.empty(rows * k, dtype=torch.int32, device=x.device)
    expanded_row_idx[sorted_row] = torch.arange(rows * k, dtype=torch.int32, device=x.device)
    expanded_x = x[sorted_row[:active] // k]
    counts = torch.bincount(flat - start, minlength=end - start)
    expert_tokens = counts if expert_tokens_num_type == 1 else counts.cumsum(0)
    expanded_scale = (scale[sorted_row[:active] // k] if scale is not None
                      else torch.empty(active, dtype=torch.float32, device=x.device))
    return expanded_x, expanded_row_idx, expert_tokens.to(torch.int64), expanded_scale


_GMM_UNSUPPORTED = ("scale", "offset", "antiquant_scale", "antiquant_offset", "per_token_scale",
                    "activation_input", "activation_quant_scale", "activation_quant_offset")


def npu_grouped_matmul(x, weight, *, bias=None, scale=None, offset=None, antiquant_scale=None,
                       antiquant_offset=None, per_token_scale=None, group_list=None,
                       activation_input=None, activation_quant_scale=None,
                       activation_quant_offset=None, split_item=0, group_type=None,
                       group_list_type=0, act_type=0, output_dtype=None, tuning_config=None):
    given = dict(scale=scale, offset=offset, antiquant_scale=antiquant_scale,
                 antiquant_offset=antiquant_offset, per_token_scale=per_token_scale,
                 activation_input=activation_input, activation_quant_scale=activation_quant_scale,
                 activation_quant_offset=activation_quant_offset)
    for name in _GMM_UNSUPPORTED:
        if given[name] is not None:
            raise not_implemented(GMM, name)
    if act_type != 0:
        raise not_implemented(GMM, "act_type", "act_type=%r" % act_type)
    if group_type != 0 or split_item not in (2, 3):
        raise not_implemented(GMM, "group_type/split_item",
                        "group_type=%r split_item=%r (MoE's group_type=0, split_item 2 or 3 are)"
                        % (group_type, split_item))
    if len(x) != 1 or len(weight) != 1:
        raise not_implemented(GMM, "x/weight", "%d x and %d weight tensors (one of each is)" % (len(x), len(weight)))
    a, w = x[0], weight[0]
    dtypes.check(GMM, x=a, weight=w)
    if output_dtype is not None and output_dtype != a.dtype and not dtypes.stands_in(a.dtype, output_dtype):
        # the page's non-quantised rows: output_dtype None or x's own dtype (float16, bfloat16, float32)
        raise not_implemented(GMM, "output_dtype", "%s for x of %s (the non-quantised case takes None or x's dtype)"
                              % (output_dtype, a.dtype))
    if a.dim() != 2 or w.dim() != 3 or a.shape[1] != w.shape[1] or a.dtype != w.dtype:
        raise ValueError("%s: x must be (M, K) and weight (E, K, N) of one dtype, got %s %s / %s %s"
                         % (GMM, tuple(a.shape), a.dtype, tuple(w.shape), w.dtype))
    experts = w.shape[0]
    if group_list is None:
        raise ValueError("%s: group_list is required with group_type=0" % GMM)
    groups = group_list if isinstance(group_list, torch.Tensor) else torch.tensor(group_list)
    groups = groups.reshape(-1).to(device="cpu", dtype=torch.long)   # the kernel reads it on the device
    if groups.numel() != experts or group_list_type not in (0, 1):
        raise ValueError("%s: group_list must have one entry per weight group (%d), group_list_type 0 "
                         "(cumsum) or 1 (count); got %d entries, type %r"
                         % (GMM, experts, groups.numel(), group_list_type))
    ends = groups.cumsum(0) if group_list_type == 1 else groups
    if bool((groups < 0).any()) or bool((ends[1:] < ends[:-1]).any()) or int(ends[-1]) > a.shape[0]:
        raise ValueError("%s: group_list %s does not split the %d rows of x"
                         % (GMM, groups.tolist(), a.shape[0]))
    b = None
    if bias is not None:
        if len(bias) != 1 or bias[0].shape != (experts, w.shape[2]):
            raise ValueError("%s: bias must be one (E, N) tensor" % GMM)
        b = bias[0]
    dt = _dt(a)
    out = torch.zeros(a.shape[0], w.shape[2], dtype=dt, device=a.device)
    begin = 0
    for e in range(experts):
        end = int(ends[e])
        if end > begin:
            rows = a[begin:end].to(dt) @ w[e].to(dt)
            out[begin:end] = rows if b is None else rows + b[e].to(dt)
        begin = end
    return [out.to(a.dtype)]


def npu_moe_token_unpermute(permuted_tokens, sorted_indices, probs=None, padded_mode=False,
                            restore_shape=None):
    dtypes.check(UNPERMUTE, permuted_tokens=permuted_tokens)
    if padded_mode:
        raise not_implemented(UNPERMUTE, "padded_mode")
    if sorted_indices.dtype != torch.int32 or sorted_indices.dim() != 1:
        raise ValueError("%s: sorted_indices must be 1-D int32, got %s %s"
                         % (UNPERMUTE, tuple(sorted_indices.shape), sorted_indices.dtype))
    k = 1 if probs is None else probs.shape[1]
    n = sorted_indices.numel()
    if probs is not None and (probs.dim() != 2 or probs.numel() != n):
        raise ValueError("%s: probs must be (tokens, topK) with tokens * topK = %d entries, got %s"
                         % (UNPERMUTE, n, tuple(probs.shape)))
    idx = sorted_indices.to(torch.long)
    if n and bool(((idx < 0) | (idx >= permuted_tokens.shape[0])).any()):
        raise ValueError("%s: a sorted index is outside permuted_tokens' %d rows"
                         % (UNPERMUTE, permuted_tokens.shape[0]))
    dt = _dt(permuted_tokens)
    gathered = permuted_tokens.to(dt)[idx].reshape(n // k, k, -1)
    if probs is not None:
        gathered = gathered * probs.to(dt)[..., None]
    return gathered.sum(dim=1).to(permuted_tokens.dtype)


def npu_moe_finalize_routing(expanded_permuted_rows, skip1, skip2, bias, scales, expanded_src_to_dst_row,
                             export_for_source_row, drop_pad_mode=0):
    rows = expanded_permuted_rows
    dtypes.check(FINALIZE, expanded_permuted_rows=rows)
    if drop_pad_mode not in FINALIZE_LAYOUTS:
        raise not_implemented(FINALIZE, "drop_pad_mode", "%r (the dropless modes 0 and 2 are)" % (drop_pad_mode,))
    if scales is None:
        raise not_implemented(FINALIZE, "scales", "None (every caller read gives the routing weights)")
    if scales.dim() != 2 or rows.dim() != 2 or rows.shape[0] != scales.numel():
        raise ValueError("%s: scales must be (NUM_ROWS, K) and expanded_permuted_rows (NUM_ROWS * K, H), got %s / %s"
                         % (FINALIZE, tuple(scales.shape), tuple(rows.shape)))
    num_rows, k = scales.shape
    index = expanded_src_to_dst_row
    if index.dtype != torch.int32 or index.shape != (num_rows * k,):
        raise ValueError("%s: expanded_src_to_dst_row must be int32 (%d,), got %s %s"
                         % (FINALIZE, num_rows * k, index.dtype, tuple(index.shape)))
    if skip2 is None and skip1 is not None:
        raise ValueError("%s: skip1 given without skip2 (the page: skip2 None needs skip1 None)" % FINALIZE)
    idx = index.to(torch.long)
    if idx.numel() and bool(((idx < 0) | (idx >= rows.shape[0])).any()):
        raise ValueError("%s: an index of expanded_src_to_dst_row is outside [0, %d)" % (FINALIZE, rows.shape[0]))
    # (NUM_ROWS, K): the expanded row holding choice k of row i
    where = idx.reshape(k, num_rows).t() if FINALIZE_LAYOUTS[drop_pad_mode] == "column" else idx.reshape(num_rows, k)
    dt = _dt(rows)
    picked = rows.to(dt)[where]
    if bias is not None:
        if export_for_source_row is None or export_for_source_row.shape != (num_rows, k):
            raise ValueError("%s: bias needs export_for_source_row of shape (%d, %d)" % (FINALIZE, num_rows, k))
        picked = picked + bias.to(dt)[export_for_source_row.to(torch.long)]
    out = (picked * scales.to(dt)[..., None]).sum(dim=1)
    for skip in (skip1, skip2):
        if skip is not None:
            out = out + skip.to(dt)
    return out.to(rows.dtype)
