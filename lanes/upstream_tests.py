"""Upstream's own unit tests of the patched classes, run with the shim installed: a lane gate.

The data (what runs where, and what is declared to differ) is the tables below; the lane
session (noxfile.py ``lane``) fetches the archive of the lane's release, lanes/report.py runs
the suites after the lane's own tests and adds their verdicts to the lane's report:

    python lanes/upstream_tests.py list                    # suites x lanes x releases, pins
    python lanes/upstream_tests.py pin vllm-ascend 0.18.0  # sha256 and commit of an archive
                                                           # (to add a release to PINS)

- Where the tests come from: the release's source archive (sdist) on the package index, the
  one lanes/sdist.py downloads and caches (CI reaches the package index only, not the upstream
  repository). Each archive is pinned by its sha256 (PINS), beside the upstream git commit of
  its release tag; the archive's own ``vllm_ascend/_version.py`` (setuptools-scm) must name
  the same commit. The suite's files (and the ``__init__.py``, ``conftest.py`` and
  ``base.py`` they import) are extracted to a temporary directory at lane time and removed
  after: nothing of upstream's tests is kept in this checkout.
- Which tests: SUITES, the tests/ut files that exercise a class a patch of the shim replaces,
  for the releases whose archive ships them; which lane runs which release's suites: LANES.
- How they run: one pytest process per lane in that directory (upstream's rootdir, so its
  ``tests/ut/conftest.py`` loads), the shim installed at start-up as ``npu-shim run`` does
  (its bootstrap directory first on PYTHONPATH), the lane's environment (``VLLM_PLUGINS=npu_shim``
  keeps vllm-ascend's platform plugin off, as in the lane's own tests), ``NPU_SHIM_EMULATE=1``,
  pytest's plugin autoload off (the suites use none; hypothesis alone costs seconds to import).
  torch_npu: from 0.21.0rc1 upstream's conftest puts its own stand-in module in
  ``sys.modules["torch_npu"]`` when ``npu-smi`` is absent (MagicMock ops, which the tests patch
  and inspect), replacing the emulation before vllm-ascend is imported, so the tests see
  upstream's stand-in, as in upstream's CPU CI; the conftests of 0.18.0 - 0.20.2rc1 expect an
  installed torch_npu, and the emulation is that one, with its device (EMULATED_DEVICE: ``torch.npu``, as
  importing the real one adds it). The conftest's ``adapt_patch()`` is left
  out (CONFTEST_STANDINS: a recorded no-op, importing what upstream's modules read from it:
  STANDIN_IMPORTS), because it imports vllm-ascend's whole patch tree
  and, through it, parts of vLLM that need what the lanes do not install (torchvision, triton,
  a working xgrammar); from 0.28.0rc1 ``register_ascend_customop()`` too (scipy).
- Verdicts: each test's outcome is compared with DIFFERENCES, the declared differences (test
  pattern x release window -> expected outcome, with reason and evidence). A test that fails
  (or errors, or skips) without a declaration fails the lane; so does a declaration whose test
  no longer behaves as declared in a release of its window (a stale declaration), and a suite
  whose patch was not applied, or whose patched code no test reached (the shim's counters), as
  then the tests did not test the shim.

Standard library (and ``packaging``, which nox and every lane venv have); pytest only in the
subprocess that runs the suites (``python lanes/upstream_tests.py pytest ...``).
"""
import collections
import fnmatch
import hashlib
import importlib
import json
import os
import re
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time

HERE = os.path.dirname(os.path.abspath(__file__))

Pin = collections.namedtuple("Pin", "sha256 commit commit_from")
Suite = collections.namedtuple("Suite", "name dist files patches releases")
Difference = collections.namedtuple("Difference", "suite test releases outcome reason evidence")

# (dist, release) -> the sdist's sha256, and the upstream commit the archive was built from (its
# _version.py, written by setuptools-scm, must name it; the gate checks): the full hash of the
# release tag where the stored mirror of upstream's repository has the tag (up to v0.25.1rc1) and
# the archive names it, else the hash the archive names (abbreviated where the mirror lacks it).
TAG = "release tag v%s in upstream's repository"
SCM = "abbreviated, from the archive's vllm_ascend/_version.py (the tag is newer than the stored mirror)"
PINS = {
    ("vllm-ascend", "0.14.0rc1"): Pin("d2a6e4363dfd944e7857770e5f6282a8b18390411a4752485972e2c802757f36",
                                      "52d4acfa51fb868823d1070b81cbd2d97e9e4696", TAG % "0.14.0rc1"),
    ("vllm-ascend", "0.18.0"): Pin("8df042cfaae06fab993bff5f38bb45097634c3f398b2cf74e068347abdddb344",
                                   "e18643f8a4d5bd9990727654318ad069ea0b56e2", TAG % "0.18.0"),
    ("vllm-ascend", "0.19.1rc1"): Pin("1e1d27a5cc5775a8b5fc6c09fbae07fb3c5625e5622cdb13d14eb3e2a8837e23",
                                      "da421afad7192dac64e39ae1d32305d57344f3cf", TAG % "0.19.1rc1"),
    ("vllm-ascend", "0.20.2rc1"): Pin("8ebd5c5b2ef5009baae1c5ddee390a0fe2821ef31aa33312a0b491f5b5185797",
                                      "367b8e62da799870a7476ce34f5f7658589a8aad", TAG % "0.20.2rc1"),
    # Built from main, not from the tag: its _version.py names 35d600725 ("[Doc][Misc] Prepare v0.21.0rc1
    # release notes", on main), while the tag v0.21.0rc1 is 80610e4438dba05011b05f89fc45d91e96992671 on the
    # release branch; the tests are the archive's, so the pin is the archive's commit.
    ("vllm-ascend", "0.21.0rc1"): Pin("9c0a2e432a2135f46c753c9f5f3718a95ef86872f041ad331028dadfced3e06c",
                                      "35d6007254b3efa6d562a94ad7ca330baeae22bb",
                                      "the archive's _version.py (35d600725), resolved in upstream's repository: "
                                      "main, not the release tag v0.21.0rc1 (80610e4438db, on the release branch)"),
    ("vllm-ascend", "0.22.1rc1"): Pin("8b2dc4585ec4f92332afa00dc301f5fbc669904366959a02dce81603a4351d56",
                                      "5f6faa0cb8830f667266f3b8121cd1383606f2a1", TAG % "0.22.1rc1"),
    ("vllm-ascend", "0.23.0"): Pin("a58db76eaffcf328b13b315a0db3a57d381a8947d01057ddcefe4ad02372b242",
                                   "5cb98caaadeff42b5b62b996e34bb2aaa29d20fd", TAG % "0.23.0"),
    ("vllm-ascend", "0.24.0rc1"): Pin("56d2949177f3be1c76230cc048adbda5264c7a937ce8e42578ba6fc74d4909ca",
                                      "412cda26814ff70c326f6eb6510f1b610f67bbc0", TAG % "0.24.0rc1"),
    ("vllm-ascend", "0.25.1rc1"): Pin("63f1ade8ed4c42f1e78adb5f4afe91be7ae872636b08be89f9b069dd5946e0e4",
                                      "9bf964cb4b87c8cd0d6852c41a55b3c29711fa95", TAG % "0.25.1rc1"),
    ("vllm-ascend", "0.26.0rc1"): Pin("647533d9ae77ae765c2c4b88eaa8f2cfcde56cc7621e393e3be63bfb7303d6b3",
                                      "f2f74a16c", SCM),
    ("vllm-ascend", "0.27.1rc1"): Pin("6fa8b357b624df4c8810c445da24082a9147009d8fe1db33eff815c8ab9805f0",
                                      "3b3188623", SCM),
    ("vllm-ascend", "0.28.0rc1"): Pin("bde8bf4207d225df86d8f3b7d9b2bd89ff5e5e56af0cbe4bf8b5b691b98bbe95",
                                      "96df62310", SCM),
    ("vllm-ascend", "0.29.0rc1"): Pin("680f58f98b8a8a4d92380f77a5d3949107da6db0b7cfc17834898d32fdfcdfd1",
                                      "b3d3bb680", SCM),
    ("vllm-ascend", "0.30.0rc2"): Pin("05cb51448c0cd174ea338b16ebbfc8e215f44b373ea2a0d65f1314523a01152f",
                                      "8fde6d4e3", SCM),
}

