"""The structural check of ``sglang.npu_decode_v_head_dim``'s ``forward_extend`` edit on synthetic
code (lane base: no sglang).

The edit makes every read of ``self.use_fia`` in ``forward_extend`` read True, for a prefill that
enters the sink branch. That is the branch's choice alone only where no read comes before the branch
and the branch returns; the check (``sink_branch``) must refuse a shape where either fails, and
where the branch no longer calls the triton kernel or tests TND. The real releases are covered by
the sglang lanes (test_sglang_npu_hybrid_swa_v_head_dim.py).
"""
import importlib.util
import textwrap

import pytest

from npu_shim.patch import TargetMismatch
from npu_shim.patches.sglang import npu_decode_v_head_dim as patch

pytestmark = pytest.mark.patch(patch.PATCH.name)

# the shape upstream's forward_extend has (0.5.14, 0.5.23), bodies reduced
UPSTREAM = """
def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True, sinks=None):
    if self.is_dllm_model:
        return self.forward_dllm(q)
    if not self.use_mla:
        self.token_to_kv_pool.set_kv_buffer(layer, k, v)
        if sinks is not None or (self._is_swa_layer(layer) and self.use_fia):
            if self.use_fia:
                if self._can_use_tnd(layer):
                    attn_out = torch_npu.npu_fused_infer_attention_score_v2(q)
                else:
                    attn_out = None
            else:
                attn_out = attention_sinks_prefill_triton(q)
            return attn_out
        if self.use_fia:
            return 1
        return 2
"""


def _function(tmp_path, source, name="shape"):
    path = tmp_path / ("%s.py" % name)
    path.write_text(textwrap.dedent(source))
    spec = importlib.util.spec_from_file_location(name, str(path))
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.forward_extend


def test_upstreams_shape_counts_every_read(tmp_path):
    function = _function(tmp_path, UPSTREAM)
    assert patch.sink_branch(function) == 3
    (edit,) = patch.extend_edits(function)
    assert (edit.anchor, edit.by, edit.count) == ("self.use_fia", "True", 3)


@pytest.mark.parametrize("change, message", [
    # a read of the flag before the branch: the edit would change what runs before it
    (("    if not self.use_mla:\n", "    if not self.use_mla and not self.use_fia:\n"),
     "reads self.use_fia before its sink branch"),
    # the branch falls through: the edited reads after it would run for a routed call
    (("            return attn_out\n", "            pass\n"), "does not end in a return"),
    (("attention_sinks_prefill_triton(q)", "other_kernel(q)"), "does not call attention_sinks_prefill_triton"),
    (("if self._can_use_tnd(layer):", "if True:"), "does not test self._can_use_tnd"),
    (("if sinks is not None or (self._is_swa_layer(layer) and self.use_fia):", "if sinks is not None:"),
     "found 0 times"),
])
def test_a_shape_where_the_edit_is_not_the_branchs_choice_alone_is_refused(tmp_path, change, message):
    old, new = change
    assert UPSTREAM.count(old) == 1
    function = _function(tmp_path, UPSTREAM.replace(old, new), name="changed")
    with pytest.raises(TargetMismatch, match=message):
        patch.sink_branch(function)
