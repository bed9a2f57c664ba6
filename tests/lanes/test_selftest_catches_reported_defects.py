"""``npu-shim selftest`` catches upstream's reported silent op failures (NPU_SHIM_EMULATE_DEFECTS).

The command an operator runs before serving, in a fresh interpreter on the lane's real wheels,
with the emulated ops made to behave as each upstream report says
(:mod:`npu_shim.emulation.defects`): it must exit 1 with a failing row naming the op, the
arguments of the call, the report and what to try; with no defect on it exits 0.

* vllm-ascend #13699 (``fia-tnd-uniform``): vllm-ascend's encoder call (FIA TND, sparse_mode 0,
  no mask; the fused-infer families, 0.30.0rc2 included) -- the ``vllm.mm_encoder_attn`` row
  (three images packed through four real ``AscendMMEncoderAttention`` layers) and the probe row
  fail; with ``NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1`` (the switch the row names) the encoder
  row passes again, the probe of the op still fails. On sglang, ``VisionAscendAttention``'s rows
  (the same call) fail too.
* vllm-ascend #15503 (``fia-mask-512``): the probe row (KV lengths 137, 600, 1500 of a paged
  cache under a bool [1, 1, 1, S] mask) fails; no patched path makes that call, so no patch
  row moves.

The table checked is the one the command prints (``npu_shim.selftest.table``) for the rows
``--json`` returned.
"""
import json
import os
import subprocess
import sys

import pytest

CLI = os.path.join(os.path.dirname(sys.executable), "npu-shim")
REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ENCODER = "vllm.mm_encoder_attn"
FUSED_INFER = ("npu_shim.patches.vllm_ascend.mm_encoder.v022", "npu_shim.patches.vllm_ascend.mm_encoder.v023")
SGLANG_VISION = "sglang.vision_host_lengths"
TND, MASK = "report vllm-ascend#13699", "report vllm-ascend#15503"
TND_WORDS = ("npu_fused_infer_attention_score(input_layout='TND', sparse_mode=0, atten_mask=None, several "
             "images packed)", "vllm-ascend #13699", "try NPU_SHIM_MM_ENCODER_FUSION_ATTENTION=1")
MASK_WORDS = ("npu_fused_infer_attention_score(sparse_mode=0, bool atten_mask [1, 1, 1, S], KV length > 512)",
              "vllm-ascend #15503", "actual_seq_lengths_kv")


def selftest(make_env, enable, **env):
    """(exit code, {row name: row}, the table the command prints for them) of ``npu-shim selftest
    --json`` with only ``enable`` of the patches applied (the probes run whatever is enabled)."""
    from npu_shim.selftest import table

    base = dict(NPU_SHIM_EMULATE="1", VLLM_PLUGINS="npu_shim", NPU_SHIM_ENABLE=enable, **env)
    if enable.startswith("sglang."):
        base["PYTHONPATH"] = os.path.join(REPO, "tests", "placeholders")
    proc = subprocess.run([CLI, "selftest", "--json"], env=make_env(**base), capture_output=True, text=True,
                          timeout=600)
    results = json.loads(proc.stdout)
    return proc.returncode, {r["patch"]: r for r in results}, table(results)


def assert_names(row, table, words):
    assert row["ok"] is False and row["failed"] == ["error"] and row["error"] > 10 * row["tolerance"], row
    note = next(line for line in table.splitlines() if line.strip().startswith(row["patch"] + ":"))
    for word in words:
        assert word in row["verdict"] and word in note, (word, note)


@pytest.mark.claimed(ENCODER, implemented_in=FUSED_INFER, per_family=True)
@pytest.mark.claimed(ENCODER, pinned={"vllm-ascend": "==0.30.0rc2"})    # the release #13699 names
@pytest.mark.patch(ENCODER)
def test_vllm_selftest_fails_on_each_reported_defect_and_passes_without(make_env):
    code, rows, _ = selftest(make_env, ENCODER)
    assert code == 0 and rows[ENCODER]["state"] == "applied" and rows[ENCODER]["ok"] is True, rows[ENCODER]
    assert rows[TND]["ok"] is True and rows[MASK]["ok"] is True, (rows[TND], rows[MASK])

    code, rows, table = selftest(make_env, ENCODER, NPU_SHIM_EMULATE_DEFECTS="fia-tnd-uniform")
    assert code == 1
    assert rows[ENCODER]["ok"] is False and rows[ENCODER]["failed"] == ["error"], rows[ENCODER]
    assert "NPU op npu_fused_infer_attention_score" in rows[ENCODER]["reason"]   # the op the layers made
    assert_names(rows[TND], table, TND_WORDS)
    assert rows[MASK]["ok"] is True, rows[MASK]

    # both on, and the switch the #13699 row names: it takes the encoder off the call (its row
    # passes again); the probes of the op calls still fail, each naming its report
    code, rows, table = selftest(make_env, ENCODER, NPU_SHIM_EMULATE_DEFECTS="fia-tnd-uniform,fia-mask-512",
                                 NPU_SHIM_MM_ENCODER_FUSION_ATTENTION="1")
    assert code == 1 and rows[ENCODER]["ok"] is True, rows[ENCODER]
    assert "NPU op npu_fusion_attention" in rows[ENCODER]["reason"], rows[ENCODER]["reason"]
    assert_names(rows[TND], table, TND_WORDS)
    assert_names(rows[MASK], table, MASK_WORDS)


@pytest.mark.claimed(SGLANG_VISION, per_family=True)
@pytest.mark.patch(SGLANG_VISION)
def test_sglang_selftest_fails_on_each_reported_defect_and_passes_without(make_env):
    code, rows, _ = selftest(make_env, SGLANG_VISION)
    assert code == 0 and rows[SGLANG_VISION]["ok"] is True, rows[SGLANG_VISION]
    assert rows[TND]["ok"] is True and rows[MASK]["ok"] is True

    code, rows, table = selftest(make_env, SGLANG_VISION, NPU_SHIM_EMULATE_DEFECTS="fia-tnd-uniform")
    assert code == 1 and rows[SGLANG_VISION]["ok"] is False, rows[SGLANG_VISION]
    assert_names(rows[TND], table, TND_WORDS)
    assert rows[MASK]["ok"] is True

    code, rows, table = selftest(make_env, SGLANG_VISION, NPU_SHIM_EMULATE_DEFECTS="fia-mask-512")
    assert code == 1 and rows[SGLANG_VISION]["ok"] is True and rows[TND]["ok"] is True
    assert_names(rows[MASK], table, MASK_WORDS)