# The tests/ut files that exercise a class a patch replaces, and the releases (a version
# specifier over the dist's releases) whose archive ships them. Found by reading every
# vllm-ascend archive 0.13.0 - 0.30.0rc2 for tests/ut files naming the patched modules
# (``mm_encoder_attention``, ``MMEncoderAttention``), and the tests of the attention impl, the KV-cache
# split and the encoder ACL graph (ls of each archive: attention/test_attention_v1.py in 0.18.0 - 0.20.2rc1
# and from 0.27.1rc1, attention/a2/test_attention_v1.py in 0.21.0rc1 - 0.26.0rc1, worker/test_attn_utils_v2.py
# from 0.27.1rc1, worker/test_encoder_acl_graph.py from 0.23.0), each within its patch's fence; what has none
# is in NO_SUITES; and 0.14.0rc1's attention/test_attention_v1.py, of the impl vllm.sinks_refuse wraps. A suite reaches its patch when the patch's counters move or, for a patch that edits
# upstream's function, when a test runs the installed replacement's code (Reach).
SUITES = (
    Suite("vllm-ascend:mm_encoder_attention", "vllm-ascend", ("tests/ut/ops/test_mm_encoder_attention.py",),
          ("vllm.mm_encoder_attn",), ">=0.23.0"),
    Suite("vllm-ascend:mm_encoder_attention_310p", "vllm-ascend",
          ("tests/ut/_310p/ops/test_mm_encoder_attention_310.py",), ("vllm.mm_encoder_attn_310p",), ">=0.18.0"),
    Suite("vllm-ascend:attention_v1_sinks", "vllm-ascend", ("tests/ut/attention/test_attention_v1.py",),
          ("vllm.sinks_refuse",), ">=0.14.0rc1,<0.15.0rc1"),
    Suite("vllm-ascend:attention_v1", "vllm-ascend", ("tests/ut/attention/test_attention_v1.py",),
          ("vllm.ascend_attention_v_head_dim",), "==0.20.2rc1 | >=0.27.1rc1"),
    Suite("vllm-ascend:attention_v1_a2", "vllm-ascend", ("tests/ut/attention/a2/test_attention_v1.py",),
          ("vllm.ascend_attention_v_head_dim",), ">=0.21.0rc1,<0.27.1rc1"),
    Suite("vllm-ascend:attn_utils_v2", "vllm-ascend", ("tests/ut/worker/test_attn_utils_v2.py",),
          ("vllm.ascend_kv_split_exact",), ">=0.29.0rc1"),
    Suite("vllm-ascend:model_runner_v1", "vllm-ascend", ("tests/ut/worker/test_model_runner_v1.py",),
          ("vllm.ascend_kv_split_exact",), ">=0.27.1rc1"),
    Suite("vllm-ascend:encoder_acl_graph", "vllm-ascend", ("tests/ut/worker/test_encoder_acl_graph.py",),
          ("vllm.encoder_acl_graph_refs",), ">=0.23.0"),
)

