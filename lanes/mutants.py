"""The mutants of ``nox -s mutants`` (noxfile.py) and the check that each still applies.

A mutant is a defect a gate exists for, made by editing a scratch copy of the checkout, and
the lane that must catch it: it counts as caught only if that lane fails AND its output
contains ``expect`` (the gate's own message), so a lane failing for an unrelated reason does
not pass for a catch. Adding a mutant is adding one entry to MUTANTS::

    mutant(ID, DEFECT, LANE, EXPECTED TEXT, (PATH, OLD, NEW), ...)

one or more edits, applied in order: OLD must occur exactly once in PATH (after the edits
before it), and is replaced by NEW; OLD "" appends NEW to the file.

An edit whose OLD text a refactor removed makes the mutant a no-op, or aborts the session an
hour in. ``python lanes/mutants.py check`` (``nox -s mutants_apply``, run by .ci/run before the
lanes) applies every mutant in memory in seconds, no lane run, and fails naming the mutant,
the file and the text that is gone or found more than once, or the lane no pin file defines.

Only the standard library: this runs under nox's own Python.
"""
import collections
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

Edit = collections.namedtuple("Edit", "path old new")
Mutant = collections.namedtuple("Mutant", "ident defect lane expect edits")


def mutant(ident, defect, lane, expect, *edits):
    """One table entry; ``edits``: ``(path, old, new)`` triples (see the module docstring)."""
    return Mutant(ident, defect, lane, expect, tuple(Edit(*edit) for edit in edits))


