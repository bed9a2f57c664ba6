"""sglang.npu_decode_v_head_dim — decode (and sink prefill without FIA) of an MHA layer whose V head dim differs from K's takes upstream's FIA v2 TND call.

Why: ``AscendAttnBackend``'s decode of an MHA layer (not MLA) makes, by mode and switches:
  eager, ``ASCEND_USE_FIA=1``: ``npu_fused_infer_attention_score`` BSND over the paged caches
  (``npu_fused_infer_attention_score_v2`` BSND with ``learnable_sink`` for a layer with sinks or a
  hybrid-SWA window); eager without FIA: ATB ``_npu_paged_attention`` (a layer with sinks:
  ``attention_sinks_triton``); graph mode, plain pool: ``npu_fused_infer_attention_score.out`` BSH;
  graph mode with sinks or the hybrid-SWA pool and FIA: ``npu_fused_infer_attention_score_v2`` in
  **TND** (``actual_seq_qlen`` the cumulative ones, ``actual_seq_kvlen`` each sequence's length,
  paged, sparse_mode 3 / 4 with the compressed mask, ``learnable_sink``). With a K cache 192 wide
  and a V cache 128 wide (MiMo-V2-Flash; the pool gets its V width from
  ``sglang.npu_mha_v_head_dim``) only the last is documented: op-plugin's
  torch_npu-npu_fused_infer_attention_score_v2.md (revision 5e735e5), 约束说明, "TND、TND_NTD、
  NTD_TND场景下query、key、value输入的综合限制", query D != 512, no rope: "TND场景,要求Q_D、K_D、
  V_D等于128,或者Q_D、K_D等于192,V_D等于128/192 ... GQA和PA场景不支持V_D等于192", "page
  attention场景下仅支持blocksize为16对齐且小于等于1024"; learnable_sink "仅支持TND、NTD_TND;
  仅支持value的d小于等于128". Outside TND the same page asks "参数key、value中对应tensor的shape
  需要完全一致", and FIA v1's page documents Q_D/K_D 192 with V_D 128 only without paging; ATB
  PagedAttention takes one head size for both caches (a separate V head size only as the MLA
  ``mlaVHeadSize``). So upstream's first decode step of such a layer makes an undocumented call
  (the emulation refuses each: NotImplementedError, mid-request), except in graph mode on the
  hybrid-SWA pool with ``ASCEND_USE_FIA=1``.
  Prefill of a layer with attention sinks (MiMo-V2-Flash's sliding-window layers) without
  ``ASCEND_USE_FIA`` (sglang's default) goes to sgl_kernel_npu's ``attention_sinks_prefill_triton``
  (``forward_extend``; read in 0.5.14 and 0.5.23, the check tests the branch in each release). Its
  source (sgl-project/sgl-kernel-npu, ``sgl_kernel_npu/attention/sinks_attention.py``) takes the
  head dim from q (``D = query.shape[-1] // q_head_num``: 192), loads V at K's offsets (one
  ``offset_k`` for both caches) and stores rows ``D * q_head_num`` apart into an output
  ``v_cache.shape[-1]`` (128) wide: V is read at the wrong places and the output is written past
  its rows, with no error (by reading; the kernel cannot run here). With ``ASCEND_USE_FIA=1`` the
  same branch makes upstream's FIA v2 TND call (``_can_use_tnd``: K 192 / V 128), which the
  documentation above takes.
How: the layer's V head dim is read per call (``layer.v_head_dim`` against ``layer.qk_head_dim``).
  A layer with V == K, an MLA backend, a cross-attention layer or a sparse (``topk_indices``)
  call runs upstream's ``forward_decode`` / ``forward_decode_graph``, unedited. A layer with
  V != K runs them edited (:class:`~npu_shim.patches._shared.source_edit.ReplaceExpression`):
  ``forward_decode`` takes its graph-mode branch (``self.graph_mode and not
  self.enable_torch_compile`` -> True), and ``forward_decode_graph`` its FIA v2 TND branch
  (``sinks is not None or self.is_hybrid_swa`` -> True, ``self.use_fia`` -> True there): upstream's
  own KV write (``set_kv_buffer``) and upstream's own TND call, argument for argument, in eager
  and in graph mode, whatever ``ASCEND_USE_FIA`` says (the switch chooses sglang's op, not the pool
  layout: the call views the pool's buffers as upstream's TND branch does). Nothing is stored:
  two layers, or two models, in one process keep their own.
  ``forward_extend``: a prefill that enters upstream's sink branch (``sinks`` given) with
  ``use_fia`` off, for a layer with V != K (MHA, self-attention, not sparse, not dLLM, not a
  speculative verify / draft extend), runs upstream's ``forward_extend`` edited: every read of
  ``self.use_fia`` -> True. The check proves that every such read stands in or after that branch,
  which ends in a return, so the edit changes the branch's choice alone: upstream's KV write, then
  its FIA v2 TND call with ``learnable_sink`` (a sliding-window layer: the SWA block table,
  sparse_mode 4), as with ``ASCEND_USE_FIA=1``. The triton kernel is not called for such a layer. One whose head dims the
  TND call does not take (``_can_use_tnd`` false) is refused with a ValueError naming its dims,
  not sent to the kernel. Every other prefill goes to the class's ``forward_extend`` as it was
  (upstream's, or ``sglang.small_page_fia``'s wrapper): V == K layers are untouched.
Upstream fix: none released (0.5.14 - 0.5.23 read).
Remove when: sglang's Ascend decode and sink prefill of a layer with V != K make documented calls
  (the family's check then finds other conditions and says TargetMismatch; re-read the release).

The call's documentation is the page's 5e735e5 revision. An earlier revision (0d45aab) listed
192/128 in TND as bfloat16 only, without page attention, sparse_mode 0 or 3: a CANN older than
that page may refuse the paged call (as it would upstream's own graph-mode call on the hybrid
pool). A decode batch whose query rows outnumber its sequences (eager padding, which upstream's
FIA v1 branch trims) does not fit the TND lengths; the op then refuses it.
"""
import ast
import inspect
import textwrap

