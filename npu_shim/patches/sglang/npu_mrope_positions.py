"""sglang.npu_mrope_positions — sglang's M-RoPE hands 2-D (multimodal) positions to ordinary RoPE on NPU (0.5.11 - 0.5.22).

Why: ``MRotaryEmbedding.forward_npu`` calls ``torch_npu.npu_mrope(positions, query, key,
  cos_sin_cache, head_size, mrope_section=[0, 0, 0], rotary_mode=...)`` for every call whose
  query has at most 4096 columns. ``mrope_section=[0, 0, 0]`` selects ordinary RoPE, which takes
  1-D positions (T,); a multimodal prompt of Qwen2-VL / Qwen2.5-VL brings 2-D positions (3, T)
  (time, height, width rows). On the hardware the rotary embeddings come out corrupted, with no
  error: sglang PR #38499 ("the rotary embeddings are corrupted on NPU ... text-only inference
  looked fine"), PR #36959 ("incorrect grounding coordinates"). The emulated ``npu_mrope``
  (:mod:`npu_shim.emulation.rotary`) is loud where the hardware is silent: it takes 2-D positions
  only with one ``mrope_section`` entry per row summing to ``rotary_dim / 2`` (op-plugin's
  ``_mrope_v1`` contract; its own test calls ``mrope_section=[0, 0, 0]`` with 1-D positions only)
  and refuses ``[0, 0, 0]`` with 2-D positions by name, so an image request through sglang's
  engine stops in the text model's rotary (tests/lanes/test_engine_sglang_vl.py).
How: ``forward_npu`` is upstream's own method with one expression edited
  (:func:`npu_shim.patches._shared.source_edit.edit_function`, compiled at upstream's file and
  lines): its guard ``if query.shape[1] > 4096:`` becomes ``if positions.ndim == 2 or
  query.shape[1] > 4096:``, so 2-D positions take upstream's ``forward_native`` (which applies the
  model's ``mrope_section`` to the three rows) and 1-D positions keep upstream's ``npu_mrope``
  call with upstream's arguments, unchanged. This is sglang 0.5.23's own fix, to the character.
  ``check`` builds the edited method, and refuses (TargetMismatch, naming it) a ``forward_npu``
  whose ``if`` tests are not the unguarded shape (``query.shape[1] > 4096`` as a whole test, no
  test reading ``positions.ndim``: 0.5.23 has the guard), or that does not call ``npu_mrope``.
  ``NPU_SHIM_SGLANG_NPU_MROPE_POSITIONS=0`` turns the patch off.
Upstream fix: sglang 0.5.23 (``if positions.ndim == 2 or query.shape[1] > 4096: return
  self.forward_native(...)``, "The NPU call below selects ordinary RoPE, which requires 1D
  positions"); the PR or commit that added it is not identified yet (read from the 0.5.23 wheel).
  sglang PRs #38499 (a Triton kernel for 2-D positions) and #36959 (forward_native always) are
  other fixes of the same defect, open.
Remove when: the pinned sglang is 0.5.23 or later (the window ends there; the structural check
  refuses the guarded method).
"""
import ast
import inspect
import textwrap

from npu_shim.patch import Defect, Family, Patch, Selftest, TargetMismatch
from npu_shim.patches._shared.code import code_names
from npu_shim.patches._shared.source_edit import ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import Edited, edit_of, module_class, own_function, replace_own

TARGET = "sglang.srt.layers.rotary_embedding.mrope"
LAYER = "MRotaryEmbedding"
METHOD = "forward_npu"
OP = "npu_mrope"

# upstream's guard before the npu_mrope call, and the one it becomes (the fixed release's, at the window's end)
UNGUARDED_TEST = "query.shape[1] > 4096"
GUARDED_TEST = "positions.ndim == 2 or query.shape[1] > 4096"
EDITS = (ReplaceExpression(UNGUARDED_TEST, GUARDED_TEST),)
KEEPS = ("upstream's npu_mrope call (mrope_section [0, 0, 0], rotary_mode) for 1-D positions; forward_native for "
         "2-D positions and for query.shape[1] > 4096, as the release that fixed it")


def if_tests(function):
    """``ast.unparse`` of every ``if`` test of ``function``."""
    try:
        source = textwrap.dedent(inspect.getsource(function))
    except (OSError, TypeError) as exc:
        raise TargetMismatch("cannot read the source of %s.%s (%s)" % (LAYER, METHOD, exc)) from None
    return [ast.unparse(node.test) for node in ast.walk(ast.parse(source)) if isinstance(node, ast.If)]


class _Unguarded:
    """The releases whose ``forward_npu`` sends every query of at most 4096 columns to
    ``npu_mrope`` with ``mrope_section=[0, 0, 0]``, whatever the positions' shape."""

    def edited(self, module):
        original = own_function(module_class(module, LAYER), METHOD)
        tests = if_tests(original)
        if UNGUARDED_TEST not in tests or any("positions.ndim" in test for test in tests):
            raise TargetMismatch("%s.%s's if tests are %s, not the unguarded %r (a release that already routes "
                                 "2-D positions away from %s, as the fixed release does, needs no patch)"
                                 % (LAYER, METHOD, tests, UNGUARDED_TEST, OP))
        if OP not in code_names(original):
            raise TargetMismatch("%s.%s does not call %s" % (LAYER, METHOD, OP))
        return original, edit_function(original, EDITS)

    def check(self, module, context):
        return {LAYER + "." + METHOD: Edited(*self.edited(module))}

    def build(self, module, context):
        return {LAYER + "." + METHOD: replace_own(module, LAYER, METHOD, self.make, context,
                                                  "upstream's method with 2-D (multimodal) positions sent to "
                                                  "forward_native, as the release that fixed it does")}

    def make(self, module, original, context):
        edited = edit_of(context, LAYER + "." + METHOD)

        def forward_npu(self, positions, *args, **kwargs):
            context.count("calls")
            if getattr(positions, "ndim", 1) == 2:
                context.count("positions_2d")   # status only: the edited guard decides
            return edited(self, positions, *args, **kwargs)

        return forward_npu


UNGUARDED = _Unguarded()

PATCH = Patch(
    name="sglang.npu_mrope_positions",
    target=TARGET,
    replaces=(LAYER + "." + METHOD,),
    requires={"sglang": ""},
    outside_window={"sglang": "below the window: not read for this patch; from the window's end forward_npu routes 2-D "
                              "positions to forward_native itself"},
    needs_npu=True,
    families=(
        Family(__name__ + ":UNGUARDED", fence=">=0.5.11,<0.5.23", keeps=KEEPS),
    ),
    summary="M-RoPE with 2-D (multimodal) positions on NPU goes to sglang's forward_native, not to npu_mrope with "
            "mrope_section [0, 0, 0] (ordinary RoPE: silently corrupted rotary on the hardware, sglang PRs #38499, "
            "#36959), as the release that fixed it does",
    selftest=Selftest("npu_shim.selftest.sglang_npu_mrope_positions", host_syncs=0),
    # emulated: the op refuses [0, 0, 0] with 2-D positions; on the hardware: the output is wrong
    defect=Defect("sglang's MRotaryEmbedding.forward_npu hands 2-D positions to npu_mrope as ordinary RoPE",
                  shows=("raises", "error"), says="npu_mrope: mrope_section [0, 0, 0]", fixed_at="sglang"),
)