# Patched code whose upstream ships no CPU-runnable unit test of it: what -> the evidence.
NO_SUITES = {
    "vllm-ascend 0.13.0 - 0.17.0rc1 (lanes vllm-0.13 - vllm-0.17), the mm_encoder patches":
        "no tests/ut file of their archives names mm_encoder_attention or MMEncoderAttention: the 310P test "
        "arrives in 0.18.0, the base-class test in 0.23.0. (0.14.0rc1's tests/ut/attention/test_attention_v1.py, "
        "of the class vllm.sinks_refuse wraps, runs: suite vllm-ascend:attention_v1_sinks; it never passes sinks, "
        "so it reaches the wrapper's pass-through path only, and tests/lanes/test_mimo_v2_flash.py the refusal)",
    "vllm-ascend's other tests/ut files naming the class":
        "0.26.0rc1's tests/ut/models/test_kimi_k3.py stubs MMEncoderAttention out of vllm-ascend's own Kimi-K3 "
        "model (no patch touches it)",
    "vllm-ascend's tests/ut/worker/test_model_runner_v1.py (vllm.ascend_kv_split_exact) on 0.18.0 - 0.20.2rc1":
        "runs from 0.27.1rc1 (suite vllm-ascend:model_runner_v1, lanes vllm-0.27 - vllm-0.30, whose pin files add "
        "numba and llvmlite at vLLM's own pin, and scipy, as test-only pins: the runner's module imports "
        "vllm_ascend.eplb's FlashLB policy, which imports numba, and vllm_ascend.attention.indexer, which imports "
        "scipy; without them the module does not import, with or without the shim; vllm-0.27 also takes "
        "apache-tvm-ffi 0.1.11, vLLM 0.27.1's own pin). Tried on lanes vllm-0.18 - vllm-0.20 with the same pins "
        "(numba 0.61.2, vLLM 0.18's and 0.19's pin, on numpy 1.26): on 0.18.0 and 0.19.1rc1 the patch does not "
        "apply (its window opens at 0.20.0rc1), so the file cannot test it; on 0.20.2rc1 the module does not import, "
        "with or without the shim: vllm_ascend.worker.model_runner_v1 imports vllm.v1.structured_output.utils, "
        "whose xgrammar 0.2.8 calls load_lib_module(extra_lib_paths=...), which vLLM 0.20's own pin "
        "apache-tvm-ffi==0.1.9 lacks (TypeError). A consistent xgrammar for vLLM 0.20 is left for a later session",
    "vllm-ascend 0.27.1rc1 - 0.28.0rc1's tests/ut/worker/test_attn_utils_v2.py (vllm.ascend_kv_split_exact)":
        "tried as a suite on lanes vllm-0.27 and vllm-0.28 (with adapt_patch's import of STANDIN_IMPORTS; "
        "vllm-0.27 now pins apache-tvm-ffi 0.1.11, vLLM 0.27.1's own pin: with 0.1.10, xgrammar 0.2.8's "
        "load_lib_module(extra_lib_paths=...) raised TypeError at collection and no suite of the lane ran): the file "
        "runs (0.27.1rc1: 9 passed, 0.28.0rc1: 34 passed) but no test reaches calc_split_factor, the patched "
        "function (reach count 0), so the suite would not test the shim: its callers' tests are skipped by "
        "upstream on vLLM 0.28.0 (test_main_allocator_preserves_separate_ascend_kv_views, test_main_dsv4_"
        "materializes_real_planner_geometry_once: 'vLLM #51718 only changed the main allocation entry point') or "
        "absent in 0.27.1rc1, and test_mrv2_initializes_dsv4_cache_only_layer fails before the split, without the "
        "shim as well (RuntimeError: shape '[2, 32, 1, 128]' is invalid for input of size 8320, from vLLM's "
        "vllm.v1.worker.gpu.attn_utils). 0.29.0rc1 on: suite vllm-ascend:attn_utils_v2",
    "sglang (every sglang.* patch)":
        "the package index has sglang source archives only up to 0.5.10.post1, none for the lanes' releases "
        "0.5.11 - 0.5.23; the archive (like each wheel) holds the python package alone (sglang/, "
        "tools/get_version_tag.py, the build files), whose sglang/test is server and accuracy harnesses: no test_*.py of the 0.5.10.post1 archive or of the 0.5.14 and 0.5.23 wheels names "
        "VisionAscendAttention, AscendAttnBackend, ascend_backend, layers.attention.vision or parallel_hook; "
        "0.5.23's multimodal_gen/test/unit/test_qwen3vl_vision.py imports two other classes of "
        "sglang.srt.models.qwen3_vl (the patch merger and patch embedding), not the patched vision model",
    "vLLM (the vllm.* patches of vLLM's own modules)":
        "read in vLLM 0.18.0's archive only (tests/, 1007 .py files): the one test of a patched method, "
        "MMEncoderAttention.maybe_recompute_cu_seqlens, is test_mha_attn_varlen_forward_flashinfer (CUDA devices, "
        "flashinfer); the CPU case of tests/kernels/attention/test_mha_attn.py checks the backend selection, which "
        "no patch changes; no test names cast_overflow_tensors or _merge_multimodal_embeddings; the vision towers' "
        "tests load model checkpoints (tests/models/multimodal). transformers (transformers.attn_check): not read",
}

# lane -> (dist, release) whose suites it runs: the lane that pairs the release with the vLLM
# its versioning policy names (vllm-0.31 and vllm-0.32 run 0.30.0rc2 on newer vLLMs: upstream
# never ran these tests there; the lanes' own tests cover them).
LANES = {
    "vllm-0.14": ("vllm-ascend", "0.14.0rc1"),
    "vllm-0.18": ("vllm-ascend", "0.18.0"),
    "vllm-0.19": ("vllm-ascend", "0.19.1rc1"),
    "vllm-0.20": ("vllm-ascend", "0.20.2rc1"),
    "vllm-0.21": ("vllm-ascend", "0.21.0rc1"),
    "vllm-0.22": ("vllm-ascend", "0.22.1rc1"),
    "vllm-0.23": ("vllm-ascend", "0.23.0"),
    "vllm-0.24": ("vllm-ascend", "0.24.0rc1"),
    "vllm-0.25": ("vllm-ascend", "0.25.1rc1"),
    "latest-vllm": ("vllm-ascend", "0.26.0rc1"),
    "vllm-0.27": ("vllm-ascend", "0.27.1rc1"),
    "vllm-0.28": ("vllm-ascend", "0.28.0rc1"),
    "vllm-0.29": ("vllm-ascend", "0.29.0rc1"),
    "vllm-0.30": ("vllm-ascend", "0.30.0rc2"),
}

# What the suites reach but the lanes cannot run, replaced by a recorded stand-in while the suites
# of a release in the window run: upstream's conftest calls (a no-op) and what vllm-ascend's
# platform plugin would answer (off in the lanes, VLLM_PLUGINS=npu_shim): name -> (window, why).
# A name is ``module.function`` or ``module:Class.method``; the stand-in returns STANDIN_VALUES'
# value for it (None if none), and counts its calls (the lane report's ``standins_called``).
CONFTEST_STANDINS = {
    "vllm_ascend.utils.adapt_patch": (
        ">=0.14.0rc1",
        "imports vllm-ascend's whole patch tree, and through it parts of vLLM that need what the lanes do not "
        "install (0.14.0rc1: openai_harmony, via vllm.v1.worker.utils and vllm.entrypoints.tool_server: pytest "
        "exited 4 at the conftest, no test ran; 0.18.0: torch.npu, which a real torch_npu adds; 0.26.0rc1: a "
        "working xgrammar, via vllm.lora); "
        "the suites' tests use none of those patches"),
    "vllm_ascend.utils.register_ascend_customop": (
        ">=0.28.0rc1",
        "from 0.28.0rc1 it imports vllm_ascend.attention.indexer, which imports scipy, which the lanes do "
        "not install (ModuleNotFoundError, without the shim as well). Below 0.21.0rc1 (no torch.npu stand-in "
        "in the conftest) the real one runs, on the emulation's device (EMULATED_DEVICE): without the device it "
        "raised AttributeError (vllm_ascend.ops' fused-MoE modules read torch.npu at import; "
        "docs/upstream-evidence.md section 3.2)"),
    "vllm.platforms.interface:Platform.get_global_graph_pool": (
        ">=0.23.0",
        "with the platform plugin off, vLLM's current_platform is UnspecifiedPlatform, whose graph_pool_handle is "
        "None, so upstream's get_global_graph_pool raises TypeError ('NoneType' object is not callable) in "
        "EncoderAclGraphManager.__init__, without the shim as well (tests/ut/worker/test_encoder_acl_graph.py's "
        "two capture tests); the stand-in answers with STANDIN_GRAPH_POOL, as NPUPlatform answers with "
        "torch.npu's graph pool handle (the tests patch torch.npu.graph / NPUGraph, which receive it)"),
}