from npu_shim.patch import Defect, Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.source_edit import ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import module_class, own_function, upstream_of

TARGET = "sglang.srt.hardware_backend.npu.attention.ascend_backend"
BACKEND = "AscendAttnBackend"
DECODE, GRAPH, EXTEND = "forward_decode", "forward_decode_graph", "forward_extend"
# forward_extend: the branch of a layer with sinks (or a hybrid-SWA window under FIA), which
# returns; without FIA its call is sgl_kernel_npu's triton kernel, with FIA it tests TND first
SINK_BRANCH = "sinks is not None or (self._is_swa_layer(layer) and self.use_fia)"
SINK_PREFILL = "attention_sinks_prefill_triton"
CAN_USE_TND = "self._can_use_tnd(layer)"
USE_FIA = "self.use_fia"
KEEPS = "npu_fused_infer_attention_score_v2(..., input_layout=\"TND\") of forward_decode_graph, as upstream calls it"

EDITS = {
    DECODE: (ReplaceExpression("self.graph_mode and (not self.enable_torch_compile)", "True"),),
    GRAPH: (ReplaceExpression("sinks is not None or self.is_hybrid_swa", "True"),
            ReplaceExpression("self.use_fia", "True")),
}


def _key(node):
    return ast.dump(node, annotate_fields=False).replace("Load()", "")


def _expression(text):
    return _key(ast.parse(text, mode="eval").body)