MUTANTS = (
    mutant("a", "a patch hands the op a device tensor where the op reads host data (the read moves into the op call)",
           "vllm-0.13", "host_arg x",
           ("npu_shim/patches/vllm_ascend/mm_encoder/v013.py",
            "seq_len = torch.diff(C.host_values(layer, cu_seqlens, context))", "seq_len = torch.diff(cu_seqlens)")),
    mutant("b", "every test of one lane skips", "base", "no test passed",
           ("tests/conftest.py", "", "\n\ndef pytest_runtest_setup(item):\n    pytest.skip('mutant (b): every test skips')\n")),
    mutant("c", "a pin file installs a release other than the one its header stands for",
           "sglang-0.5.11", "stands for sglang 0.5.11, but sglang 0.5.12 is installed",
           ("lanes/sglang-0.5.11.txt", "\nsglang==0.5.11\n", "\nsglang==0.5.12\n")),
    mutant("d", "the emulation takes a dtype the real op rejects (float32 for the unpad op)",
           "base", "FAILED tests/test_emulation_dtypes.py",
           ("npu_shim/emulation/dtypes.py", '"_npu_flash_attention_unpad": {"A2": (F16, BF16), "310P": (F16,)}',
            '"_npu_flash_attention_unpad": {"A2": (F16, BF16, F32), "310P": (F16,)}')),
    mutant("e", "npu-shim selftest says ok on its error alone, whatever it reads back",
           "base", "FAILED tests/test_selftest_cli.py",
           ("npu_shim/selftest/__init__.py", 'if expected is None or verdict["host_syncs"] != expected:',
            "if expected is None:")),
    mutant("f", "the attention is off by 3e-5 relative (every score scaled by 1 + 3e-5), inside the old atol 1e-4",
           "base", "FAILED tests/test_emulation_",
           ("npu_shim/emulation/_engine.py", "scores.mul_(scale)", "scores.mul_(scale * (1 + 3e-5))")),
    # Every released patch's selftest case is claimed on each of its lanes (tests/lanes/test_selftests.py),
    # so the lane test file's claim alone leaves no claimed lane untested: the mutant drops both.
    mutant("g", "a patch's tests (its lane test file and its selftest case) leave out a lane whose release a family "
                "claims", "vllm-0.19", "vllm.kimi_vl_host_grid: applied",
           ("tests/lanes/test_kimi_vl_host_grid.py", 'pytest.mark.claimed("vllm.kimi_vl_host_grid")',
            'pytest.mark.lanes("vllm-0.18")'),
           ("tests/lanes/test_selftests.py", "for name, _ in BUILTIN_PATCHES if _released(name)]",
            'for name, _ in BUILTIN_PATCHES if _released(name) and name != "vllm.kimi_vl_host_grid"]')),
    mutant("h", "the built package leaves out a file (npu-shim run's bootstrap) that the checkout has",
           "base", "FAILED tests/test_startup_paths.py",
           ("setup.cfg", "npu_shim = _bootstrap/*.py, releases_read.json\n", "npu_shim = releases_read.json\n")),
    mutant("i", "the edit primitive takes an anchor found more often than the edit names (an edit of the wrong place)",
           "base", "FAILED tests/test_source_edit.py",
           ("npu_shim/patches/_shared/source_edit.py", "if transformer.found != edit.count:",
            "if transformer.found < edit.count:")),
    mutant("j", "sglang's NPU MHA pool for a K 192 / V 128 model is built by upstream's builder (V K-wide), "
                "the patch applied", "latest-sglang", "FAILED tests/lanes/test_sglang_npu_mha_v_head_dim.py",
           ("npu_shim/patches/sglang/npu_mha_v_head_dim.py",
            "if self.model_config.v_head_dim == self.model_config.head_dim:", "if True:")),
    mutant("k", "a declared difference from upstream's own unit tests stops happening (the 310P family passes "
                "upstream's num_kv_heads again) and the declaration is left stale",
           "vllm-0.18", "a stale declaration",
           ("npu_shim/patches/vllm_ascend/mm_encoder/v018_310p.py", "num_heads=heads, num_kv_heads=k.shape[1], out=out)",
            "num_heads=heads, num_kv_heads=layer.num_kv_heads, out=out)")),
    mutant("l", "the encoder ACL-graph fix leaves the FIA workspaces to weak tensors (upstream's helper call kept)",
           "vllm-0.23", "507011",
           ("npu_shim/patches/vllm_ascend/encoder_acl_graph_refs.py",
            'return edit_function(capture, (Replace("%s()" % self.helper, ""),))', "return edit_function(capture, ())")),
    mutant("m", "vllm-ascend's impl serves a MiMo layer (K 192, V 128) on upstream's FIA v1 call and paged-attention "
                "decode (the V head dim never read), the patch applied", "vllm-0.30",
           "FAILED tests/lanes/test_mimo_v2_flash.py",
           ("npu_shim/patches/vllm_ascend/attention_v_head_dim.py",
            "    return value_head_dim(impl, output) != impl.head_size", "    return False")),
    mutant("n", "a K 192 / V 128 layer's decode without ASCEND_USE_FIA stays on upstream's ATB paged attention / "
                "triton sink kernel (the TND branch still gated by use_fia)",
           "latest-sglang", "FAILED tests/lanes/test_sglang_npu_decode_v_head_dim.py",
           ("npu_shim/patches/sglang/npu_decode_v_head_dim.py",
            'ReplaceExpression("self.use_fia", "True")),', "),")),
    mutant("o", "the source check compares bytecode and names only: a stale source differing from the running code "
                "in a constant (x + 2 for x + 1, \"TND\" for \"BSND\") is edited as if it were that code",
           "base", "FAILED tests/test_source_edit.py",
           ("npu_shim/patches/_shared/source_edit.py",
            "            and all(_same_constant(x, y, qualnames) for x, y in zip(a.co_consts, b.co_consts)))",
            "            and True)")),
    mutant("p", "a family's build edits upstream's function again instead of installing the edit its check made "
                "(dots.ocr's tower forward edited twice)", "vllm-0.30", "edited more than once at install",
           ("npu_shim/patches/vllm/dots_ocr_host_lengths.py", "        edited = edit_of(context, FORWARD)\n",
            "        edited = self.edited(module_class(module, TOWER), original)\n")),
    mutant("q", "a replacement that cannot take a parameter upstream added (hand-typed parameters) is presented "
                "as upstream's: the structural check passes and the first call raises TypeError",
           "base", "FAILED tests/test_family_context.py",
           ("npu_shim/patch.py", "        refused = signature_refusal(replacement, original)\n",
            "        refused = \"\"\n")),
    mutant("counters-record", "the per-process record is written only when a patch applies and at exit: a process "
                              "killed at shutdown (vLLM's EngineCore) leaves its counters at 0",
           "base", "FAILED tests/test_stats.py",
           ("npu_shim/engine/counters.py", "        _Record.dirty = True\n        due = first or",
            "        _Record.dirty = True\n        return\n        due = first or")),
    mutant("counters-calls", "vllm.mm_encoder_host_lengths' wrapper counts nothing (calls=0 in every process)",
           "vllm-0.30", "FAILED tests/lanes/test_mm_encoder_host_lengths.py",
           ("npu_shim/patches/vllm/mm_encoder_host_lengths/families.py",
            "            if outer:\n                context.count(\"calls\")", "            if False:\n                pass")),
    mutant("r", "a K 192 / V 128 sliding-window layer's prefill with sinks without ASCEND_USE_FIA stays on upstream's "
                "triton sink kernel (which takes K's head dim for V: silently wrong)",
           "latest-sglang", "FAILED tests/lanes/test_sglang_npu_hybrid_swa_v_head_dim.py",
           ("npu_shim/patches/sglang/npu_decode_v_head_dim.py",
            "            if not sink_prefill_route(", "            if True or not sink_prefill_route(")),
    mutant("s", "sglang's vision head pad reads the output_ws key's presence as NPU-graph mode (VisionAttention "
                "passes output_ws=None on every eager call: nothing padded in serving)",
           "latest-sglang", "FAILED tests/lanes/test_sglang_vision_head_pad.py",
           ("npu_shim/patches/sglang/vision_head_pad.py",
            'if passed("output_ws", everything, kwargs) is not None:', 'if "output_ws" in kwargs:')),
    mutant("w", "a MiMo sliding layer (V != K) keeps upstream's pre_tokens = W, which the op page's band admits as "
                "W + 1 keys (the extra one the null block's row at the window edge), the patch applied", "vllm-0.30",
           "FAILED tests/lanes/test_mimo_v2_flash.py::test_native_window_edge_is_the_models",
           ("npu_shim/patches/vllm_ascend/attention_v_head_dim.py",
            "        return window - 1\n", "        return window\n")),
    mutant("t", "npu-shim selftest's probe of an op call upstream reported silently wrong (vllm-ascend #13699, #15503) "
                "says ok whatever its error against float64",
           "base", "FAILED tests/test_emulation_defects.py",
           ("npu_shim/selftest/op_reports.py", "ok = err <= tolerance", "ok = True")),
    mutant("u", "vllm-ascend's QKV projection for a K 192 / V 128 layer keeps V's entry of output_sizes K-wide (its "
                "weight then 1,536 rows, the model's split raising), the patch applied", "vllm-0.30",
           "FAILED tests/lanes/test_mimo_v2_qkv_ascend.py",
           ("npu_shim/patches/vllm_ascend/qkv_v_head_size.py",
            '" self.num_kv_heads * self.head_size * tp_size, self.num_kv_heads * self.v_head_size * tp_size]"),',
            '" self.num_kv_heads * self.head_size * tp_size, self.num_kv_heads * self.head_size * tp_size]"),')),
    mutant("y", "host_data's stand-in rule dropped: a device stand-in (device cpu:0) counts as host data, so a "
                "device tensor would be read as host lengths", "base", "FAILED tests/test_host_data.py",
           ("npu_shim/patches/_shared/host_data.py",
            'return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu" and tensor.device.index is None',
            'return isinstance(tensor, torch.Tensor) and tensor.device.type == "cpu"')),
    mutant("z", "a converted tower patch's edit removed: vllm.dots_ocr_host_lengths builds cu_seqlens from the "
                "device grid's columns again (upstream's text kept), the patch applied", "vllm-0.30",
           "FAILED tests/lanes/test_dots_ocr_host_lengths.py",
           ("npu_shim/patches/vllm/dots_ocr_host_lengths.py",
            "              for column in range(3)) + (", "              for column in range(0)) + (")),
    mutant("x", "the encoder ACL graph's captured FIA call keeps upstream's num_kv_heads beside K/V repeated to the "
                "query heads (the capture edit of _run_vit_fia dropped): a grouped tower's call does not match its K/V",
           "vllm-0.30", "FAILED tests/lanes/test_encoder_acl_graph_gqa.py",
           ("npu_shim/patches/vllm_ascend/mm_encoder/fia.py",
            '"_run_vit_fia": (ReplaceExpression(KV_HEADS, "key.shape[1]"),),', '"_run_vit_fia": (),')),
    mutant("device-tolist", "the emulated device's transfer counter misses .tolist() (the list is read from the held "
                            "host copy, below the dispatch it counts at)",
           "base", "assert {} == {'tolist': 1}",
           ("npu_shim/emulation/device.py", "                return _T.cpu(self).tolist()",
            "                return self._raw.tolist()")),
    mutant("retire", "upstream ships PaddleOCR-VL's host-lengths fix (simulated: where the retirement guard puts "
                     "upstream's objects back, upstream's slot holds the patch's edited function) and the window "
                     "stays open", "vllm-0.30",
           "upstream fixed PaddleOCR-VL's tower reads back the cu_seqlens it copied from the host in vllm",
           ("npu_shim/engine/registry.py", "        revert(record.undo)\n    try:\n        yield record",
            "        revert([done for done in record.undo if name != \"vllm.paddleocr_vl_host_lengths\"])\n"
            "    try:\n        yield record")),
    mutant("engine-pinned", "the emulated device loses pinned host memory (vLLM's runner then cannot start, and "
                            "test_engine_vllm requires its tokens)",
           "vllm-0.30", "FAILED tests/lanes/test_engine_vllm.py",
           ("npu_shim/emulation/device.py", "    _pinned_host_memory(host)\n", "")),
    mutant("engine-slots", "the emulated slot-mapping kernel writes every token into its request's first KV block "
                           "(tokens past position 128 overwrite the prefix)",
           "vllm-0.30", "FAILED tests/lanes/test_engine_vllm.py",
           ("npu_shim/emulation/triton_kernels.py", "    block_index = torch.where(inside, pos // block_size, 0)\n",
            "    block_index = torch.where(inside, pos * 0, 0)\n")),
    mutant("engine-vl-reads", "vllm-ascend's encoder attention ignores the host copy vLLM made of cu_seqlens and "
                              "reads it back once per tower forward (one read per lengths tensor)",
           "vllm-0.30", "FAILED tests/lanes/test_engine_vllm_vl.py",
           ("npu_shim/patches/vllm_ascend/mm_encoder/common.py",
            "        host = vllms_host_copy(values) if copy is None else None\n", "        host = None\n")),
    mutant("engine-vl-reads-tower-copy", "Qwen2.5-VL's own cu_seqlens copies (vLLM 0.18 .. 0.21's tower copies them "
                                         "itself) keep no host array: vllm-ascend's encoder attention reads both back "
                                         "in the engine's tower forward",
           "vllm-0.18", "FAILED tests/lanes/test_engine_vllm_vl.py",
           ("npu_shim/patches/vllm/qwen2_5_vl_host_lengths/families.py",
            "            if keep_at_next_copy(cu_seqlens):\n", "            if False:\n")),
    mutant("engine-310p-nz-mask", "the emulated 310P ops read a FRACTAL_NZ tensor as if its logical order were the "
                                  "ND matrix's (no fractal rearrangement): the causal mask vllm-ascend's 310P prefill "
                                  "builds with nd_to_nz_2d lets queries see later keys",
           "vllm-0.30", "FAILED tests/lanes/test_engine_vllm_vl_310p.py",
           ("npu_shim/emulation/formats.py",
            "    return tensor[0].permute(1, 0, 2).reshape(rows, col_tiles * NZ_CUBE)",
            "    return tensor[0].reshape(rows, col_tiles * NZ_CUBE)")),
    mutant("device-parameters", "a Parameter of a device tensor is the device tensor itself again (PyTorch's path "
                                "for tensor subclasses: vLLM's parameter classes and weight loaders lost)",
           "base", "FAILED tests/test_emulation_device.py",
           ("npu_shim/emulation/device.py",
            "    torch.nn.Parameter.__new__ = staticmethod(_parameter_new_on_device)\n", "")),
    mutant("sgl-alloc-extend", "the emulated sgl_kernel_npu alloc_extend_kernel takes a request's new partial page "
                               "one page too far down the free list",
           "base", "FAILED tests/test_emulation_sgl_kernels.py",
           ("npu_shim/emulation/sgl_kernels.py", "start_loc = page(new_page_start_loc + self_pages - 1)",
            "start_loc = page(new_page_start_loc + self_pages)")),
    mutant("sgl-compute-position", "the emulated compute_position_kernel (sglang's own Triton kernel, launched on an NPU "
                                    "by the oldest sglang lane's engine) numbers a chunk's positions from 0, not after "
                                    "its prefix",
           "sglang-0.5.11", "FAILED tests/lanes/test_sglang_own_kernels.py",
           ("npu_shim/emulation/sgl_kernels.py",
            "torch.arange(prefix_len, prefix_len + seq_len, dtype=out.dtype)", "torch.arange(0, seq_len, dtype=out.dtype)")),
    mutant("engine-sglang-causal", "the emulated _npu_flash_attention_qlens (sglang's Ascend prefill) drops the causal "
                                   "mask: sglang's engine on the emulated device generates other tokens",
           "latest-sglang", "FAILED tests/lanes/test_engine_sglang.py",
           ("npu_shim/emulation/prefix_attention.py", "masks=(Band(None, 0, skv - sq),))", "masks=())")),
    mutant("engine-sglang-mimo-decode-scale", "the emulated FIA v2 (the TND decode sglang.npu_decode_v_head_dim sends a "
                                              "K 192 / V 128 layer to) scales the logits 1.3x: sglang's engine serving "
                                              "the tiny MiMo-V2-Flash shape answers other tokens",
           "latest-sglang", "FAILED tests/lanes/test_engine_sglang_mimo.py",
           ("npu_shim/emulation/decoder_attention.py", "out[q0:q1], scale=float(softmax_scale),",
            "out[q0:q1], scale=float(softmax_scale) * 1.3,")),
    mutant("engine-sglang-mimo-sinks", "the emulated FIA v2 drops learnable_sink (the sliding layers' sinks, which "
                                       "sglang.npu_decode_v_head_dim's sink prefill and decode edits hand it): sglang's "
                                       "engine serving the whole tiny MiMo-V2-Flash answers other tokens",
           "latest-sglang", "FAILED tests/lanes/test_engine_sglang_mimo.py::test_whole_model",
           ("npu_shim/emulation/decoder_attention.py", "        sink = learnable_sink\n", "        sink = None\n")),
    mutant("engine-sglang-vl-windows", "the emulated FIA (layout TND, sglang's vision attention on NPU) attends over "
                                       "all tokens, not within each window or image its cumulative lengths bound: "
                                       "sglang's engine answers an image request with other tokens",
           "latest-sglang", "FAILED tests/lanes/test_engine_sglang_vl.py",
           ("npu_shim/emulation/fused_infer_attention.py",
            '    seg_q = _tnd_segments(q_cum, t, "actual_seq_lengths")\n', "    seg_q = [(0, t)]\n"),
           ("npu_shim/emulation/fused_infer_attention.py",
            '        seg_kv = _tnd_segments(kv_arg, key.shape[0], "actual_seq_lengths_kv")\n',
            "        seg_kv = [(0, key.shape[0])]\n")),
    mutant("engine-mimo-slot-groups", "the emulated fused slot-mapping kernels read every KV-cache group's slots "
                                      "from the first group's block table (MiMo-V2-Flash's full and sliding-window "
                                      "groups): vLLM's engine answers the MiMo shape with other tokens",
           "vllm-0.30", "FAILED tests/lanes/test_engine_vllm_mimo.py",
           ("npu_shim/emulation/triton_kernels.py",
            "            table = _int32_at(table_address, num_reqs * stride).view(num_reqs, stride)\n",
            "            table = _int32_at(addresses[0][0], num_reqs * stride).view(num_reqs, stride)\n")),
    mutant("fia-v2-float32-sink", "the emulated FIA v2 takes float32 learnable sinks outside the math-check switch "
                                  "(the op page lists bfloat16 only)",
           "base", "FAILED tests/test_emulation_decoder.py",
           ("npu_shim/emulation/decoder_attention.py",
            "and not (learnable_sink.dtype == torch.float32\n"
            "                                                       and dtypes.float32_allowed()):",
            "and not (learnable_sink.dtype == torch.float32):")),
    mutant("engine-mimo-padded-qkv", "vllm.ascend_qkv_v_head_size fenced from 0.20 again: on vllm-ascend 0.18 the "
                                     "QKV projection sizes V with K's 192 and vLLM's engine stops at the first "
                                     "forward of a full-attention MiMo-V2-Flash (the model pads V itself there)",
           "vllm-0.18", "FAILED tests/lanes/test_engine_vllm_mimo.py",
           ("npu_shim/patches/vllm_ascend/qkv_v_head_size.py", 'fence=">=0.18.0rc1"', 'fence=">=0.20.0rc1"')),
    mutant("engine-small-page", "sglang.small_page_fia leaves pages of 16 and 64 on upstream's qlens prefill (its "
                                "threshold at 16, not 128): sglang's engine with small KV pages does not serve",
           "latest-sglang", "FAILED tests/lanes/test_engine_sglang_small_page.py",
           ("npu_shim/patches/sglang/small_page_fia.py", "SMALLEST_SAFE_PAGE = 128", "SMALLEST_SAFE_PAGE = 16")),
    mutant("engine-bf16-switch", "the bfloat16 engine case serves with the emulation's float32 switch held open, "
                                 "so an op given a dtype the hardware rejects would pass unseen",
           "vllm-0.30", "FAILED tests/lanes/test_engine_vllm.py::test_bfloat16_engine_with_the_hardware_dtypes",
           ("tests/lanes/engine_support/vllm_case.py",
            'math_check = float32_not_on_hardware() if DTYPE == "float32" else contextlib.nullcontext()',
            "math_check = float32_not_on_hardware()")),
    mutant("sgl-mrope-2d", "sglang.npu_mrope_positions drops the 2-D positions condition from its edit of forward_npu: "
                           "multimodal positions still reach npu_mrope as ordinary RoPE (mrope_section [0, 0, 0])",
           "sglang-0.5.12", "FAILED tests/lanes/test_sglang_npu_mrope_positions.py",
           ("npu_shim/patches/sglang/npu_mrope_positions.py",
            'GUARDED_TEST = "positions.ndim == 2 or query.shape[1] > 4096"', 'GUARDED_TEST = "query.shape[1] > 4096"')),
    mutant("device-census-ernie-grid", "the census puts Ernie4.5-VL's grid on the device where vLLM keeps it on the "
                                       "host (the stand-in the emulated device found wrong)",
           "vllm-0.30", "FAILED tests/lanes/test_tower_census_device.py::test_every_census_tower_runs_on_the_device",
           ("npu_shim/testing/census.py",
            'return [] if _grid_kept_on_cpu("Ernie4.5-VL", "Ernie4_5VLMultiModalProcessor") else [arg]',
            "return [arg]")),
    mutant("device-scalar-reads", "the emulated device's counter misses the reads of scalar ops (item, "
                                  "_local_scalar_dense): sglang's towers read fewer at dispatch than today's counter sees",
           "latest-sglang", "FAILED tests/lanes/test_sglang_towers_device.py::test_dispatch_count_equals_todays",
           ("npu_shim/emulation/device.py", '    if func in _SCALAR_OPS:\n        return "scalar"\n    if func in _SHAPE_OPS:',
            "    if func in _SHAPE_OPS:")),
    mutant("readme-engine-row", "a README row says an engine shows it while docs/validation.md names no engine test for it",
           "base", "FAILED tests/test_engine_rows.py::test_readme_says_no_exactly_where_no_engine_test_is_named",
           ("README.md", "0.30 → 0.32 | 0 device→host reads per tower forward | no (its tower) |",
            "0.30 → 0.32 | 0 device→host reads per tower forward | vLLM 0.30 |")),
)