# What the real stand-in's function imported that upstream's tests rely on, imported by the stand-in
# when it is called, for the releases of the window: name -> ((window, modules, why), ...).
STANDIN_IMPORTS = {
    "vllm_ascend.utils.adapt_patch": (
        (">=0.29.0rc1,<0.30.0rc1", ("vllm.v1.worker.gpu.spec_decode.speculator",),
         "vllm_ascend/worker/v2/attn_utils.py of 0.27.1rc1 - 0.29.0rc1 reads vllm.v1.worker.gpu.spec_decode.speculator "
         "as an attribute of the vllm package at import (_BUILD_ATTN_METADATA_MODULE), without importing it: the "
         "real adapt_patch() had imported it (vllm_ascend.patch.worker.patch_v2.patch_triton's first line), so "
         "tests/ut/worker/test_attn_utils_v2.py failed at collection with the no-op stand-in (AttributeError, "
         "with and without the shim); 0.30.0rc1 imports it in attn_utils.py itself. Declared where the suite runs "
         "(0.27.1rc1 and 0.28.0rc1: NO_SUITES)"),
    ),
}

# Releases whose suites run with the emulation's device (``NPU_SHIM_EMULATE_DEVICE=1``,
# npu_shim/emulation/device.py: ``torch.npu`` a one-device machine, as importing the real torch_npu
# makes it), with and without the shim: window -> why. Below 0.21.0rc1 upstream's conftest sets no
# ``torch.npu`` stand-in (it expects an installed torch_npu), and the emulation without its device
# adds no ``torch.npu``.
EMULATED_DEVICE = {
    "<0.21.0rc1": "0.20.2rc1's tests/ut/attention/test_attention_v1.py imports vllm_ascend.attention.attention_v1, "
                  "which imports vllm_ascend.compilation.acl_graph, which reads torch.npu.NPUGraph at import: "
                  "without the device, AttributeError (module 'torch' has no attribute 'npu') at collection, with "
                  "and without the shim; with it, the emulation's torch.npu answers (NPUGraph a placeholder class "
                  "that raises when instantiated, which only a graph capture does, and no test of the file captures)",
}


def emulated_device(version):
    """Whether the suites of ``version`` run with the emulation's device (EMULATED_DEVICE)."""
    return any(in_window(version, window) for window in EMULATED_DEVICE)


# Ops the tests patch by name (``patch("torch_npu.<op>")``, which needs the attribute to exist) but
# upstream's own stand-in torch_npu module (its tests/ut/conftest.py, 0.21.0rc1 on, when npu-smi is
# absent) does not define in these releases: window -> names. After collection (the conftest has run,
# every test module imported) each one missing from that stand-in module is set to a MagicMock named
# for it (recorded in the report's ``torch_npu_placeholders``); the tests that use it patch it. Without
# them those tests fail at ``patch`` (AttributeError: <module 'torch_npu'> does not have the attribute
# ...), with and without the shim, before reaching the attention impl.
TORCH_NPU_PLACEHOLDERS = {
    ">=0.21.0rc1,<0.27.1rc1": ("npu_fused_infer_attention_score", "npu_fused_infer_attention_score_v2",
                               "_npu_paged_attention", "_npu_paged_attention_get_workspace"),
}


class StandInGraphPool:
    """What the stand-in of ``Platform.get_global_graph_pool`` answers: one named object, the
    pool every capture of the process is handed (as NPUPlatform's one global pool)."""

    def __repr__(self):
        return "<npu-shim upstream-tests stand-in graph pool (lanes/upstream_tests.py)>"


STANDIN_GRAPH_POOL = StandInGraphPool()
STANDIN_VALUES = {"vllm.platforms.interface:Platform.get_global_graph_pool": STANDIN_GRAPH_POOL}

GQA_EVIDENCE = ("docs/upstream-evidence.md section 3.2 (GQA): the documented _npu_flash_attention_unpad takes "
                "K/V with num_kv_heads heads; the emulation rejects upstream's call (K/V repeated to num_heads, "
                "num_kv_heads unchanged); tests/lanes/test_mm_encoder_310p.py checks the family's call "
                "against the float64 reference (8 heads, 2 KV heads)")
DIFFERENCES = (
    Difference("vllm-ascend:mm_encoder_attention_310p",
               "tests/ut/_310p/ops/test_mm_encoder_attention_310.py::test_mm_encoder_attention_310_forward_oot_with_padding",
               ">=0.18.0", "failed",
               "upstream asserts its own GQA call: K/V repeated to num_heads (4) but num_kv_heads=2 passed to "
               "_npu_flash_attention_unpad; vllm.mm_encoder_attn_310p passes the head count of the K/V it hands "
               "over (4), so the assertion num_kv_heads == layer.num_kv_heads fails (4 != 2) - deliberate",
               GQA_EVIDENCE),
    Difference("vllm-ascend:mm_encoder_attention_310p",
               "tests/ut/_310p/ops/test_mm_encoder_attention_310.py::test_register_customop_overrides_mm_encoder_attention_for_310p",
               ">=0.28.0rc1", "failed",
               "not a difference of the shim: register_ascend_customop is a stand-in here (CONFTEST_STANDINS), so "
               "the test's own call registers nothing (KeyError 'MMEncoderAttention'); the real one fails without "
               "the shim as well (from 0.28.0rc1: no scipy in the lanes). Below 0.21.0rc1 it passes, the real "
               "one running on the emulation's device (EMULATED_DEVICE)",
               "lanes/upstream_tests.py run LANE ARCHIVE --without-shim"),
    Difference("vllm-ascend:attn_utils_v2",
               "tests/ut/worker/test_attn_utils_v2.py::test_main_entry_allocates_and_reshapes_kvpp_views[[]mla[]]",
               ">=0.29.0rc1", "failed",
               "not a difference of the shim: the MLA case builds its model config through transformers' Qwen2-VL "
               "image processor, which imports torchvision, which the lanes do not install (ModuleNotFoundError, "
               "without the shim as well)",
               "lanes/upstream_tests.py run vllm-0.29|vllm-0.30 ARCHIVE --without-shim: the same two tests fail, the same error"),
    Difference("vllm-ascend:attn_utils_v2",
               "tests/ut/worker/test_attn_utils_v2.py::test_main_entry_allocates_and_reshapes_kvpp_views[[]sfa-c8[]]",
               ">=0.29.0rc1", "failed",
               "not a difference of the shim: as the MLA case, torchvision (ModuleNotFoundError, without the shim "
               "as well)",
               "lanes/upstream_tests.py run vllm-0.29|vllm-0.30 ARCHIVE --without-shim: the same two tests fail, the same error"),
)