def sink_branch(function):
    """The number of reads of ``self.use_fia`` in upstream's ``forward_extend``, after checking that
    each stands in or after its sink branch (``if SINK_BRANCH:``, found once, ending in a return),
    whose body tests ``self._can_use_tnd(layer)`` and calls ``attention_sinks_prefill_triton``:
    a call that enters the branch reads the flag there only, so the edit (every read -> True)
    changes that branch's choice alone. TargetMismatch names what differs."""
    where = "%s.%s" % (BACKEND, EXTEND)
    try:
        tree = ast.parse(textwrap.dedent(inspect.getsource(function)))
    except (OSError, TypeError, SyntaxError) as exc:
        raise TargetMismatch("%s: no source to read (%s)" % (where, exc)) from None
    branch, use_fia, can_use_tnd = _expression(SINK_BRANCH), _expression(USE_FIA), _expression(CAN_USE_TND)
    branches = [node for node in ast.walk(tree) if isinstance(node, ast.If) and _key(node.test) == branch]
    if len(branches) != 1:
        raise TargetMismatch("%s: 'if %s:' found %d times, not once" % (where, SINK_BRANCH, len(branches)))
    (found,) = branches
    if not found.body or not isinstance(found.body[-1], ast.Return) or found.orelse:
        raise TargetMismatch("%s: the sink branch does not end in a return (or has an else)" % where)
    inside = list(ast.walk(ast.Module(body=found.body, type_ignores=[])))
    if not any(isinstance(n, ast.Call) and isinstance(n.func, ast.Name) and n.func.id == SINK_PREFILL
               for n in inside):
        raise TargetMismatch("%s: the sink branch does not call %s" % (where, SINK_PREFILL))
    if not any(isinstance(n, ast.expr) and _key(n) == can_use_tnd for n in inside):
        raise TargetMismatch("%s: the sink branch does not test %s" % (where, CAN_USE_TND))
    reads = [n for n in ast.walk(tree) if isinstance(n, ast.expr) and _key(n) == use_fia]
    early = [n.lineno for n in reads if n.lineno < found.lineno]
    if early:
        raise TargetMismatch("%s reads %s before its sink branch (source lines %s of the function)"
                             % (where, USE_FIA, early))
    return len(reads)


def extend_edits(function):
    """forward_extend's edit: every read of ``self.use_fia`` -> True (see :func:`sink_branch`)."""
    return (ReplaceExpression(USE_FIA, "True", count=sink_branch(function)),)


def sink_prefill_route(backend, layer, forward_batch, sinks, topk_indices):
    """True where a prefill enters upstream's sink branch without FIA for a layer with V != K (MHA,
    self-attention, not sparse, not dLLM, not a speculative verify / draft extend): upstream hands
    it to ``attention_sinks_prefill_triton``."""
    if sinks is None or backend.use_fia or upstream_layer(backend, layer, topk_indices):
        return False
    if getattr(backend, "is_dllm_model", False):
        return False
    mode = getattr(forward_batch, "forward_mode", None)
    return not (mode is not None and (mode.is_target_verify() or mode.is_draft_extend_v2()))


def refuse_sink_prefill(backend, layer, patch):
    """A routed layer whose head dims FIA's TND call does not take (upstream's ``_can_use_tnd``)."""
    raise ValueError(
        "npu-shim (%s): layer %d has attention sinks, K head dim %d and V head dim %d. Without "
        "ASCEND_USE_FIA=1 sglang's prefill hands it to sgl_kernel_npu's %s, which takes one head dim "
        "(q's) for K, V and the output: its output would be wrong. The FIA TND call the shim sends such a "
        "layer to takes K 192 with V 128 (or K == V) only, and no other Ascend prefill of these head dims "
        "is documented." % (patch, layer.layer_id, layer.qk_head_dim, layer.v_head_dim, SINK_PREFILL))


def upstream_layer(backend, layer, topk_indices):
    """True where the call stays upstream's: V == K, MLA, cross attention, sparse decode."""
    return (layer.v_head_dim == layer.qk_head_dim or backend.use_mla or topk_indices is not None
            or getattr(layer, "is_cross_attention", False))