class AnchorGone(ValueError):
    """A mutant's edit that does not apply: its text is gone, found more than once, or its file is."""


def mutated(root, entry):
    """``{path: text}``: the files ``entry`` edits, under ``root``, with its edits applied in
    memory. Raises AnchorGone naming the mutant, the file and the text."""
    texts = {}
    for number, edit in enumerate(entry.edits, 1):
        where = "mutant %s, edit %d of %d (%s)" % (entry.ident, number, len(entry.edits), edit.path)
        if edit.path not in texts:
            try:
                with open(os.path.join(root, edit.path), encoding="utf-8") as handle:
                    texts[edit.path] = handle.read()
            except OSError as error:
                raise AnchorGone("%s: cannot read the file: %s" % (where, error)) from None
        text = texts[edit.path]
        if not edit.old:
            texts[edit.path] = text + edit.new
            continue
        found = text.count(edit.old)
        if found != 1:
            raise AnchorGone("%s: %r occurs %d times, not once" % (where, edit.old, found))
        if edit.new == edit.old:
            raise AnchorGone("%s: the edit changes nothing" % where)
        texts[edit.path] = text.replace(edit.old, edit.new)
    return texts


def apply(root, entry):
    """Write ``entry``'s edits into the tree at ``root`` (a scratch copy)."""
    for path, text in mutated(root, entry).items():
        with open(os.path.join(root, path), "w", encoding="utf-8") as handle:
            handle.write(text)