# Upstream's own skips of test_model_runner_v1.py on the vLLM a lane pins: (tests, release, upstream's skip
# reason), each measured with lanes/upstream_tests.py run LANE ARCHIVE --without-shim (the same skips).
UPSTREAM_RUNNER_SKIPS = (
    (("TestDummyRunSlotInvalidation::test_graph_capture_invalidates_only_v41_active_slots",
      "TestNPUModelRunnerKVCache::test_v41_dspark_shares_four_backings_after_rank_shrink",
      "TestNPUModelRunnerKVCache::test_v41_layer_outer_buffers_allocate_and_reshape"),
     "0.29.0rc1", "@unittest.skipIf(vllm_version_is(\"0.29.0\"), \"DeepSeek V4.1 is unavailable on vLLM 0.29\")"),
    (("TestNPUModelRunnerKVCache::test_dsv4_main_materializes_real_planner_geometry_once",
      "TestNPUModelRunnerKVCache::test_hybrid_descriptors_share_standardized_backing_allocation"),
     "0.28.0rc1", "\"vLLM #51718 only changed the main planner\""),
)
DIFFERENCES += tuple(
    Difference("vllm-ascend:model_runner_v1", "tests/ut/worker/test_model_runner_v1.py::" + test, "==" + release,
               "skipped", "not a difference of the shim: upstream skips it on the vLLM its lane pins (%s)" % why,
               "lanes/upstream_tests.py run LANE ARCHIVE --without-shim (vllm-ascend %s): the same tests skipped, "
               "the same reason" % release)
    for tests, release, why in UPSTREAM_RUNNER_SKIPS for test in tests)
DIFFERENCES += (Difference(
    "vllm-ascend:model_runner_v1",
    "tests/ut/worker/test_model_runner_v1.py::TestNPUModelRunnerKVCache::test_kvpp_allocate_and_reshape_views",
    "==0.28.0rc1", "failed",
    "not a difference of the shim: upstream's test helper (tests/ut/kvpp_utils.py) builds vLLM's KVCacheTensor "
    "with layers=, which vLLM 0.28's KVCacheTensor does not take (TypeError, without the shim as well)",
    "lanes/upstream_tests.py run vllm-0.28 ARCHIVE --without-shim: the same test fails, the same TypeError"),)


def _specifier(text):
    from packaging.specifiers import SpecifierSet

    return SpecifierSet(text, prereleases=True)


def in_window(version, window):
    """``window``: a version specifier, or several joined by ``|`` (any of them)."""
    return any(_specifier(part.strip()).contains(version, prereleases=True) for part in window.split("|"))


def lane_release(lane):
    """(dist, release) whose suites ``lane`` runs, or None."""
    return LANES.get(lane)


def suites_of(dist, version):
    return [suite for suite in SUITES if suite.dist == dist and in_window(version, suite.releases)]


def declared(suite, nodeid, version):
    """The declaration for test ``nodeid`` of ``suite`` on release ``version``, or None."""
    for difference in DIFFERENCES:
        if difference.suite == suite and fnmatch.fnmatchcase(nodeid, difference.test) \
                and in_window(version, difference.releases):
            return difference
    return None


def table_problems():
    """Inconsistencies of the tables themselves (checked by tests/test_upstream_tests.py)."""
    out = []
    names = {suite.name for suite in SUITES}
    for lane, (dist, version) in LANES.items():
        if (dist, version) not in PINS:
            out.append("lane %s runs %s %s, which PINS does not pin" % (lane, dist, version))
        if not suites_of(dist, version):
            out.append("lane %s runs %s %s, for which no suite is declared" % (lane, dist, version))
    for difference in DIFFERENCES:
        if difference.suite not in names:
            out.append("declared difference for unknown suite %s" % difference.suite)
        if difference.outcome not in ("failed", "skipped"):
            out.append("declared difference %s: outcome %r is neither failed nor skipped"
                       % (difference.test, difference.outcome))
        if not difference.reason or not difference.evidence:
            out.append("declared difference %s: no reason or no evidence" % difference.test)
        if not any(in_window(version, difference.releases) for (dist, version) in LANES.values()
                   if dist == next(s.dist for s in SUITES if s.name == difference.suite)):
            out.append("declared difference %s: no lane runs a release of its window %s"
                       % (difference.test, difference.releases))
    return out


# ---------------------------------------------------------------------------------------------
# The archive


def sha256_of(path):
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _members(archive):
    """{path inside the source tree (first component dropped): TarInfo} of regular files."""
    members = {}
    for info in archive.getmembers():
        parts = info.name.split("/", 1)
        if info.isfile() and len(parts) == 2:
            members[parts[1]] = info
    return members


def archive_commit(members, archive):
    """The commit setuptools-scm wrote into the archive's vllm_ascend/_version.py ('g<hash>')."""
    info = members.get("vllm_ascend/_version.py")
    if info is None:
        return None
    text = archive.extractfile(info).read().decode("utf-8", "replace")
    found = re.search(r"""^__commit_id__ = commit_id = ['"]g?([0-9a-f]+)['"]""", text, re.M)
    return found.group(1) if found else None