class DecodeTnd:
    """``forward_decode`` branches to ``forward_decode_graph`` on ``self.graph_mode and (not
    self.enable_torch_compile)``; ``forward_decode_graph`` makes its FIA v2 TND call under ``sinks
    is not None or self.is_hybrid_swa`` and then ``self.use_fia`` (read once there)."""

    def check(self, module, context):
        """{path: upstream's function edited}; TargetMismatch names a missing anchor."""
        cls = module_class(module, BACKEND)
        if "topk_indices" not in own_function(cls, DECODE).__code__.co_varnames:
            raise TargetMismatch("%s.%s takes no topk_indices" % (BACKEND, DECODE))
        # upstream's, under sglang.small_page_fia's wrapper where that patch applied first
        extend = upstream_of(own_function(cls, EXTEND))
        parameters = inspect.signature(extend).parameters
        missing = [name for name in ("layer", "forward_batch", "sinks", "topk_indices") if name not in parameters]
        if missing:
            raise TargetMismatch("%s.%s takes no %s" % (BACKEND, EXTEND, ", ".join(missing)))
        if not callable(getattr(cls, "_can_use_tnd", None)):
            raise TargetMismatch("%s has no _can_use_tnd" % BACKEND)
        edited = {"%s.%s" % (BACKEND, name): edit_function(own_function(cls, name), edits)
                  for name, edits in EDITS.items()}
        edited["%s.%s" % (BACKEND, EXTEND)] = edit_function(extend, extend_edits(extend))
        return edited

    def build(self, module, context):
        cls = module_class(module, BACKEND)
        edited = context.found       # check's {path: edited} (the engine hands it to build)
        replacements = {}
        for name in EDITS:
            path, original = "%s.%s" % (BACKEND, name), own_function(cls, name)
            replacements[path] = context.present(
                self.make(original, edited[path], context), original,
                "a layer whose V head dim differs from K's decodes through upstream's FIA v2 TND call")
        path, inner = "%s.%s" % (BACKEND, EXTEND), own_function(cls, EXTEND)
        replacements[path] = context.present(
            self.make_extend(inner, edited[path], context), inner,
            "the sink prefill of a layer whose V head dim differs from K's takes upstream's FIA v2 TND call, "
            "not the triton kernel, without ASCEND_USE_FIA", wrapped=True)
        return replacements

    @staticmethod
    def make_extend(inner, edited, context):
        """Per call: ``edited`` (upstream's, edited) for a prefill :func:`sink_prefill_route` routes
        (refused where FIA's TND call does not take its head dims), else ``inner``: what the class
        held (upstream's, or ``sglang.small_page_fia``'s wrapper of it, which leaves a call with sinks
        to upstream's)."""
        signature = inspect.signature(inner)

        def forward_extend(self, *args, **kwargs):
            arguments = signature.bind(self, *args, **kwargs).arguments
            layer = arguments["layer"]
            if not sink_prefill_route(self, layer, arguments["forward_batch"], arguments.get("sinks"),
                                      arguments.get("topk_indices")):
                return inner(self, *args, **kwargs)
            if not self._can_use_tnd(layer):
                refuse_sink_prefill(self, layer, context.patch)
            context.count("sink_prefill_tnd_calls")
            return edited(self, *args, **kwargs)

        return forward_extend

    @staticmethod
    def make(original, edited, context):
        """Per call: upstream's ``original`` for a layer that stays upstream's, else ``edited``."""
        if original.__name__ == DECODE:
            def method(self, q, k, v, layer, forward_batch, *args, **kwargs):
                if upstream_layer(self, layer, kwargs.get("topk_indices")):
                    context.count("upstream_calls")
                    return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
                context.count("calls")
                return edited(self, q, k, v, layer, forward_batch, *args, **kwargs)
        else:
            def method(self, q, k, v, layer, forward_batch, *args, **kwargs):
                if upstream_layer(self, layer, None):
                    return original(self, q, k, v, layer, forward_batch, *args, **kwargs)
                context.count("tnd_calls")
                return edited(self, q, k, v, layer, forward_batch, *args, **kwargs)
        return method


DECODE_TND = DecodeTnd()

PATCH = Patch(
    name="sglang.npu_decode_v_head_dim",
    target=TARGET,
    replaces=("%s.%s" % (BACKEND, DECODE), "%s.%s" % (BACKEND, GRAPH), "%s.%s" % (BACKEND, EXTEND)),
    requires={"sglang": ""},
    outside_window={"sglang": "below the window the NPU MHA pool has one head dim for K and V: no layer "
                              "with V != K reaches the decode (sglang.npu_mha_v_head_dim_inline)"},
    needs_npu=True,
    families=(Family(__name__ + ":DECODE_TND", fence=">=0.5.14", keeps=KEEPS),),
    summary="decode of an MHA layer whose V head dim differs from K's (MiMo-V2-Flash K 192 / V 128) takes "
            "upstream's FIA v2 TND call, in eager and graph mode, and so does its prefill with attention sinks "
            "without ASCEND_USE_FIA (upstream: a triton kernel that takes K's head dim for V); V == K layers "
            "stay on upstream's code",
    selftest=Selftest("npu_shim.selftest.sglang_v_head_dim:run", host_syncs=0,
                      arguments={"round_trip": "decode"}),
    defect=Defect("sglang's decode of an MHA layer whose V head dim differs from K's calls ATB paged attention with V K-wide",
                  shows="raises", says="value head dim 128 != key head dim 192"),
)