def problems(root=REPO, table=MUTANTS):
    """One line per mutant of ``table`` that would not apply to the tree at ``root``: an edit
    whose text is gone or not unique, a lane no pin file ``lanes/<lane>.txt`` defines, an
    empty expected text, an id used twice. Empty when every mutant applies."""
    out = []
    seen = collections.Counter(entry.ident for entry in table)
    out += ["mutant %s: the id is used %d times" % (ident, count) for ident, count in seen.items() if count > 1]
    for entry in table:
        if not entry.edits:
            out.append("mutant %s: no edit" % entry.ident)
        if not entry.expect:
            out.append("mutant %s: no expected text (any failure of the lane would count as the catch)" % entry.ident)
        if entry.lane.startswith("_") or not os.path.isfile(os.path.join(root, "lanes", entry.lane + ".txt")):
            out.append("mutant %s: lane %r has no pin file lanes/%s.txt" % (entry.ident, entry.lane, entry.lane))
        try:
            mutated(root, entry)
        except AnchorGone as error:
            out.append(str(error))
    return out


def main(argv, root=REPO, table=MUTANTS):
    if argv != ["check"]:
        print("usage: python lanes/mutants.py check", file=sys.stderr)
        return 2
    found = problems(root, table)
    for line in found:
        print("MUTANT BROKEN: " + line)
    if found:
        print("lanes/mutants.py: %d problem(s) in the %d mutants: re-anchor them on the current code"
              % (len(found), len(table)))
        return 1
    print("mutants: all %d apply (%d edits, each text found once; every lane defined)"
          % (len(table), sum(len(entry.edits) for entry in table)))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