def support_files(files, members):
    """The files the suite's test files need besides themselves: every ``conftest.py`` from
    tests/ down to their directories, and every module under tests/ that is not a test file or
    another directory's conftest.py (``__init__.py``, tests/ut/base.py's TestBase, the helpers
    a conftest imports, e.g. 0.27.1rc1's tests/ut/helpers)."""
    ancestry = set()
    for path in files:
        parts = path.split("/")[:-1]
        ancestry.update("/".join(parts[:depth]) for depth in range(1, len(parts) + 1))
    chosen = []
    for name in members:
        directory, _, base = name.rpartition("/")
        if not name.startswith("tests/") or not name.endswith(".py") or base.startswith("test_"):
            continue
        if base == "conftest.py" and directory not in ancestry:
            continue
        chosen.append(name)
    return sorted(chosen)


def extract(path, pin, suites, destination):
    """The suites' files (and their support files) of the archive at ``path`` into
    ``destination``; returns (files extracted, problems)."""
    problems = []
    digest = sha256_of(path)
    if digest != pin.sha256:
        return [], ["%s: sha256 %s, but PINS pins %s" % (os.path.basename(path), digest, pin.sha256)]
    with tarfile.open(path) as archive:
        members = _members(archive)
        commit = archive_commit(members, archive)
        if commit is None or not (pin.commit.startswith(commit) or commit.startswith(pin.commit)):
            problems.append("%s: its _version.py names commit %s, PINS %s" % (os.path.basename(path), commit, pin.commit))
        files = [name for suite in suites for name in suite.files]
        missing = [name for name in files if name not in members]
        problems += ["%s: no %s in the archive" % (os.path.basename(path), name) for name in missing]
        chosen = [name for name in files if name in members] + support_files(files, members)
        for name in chosen:
            target = os.path.join(destination, *name.split("/"))
            os.makedirs(os.path.dirname(target), exist_ok=True)
            with open(target, "wb") as handle:
                handle.write(archive.extractfile(members[name]).read())
    return chosen, problems


# ---------------------------------------------------------------------------------------------
# The run (in the lane's venv)


def bootstrap_dir():
    """The installed shim's start-up directory (what ``npu-shim run`` puts on PYTHONPATH)."""
    import importlib.util

    spec = importlib.util.find_spec("npu_shim")
    if spec is None or not spec.submodule_search_locations:
        return None
    return os.path.join(list(spec.submodule_search_locations)[0], "_bootstrap")


def run(lane, archive, env, shim=True):
    """Run the suites of ``lane``'s release from ``archive`` (the sdist's path) with the shim
    installed; returns the report: {release, archive, sha256, commit, suites: [...], seconds,
    problems}. ``shim=False`` (by hand, ``run ... --without-shim``): upstream alone, torch_npu
    the emulation's package where the conftest wants an installed one; the outcomes only."""
    started = time.monotonic()
    dist, version = LANES[lane]
    pin = PINS[(dist, version)]
    suites = suites_of(dist, version)
    report = {"dist": dist, "release": version, "archive": os.path.basename(archive or ""), "sha256": pin.sha256,
              "commit": pin.commit, "commit_from": pin.commit_from, "suites": [], "problems": []}
    if not archive or not os.path.exists(archive):
        report["problems"].append("upstream suites: no archive of %s %s was given (noxfile.py fetches it)"
                                  % (dist, version))
        return report
    scratch = tempfile.mkdtemp(prefix="npu-shim-upstream-%s-%s-" % (dist, version))
    try:
        files, problems = extract(archive, pin, suites, scratch)
        report["problems"] += problems
        if problems:
            return report
        results_path = os.path.join(scratch, "npu-shim-results.json")
        boot = bootstrap_dir()
        entries = [p for p in env.get("PYTHONPATH", "").split(os.pathsep) if p]
        if shim:
            entries = [boot] + entries
        else:  # upstream alone: neither the shim's start-up directory nor a checkout's sitecustomize.py
            entries = [os.path.join(os.path.dirname(boot), "emulation", "_site")] + [
                p for p in entries if os.path.abspath(p) not in (os.path.dirname(os.path.dirname(boot)), boot)]
        run_env = dict(env, PYTHONPATH=os.pathsep.join(entries), NPU_SHIM_EMULATE="1",
                       NPU_SHIM_UPSTREAM_RESULTS=results_path, NPU_SHIM_UPSTREAM_RELEASE=version,
                       VLLM_CONFIGURE_LOGGING="0", PYTEST_DISABLE_PLUGIN_AUTOLOAD="1",
                       NPU_SHIM_UPSTREAM_PATCHES=",".join(sorted({p for suite in suites for p in suite.patches})))
        run_env.pop("NPU_SHIM_LANE", None)
        if not shim:
            run_env = {k: v for k, v in run_env.items() if not k.startswith("NPU_SHIM") or k.startswith("NPU_SHIM_UPSTREAM")}
            run_env["NPU_SHIM_UPSTREAM_NO_SHIM"] = "1"
            run_env["VLLM_PLUGINS"] = ""  # not even the shim's vLLM plugin
            run_env["NPU_SHIM"] = "0"  # the emulated torch_npu imports npu_shim, which would install it
        if emulated_device(version):
            run_env["NPU_SHIM_EMULATE_DEVICE"] = "1"
        test_files = [name for suite in suites for name in suite.files]
        command = [sys.executable, os.path.abspath(__file__), "pytest", "--", *test_files, "-q", "--continue-on-collection-errors",
                   "-p", "no:cacheprovider", "--rootdir", scratch]
        print("+ (in %s) %s" % (scratch, " ".join(command)), flush=True)
        proc = subprocess.run(command, cwd=scratch, env=run_env, capture_output=True, text=True)
        output = proc.stdout + proc.stderr
        print("\n".join(output.splitlines()[-15:]), flush=True)
        try:
            with open(results_path, encoding="utf-8") as handle:
                results = json.load(handle)
        except (OSError, ValueError):
            report["problems"].append("upstream suites: pytest (exit %d) wrote no results: %s"
                                      % (proc.returncode, " | ".join(output.strip().splitlines()[-5:])))
            return report
        report["standins_called"] = results.get("standins_called", {})
        report["torch_npu_placeholders"] = results.get("torch_npu_placeholders", [])
        report["suites"], problems = judge(suites, version, results, shim)
        report["problems"] += problems
        report["pytest_exit_code"] = proc.returncode
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
        report["seconds"] = round(time.monotonic() - started, 1)
    return report


def judge(suites, version, results, shim=True):
    """Per suite: each test's verdict (passed / declared-different / failed) and the lane's
    problems: undeclared failures, stale declarations, a patch not applied or never reached."""
    outcomes = results.get("tests", {})
    stats = results.get("stats", {})
    reached = results.get("reached", {})
    rows, problems = [], []
    for suite in suites:
        mine = {nodeid: value for nodeid, value in outcomes.items()
                if nodeid.split("::", 1)[0] in suite.files}
        tests, counts = [], collections.Counter()
        for nodeid, value in sorted(mine.items()):
            difference = declared(suite.name, nodeid, version) if shim else None
            outcome = value["outcome"]
            if difference is None:
                verdict = "passed" if outcome == "passed" else "failed"
                if verdict == "failed":
                    problems.append("upstream test %s (%s %s): %s without a declared difference: %s"
                                    % (nodeid, suite.dist, version, outcome, value.get("message", "")[:300]))
            elif outcome == difference.outcome:
                verdict = "declared-different"
            else:
                verdict = "failed"
                problems.append("upstream test %s (%s %s): declared %s (%s), but it %s: a stale declaration "
                                "(lanes/upstream_tests.py DIFFERENCES)"
                                % (nodeid, suite.dist, version, difference.outcome, difference.reason[:80], outcome))
            counts[verdict] += 1
            tests.append({"test": nodeid, "outcome": outcome, "verdict": verdict,
                          "reason": difference.reason if difference else ""})
        for difference in DIFFERENCES:
            if difference.suite == suite.name and in_window(version, difference.releases) \
                    and not any(fnmatch.fnmatchcase(nodeid, difference.test) for nodeid in mine):
                problems.append("declared difference %s (%s %s) matched no test that ran: a stale declaration"
                                % (difference.test, suite.dist, version))
        if not mine:
            problems.append("upstream suite %s (%s %s): no test ran" % (suite.name, suite.dist, version))
        for patch in suite.patches if shim else ():
            row = stats.get(patch)
            if not row or row.get("state") != "applied":
                problems.append("upstream suite %s: patch %s was %s, so its tests did not test the shim"
                                % (suite.name, patch, (row or {}).get("state", "absent")))
            elif not (row.get("calls") or row.get("upstream_calls") or reached.get(patch)):
                problems.append("upstream suite %s: patch %s applied (%s) but no test reached it"
                                % (suite.name, patch, row.get("family")))
        rows.append({"suite": suite.name, "files": list(suite.files), "patches": list(suite.patches),
                     "families": {p: (stats.get(p) or {}).get("family") for p in suite.patches},
                     "calls": {p: (stats.get(p) or {}).get("calls", 0) for p in suite.patches},
                     "reached": {p: reached.get(p, 0) for p in suite.patches},
                     "passed": counts["passed"], "declared": counts["declared-different"],
                     "failed": counts["failed"], "tests": tests})
    return rows, problems


# ---------------------------------------------------------------------------------------------
# Inside the pytest process


class Recorder:
    """pytest plugin: each test's outcome by node id, collection errors, and the shim's
    counters at the end, written to $NPU_SHIM_UPSTREAM_RESULTS."""

    def __init__(self, path):
        self.path = path
        self.tests = {}
        self.placeholders = []

    def pytest_collectreport(self, report):
        if report.failed:
            self.tests[report.nodeid] = {"outcome": "error", "message": str(report.longrepr)[-2000:]}

    def pytest_runtest_logreport(self, report):
        outcome = report.outcome
        if report.when != "call" and outcome == "failed":
            outcome = "error"
        if report.when == "call" or outcome != "passed":
            previous = self.tests.get(report.nodeid, {}).get("outcome")
            if previous in ("error", "failed") and outcome == "passed":
                return
            message = ""
            if outcome != "passed":
                message = (report.longrepr[2] if isinstance(report.longrepr, tuple)
                           else getattr(getattr(report.longrepr, "reprcrash", None), "message", "")
                           or str(report.longrepr)[-500:])
            self.tests[report.nodeid] = {"outcome": outcome, "message": str(message)}

    def pytest_collection_finish(self, session):
        from unittest.mock import MagicMock

        module = sys.modules.get("torch_npu")
        version = os.environ["NPU_SHIM_UPSTREAM_RELEASE"]
        if module is None or getattr(module, "__file__", None):  # not upstream's stand-in module
            return
        for window, names in TORCH_NPU_PLACEHOLDERS.items():
            if in_window(version, window):
                for name in names:
                    if not hasattr(module, name):
                        setattr(module, name, MagicMock(name="torch_npu." + name))
                        self.placeholders.append(name)

    def pytest_sessionfinish(self, session):
        stats = {}
        try:
            if not os.environ.get("NPU_SHIM_UPSTREAM_NO_SHIM"):
                import npu_shim

                stats = npu_shim.stats()
        except Exception as error:  # noqa: BLE001 - reported, not raised
            stats = {"error": repr(error)}
        with open(self.path, "w", encoding="utf-8") as handle:
            json.dump({"tests": self.tests, "stats": stats, "standins_called": dict(STANDINS_CALLED),
                       "reached": dict(REACHED.calls), "torch_npu_placeholders": self.placeholders}, handle)


STANDINS_CALLED = collections.Counter()


class _StandIns:
    """Meta-path finder: after a module of CONFTEST_STANDINS executes, each named function of it
    is replaced by a no-op that counts its calls."""

    def __init__(self, version):
        self.targets = collections.defaultdict(list)
        for dotted, (window, _) in CONFTEST_STANDINS.items():
            if in_window(version, window):
                module, name = _standin_target(dotted)
                self.targets[module].append((dotted, name))

    def install_imported(self):
        """The targets whose module is already imported (by the shim's start-up) get theirs now."""
        for module in list(self.targets):
            if module in sys.modules:
                _install_standins(sys.modules[module], self.targets.pop(module))

    def find_spec(self, fullname, path=None, target=None):
        if fullname not in self.targets:
            return None
        import importlib.machinery

        for finder in sys.meta_path:
            if finder is self or not hasattr(finder, "find_spec"):
                continue
            spec = finder.find_spec(fullname, path, target)
            if spec is not None and spec.loader is not None:
                spec.loader = _Wrapped(spec.loader, self.targets[fullname])
                return spec
        return importlib.machinery.PathFinder.find_spec(fullname, path)


def standin_imports(dotted, version):
    """The modules the stand-in of ``dotted`` imports when called on ``version`` (STANDIN_IMPORTS;
    none when no release is named)."""
    if not version:
        return []
    return [module for window, modules, _ in STANDIN_IMPORTS.get(dotted, ()) if in_window(version, window)
            for module in modules]


def _standin_target(dotted):
    """(module, attribute path inside it) of a CONFTEST_STANDINS name."""
    if ":" in dotted:
        module, _, name = dotted.partition(":")
        return module, name
    module, _, name = dotted.rpartition(".")
    return module, name


class _Wrapped:
    def __init__(self, loader, names):
        self.loader, self.names = loader, names

    def create_module(self, spec):
        return self.loader.create_module(spec)

    def exec_module(self, module):
        self.loader.exec_module(module)
        _install_standins(module, self.names)

    def __getattr__(self, name):
        return getattr(self.loader, name)


def _install_standins(module, names):
    """Replace each (dotted, attribute path) of ``names`` in ``module`` by its counting stand-in."""
    for dotted, name in names:
        owner = module
        *path, last = name.split(".")
        for attr in path:
            owner = getattr(owner, attr)
        if not callable(getattr(owner, last, None)):
            raise RuntimeError("stand-in %s: %s has no function %s" % (dotted, owner, last))

        def standin(*args, _dotted=dotted, **kwargs):
            STANDINS_CALLED[_dotted] += 1
            for module_name in standin_imports(_dotted, os.environ.get("NPU_SHIM_UPSTREAM_RELEASE")):
                importlib.import_module(module_name)
            return STANDIN_VALUES.get(_dotted)

        standin.__name__ = last
        setattr(owner, last, standin)


class Reach:
    """Which patches' installed replacements upstream's tests ran: a ``sys.settrace`` hook that
    looks only at Python function calls (no line events) whose code name is that of a replaced
    function, and counts a call when the code is the one installed at the patch's path. For the
    patches that edit upstream's function (their replacement counts nothing itself), this is how
    the gate knows a suite reached the patched code; a test that mocks the patched method out does
    not count."""

    def __init__(self, patch_names):
        from npu_shim import reference
        from npu_shim.patch import parse_path

        self.watch = collections.defaultdict(list)   # code name -> [(patch, module, attribute path)]
        for patch, _ in reference.patches():
            if patch.name in patch_names:
                for path in tuple(patch.replaces) + tuple(patch.may_replace):
                    attrs, key = parse_path(path)
                    if key is None:
                        self.watch[attrs[-1]].append((patch.name, patch.target, attrs))
        self.known = {}                               # code -> patch name, or None
        self.calls = collections.Counter()

    def _installed(self, module, attrs):
        owner = sys.modules.get(module)
        for attr in attrs:
            owner = getattr(owner, attr, None)
        return getattr(getattr(owner, "__func__", owner), "__code__", None)

    def trace(self, frame, event, arg):
        if event == "call" and frame.f_code.co_name in self.watch:
            code = frame.f_code
            if code not in self.known:
                self.known[code] = next((patch for patch, module, attrs in self.watch[code.co_name]
                                         if self._installed(module, attrs) is code), None)
            if self.known[code]:
                self.calls[self.known[code]] += 1
        return None

    def start(self):
        import threading

        sys.settrace(self.trace)
        threading.settrace(self.trace)


REACHED = Reach.__new__(Reach)
REACHED.calls = collections.Counter()


def pytest_main(args):
    import pytest

    global REACHED
    standins = _StandIns(os.environ["NPU_SHIM_UPSTREAM_RELEASE"])
    sys.meta_path.insert(0, standins)
    standins.install_imported()
    patches = [name for name in os.environ.get("NPU_SHIM_UPSTREAM_PATCHES", "").split(",") if name]
    if patches and not os.environ.get("NPU_SHIM_UPSTREAM_NO_SHIM"):
        REACHED = Reach(patches)
        REACHED.start()
    return pytest.main(args, plugins=[Recorder(os.environ["NPU_SHIM_UPSTREAM_RESULTS"])])


# ---------------------------------------------------------------------------------------------


def format_suites(report):
    """Rows (suite, release, passed, declared-different, failed) of one lane's report."""
    return [(row["suite"], "%s %s" % (report["dist"], report["release"]), row["passed"], row["declared"],
             row["failed"]) for row in report.get("suites", [])]


def main(argv=None):
    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] == ["pytest"]:
        rest = argv[1:]
        if rest[:1] == ["--"]:
            rest = rest[1:]
        return pytest_main(rest)
    if argv[:1] == ["list"]:
        for lane, (dist, version) in LANES.items():
            pin = PINS[(dist, version)]
            print("%-12s %s %-10s sha256 %s commit %s  suites: %s" % (
                lane, dist, version, pin.sha256[:16], pin.commit[:12],
                ", ".join(suite.name for suite in suites_of(dist, version))))
        for difference in DIFFERENCES:
            print("declared: %s %s -> %s" % (difference.test, difference.releases, difference.outcome))
        problems = table_problems()
        for problem in problems:
            print("PROBLEM: " + problem)
        return 1 if problems else 0
    if argv[:1] == ["run"] and len(argv) in (3, 4):
        # By hand, in a lane's venv: python lanes/upstream_tests.py run LANE ARCHIVE [--without-shim]
        report = run(argv[1], argv[2], dict(os.environ), shim="--without-shim" not in argv)
        for row in report.get("suites", []):
            print("%s %s %s: %d passed, %d declared-different, %d failed; patched code reached %s" % (
                row["suite"], report["dist"], report["release"], row["passed"], row["declared"], row["failed"],
                row.get("reached")))
            for test in row["tests"]:
                print("  %-9s %-18s %s" % (test["outcome"], test["verdict"], test["test"]))
        for problem in report["problems"]:
            print("PROBLEM: " + problem)
        print("stand-ins called: %s; torch_npu placeholders: %s" % (report.get("standins_called"), report.get("torch_npu_placeholders")))
        print("%.1f s" % report.get("seconds", 0))
        return 1 if report["problems"] else 0
    if argv[:1] == ["pin"] and len(argv) == 3:
        path = subprocess.run([sys.executable, os.path.join(HERE, "sdist.py"), "fetch", argv[1], argv[2]],
                              check=True, capture_output=True, text=True).stdout.strip()
        with tarfile.open(path) as archive:
            commit = archive_commit(_members(archive), archive)
        print("%s %s: sha256 %s, commit %s (from its _version.py)" % (argv[1], argv[2], sha256_of(path), commit))
        return 0
    print(__doc__.split("\n\n")[1], file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
