"""The vision-tower census: device->host reads per whole tower forward, upstream -> shim, for
every tower :mod:`npu_shim.testing.census` builds, and the site that sets the floor.

    python benchmarks/bench_census.py [--lane LANE] [--device-class A2|310P ...]
    python benchmarks/bench_census.py --doc            # docs/towers.md from the results only
    python benchmarks/bench_census.py --lane probe-NAME --probe "nox -s probe -- ..."   # a probe's venv

Run in a lane venv (vLLM + vllm-ascend installed, npu-shim installed there). For each
tower and device class it runs :func:`npu_shim.testing.census.side_by_side` (the shim's
attention, vllm-ascend's untouched class, vLLM's TORCH_SDPA tower; same weights, two
forwards over different grids), checks each forward (the shim's output ``torch.equal`` to
upstream's, within the census test's tolerance of a float64 copy of the tower and of the
TORCH_SDPA tower) and prints a table. The reads the shim leaves are grouped by the code
that made them (``file:line in function``): the floor's sites.

With ``--lane`` it also writes ``benchmarks/results/census-<LANE>.json`` (what it
measured, with date, machine and commit) and then regenerates ``docs/towers.md`` from every
``census-*.json`` there: the document's figures are the last runs' figures, never typed
in. ``--doc`` only regenerates the document. The prose on each tower (why a read stays)
is :data:`WHY` below; the measured columns beside it are the run's.

A probe (``nox -s probe -- ... --no-tests``: releases with no lane, perhaps no release pair)
is measured the same way, run in the probe's venv with ``--probe "<the nox command that made
the venv>"``: its result is marked so, and the document prints it in its own section after the
lanes', titled as a probe, with that command and this one to reproduce it.
"""
import argparse
import datetime
import glob
import json
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
RESULTS = os.path.join(HERE, "results")
DOC = os.path.join(ROOT, "docs", "towers.md")

os.environ.setdefault("VLLM_PLUGINS", "")
os.environ.setdefault("VLLM_LOGGING_LEVEL", "ERROR")

# Why each tower's remaining reads stay: read in the wheels, checked against the sites the run
# prints beside it (the measured columns come from the run, this column does not).
WHY = {
    "Qwen2-VL": "cu_seqlens is built with NumPy on the host and copied by the tower itself; "
                "`vllm.qwen2_vl_host_lengths` keeps the host array on that copy. The grid stays on the "
                "host (`keep_on_cpu`).",
    "Qwen3-Omni": "cu_seqlens comes from the host grid (`repeat_interleave`) and is copied by the tower; "
                  "`vllm.qwen3_omni_vision_host_lengths` keeps the host lengths on that copy.",
    "dots.ocr": "the model hands the tower its grid as a host list; upstream copies it to the device "
                "(`torch.tensor(grid, device=...)`, a blocking copy), builds cu_seqlens there "
                "(`repeat_interleave` with device repeats: a shape read), the attention reads cu_seqlens, "
                "and `rot_pos_emb` indexes the device rotary table with host ids (a blocking copy). "
                "`vllm.dots_ocr_host_lengths` builds cu_seqlens from the host list with the same ops, copies "
                "it, the grid and the ids non-blocking and keeps the host cu_seqlens on its copy: 0 reads "
                "and 0 blocking copies (without it: 2 and 2).",
    "LLaVA-OneVision-2": "cu_seqlens goes through `maybe_recompute_cu_seqlens` (attention: 0); "
                         "`_build_window_cu_seqlens` reads the device `image_grid_thw` (`.tolist()`), "
                         "sent there by the field config.",
    "Ernie4.5-VL": "where the field config sends the grid to the device (0.26.0), `rot_pos_emb` iterates it "
                   "(scalar reads per frame row), the rotary table reads max(grid), cu_seqlens is built on the "
                   "device and the attention reads it once; where it keeps the grid on the host (`keep_on_cpu`, "
                   "0.30.0 on), cu_seqlens is built on the host and sent by `async_tensor_h2d`, and the attention "
                   "reads that copy back once (no patch keeps its host values yet).",
    "GLM-OCR": "cu_seqlens comes from the host grid (`repeat_interleave`) and is copied by GLM-OCR's own "
               "`forward` (`.to(self.device, non_blocking=True)`); `vllm.glm_ocr_host_lengths` keeps the host "
               "lengths on that copy (without it the attention reads cu_seqlens once: "
               "`vllm.glm4_1v_host_lengths` patches GLM-4.1V's `forward`, which GLM-OCR overrides).",
    "Keye-VL": "its field config sends the grid to the device, and the model's `_process_image_input` reads "
               "it back to build cu_seqlens, position ids and sample indices as host lists (0.26.0: `.cpu()` "
               "per row and 3 blocking `.to(device)` copies; 0.30.0: one `.tolist()` and no blocking copy); "
               "the attention reads cu_seqlens once; the projector's `rearrange` takes the device grid's "
               "t, h, w (two sizes per call: 4 per image). 0.26.0 also reads the rotary table's `pids.max() + 1` and slices "
               "the output with device `cu_seqlens[i]` (2 per image). The attention's read (and 0.26.0's "
               "slicing) are of numbers the host built; the grid reads set the floor while the grid is "
               "on the device.",
    "PaddleOCR-VL": "`encode_image` builds cu_seqlens on the host. From 0.28.0 it is copied with "
                    "`async_tensor_h2d` (0.28.0 - 0.30.0 in `encode_image`, once per image; 0.33.0 (probe) "
                    "in the tower's `forward`, every image in one call), and `vllm.paddleocr_vl_host_lengths` "
                    "keeps the host values on that copy, so the attention reads nothing (without it: 1 read "
                    "per copy, of numbers the host built a line above). 0.26.0 (and 0.27.1) copy with a "
                    "blocking `torch.tensor(...).to(device)`, not patched: the attention reads it once per "
                    "image. Before 0.29.0 the field config sends the grid to the device (`batched` "
                    "without `keep_on_cpu`), so `encode_image` reads each image's grid row (`.tolist()`: "
                    "the floor there, 0.28.0 included), and 0.26.0 also reads the rotary table's "
                    "`pids.max() + 1`. Measured: the model's own encoding path without the "
                    "projector (`mlp_AR`) it applies after the tower.",
    "HunYuan-Vision": "the attention runs per image with no cu_seqlens (no read, upstream or shim); "
                      "upstream copies its host cu_seqlens to the device and then `.tolist()`s the "
                      "differences of the copy to split its output (1 read of numbers the host built); "
                      "`vllm.hunyuan_vision_host_lengths` splits by the host tensor's differences (the copy "
                      "is kept). vLLM 0.30.0 and 0.33.0 have no `hunyuan_vision` module.",
    "RADIO": "with more than one image in a dynamic-resolution batch, `_inter_image_mask_metadata_from_seq_lens` "
             "builds cu_seqlens with `torch.tensor(accumulate(seq_lens), device=...)` from the host `imgs_sizes` "
             "(a blocking copy, kept; `max_seqlen` stays on the host); the copy is not "
             "`maybe_recompute_cu_seqlens`', and `vllm.radio_host_lengths` wraps that method and keeps the "
             "host lengths it was built from on the tensor it returns, so the attention reads nothing "
             "(without it: 1 read, of numbers the host built a line above). Tiled (fixed-resolution) inputs "
             "and a single image pass no cu_seqlens (read in the wheel, not in this table).",
    "MuseSpark": "vLLM 0.33.0's NaViT (`vllm/models/muse_spark/common/vision.py`), measured with one "
                 "window-attention layer among three. The model hands it a list of device images whose "
                 "sizes the host knows; the tower builds cu_seqlens (and, for window layers, the window "
                 "cu_seqlens) with `torch.tensor(host list, device=...)` (the blocking copies), and the "
                 "attention reads each tensor once (upstream: once per layer). For window layers it also "
                 "reads a boolean-mask shape per image (`_get_sparse_attention_perm`) and `.tolist()`s the "
                 "device window lengths. Every one of these is of numbers the host has: only a patch of "
                 "the tower's `forward` removes them.",
}


def _site(event):
    """``file:line in function`` with the path cut to the package (vllm/..., vllm_ascend/...)."""
    location = event.location
    for root in ("vllm_ascend/", "vllm/", "npu_shim/"):
        i = location.find("/" + root)
        if i >= 0:
            return location[i + 1:]
    return location


def measure(device_classes):
    import torch
    from importlib.metadata import version

    from npu_shim.testing import census, towers

    sys.path.insert(0, os.path.join(ROOT, "tests", "lanes"))
    from test_tower_census import TOWER_TOL    # the census test's tolerances, one source

    stack = census.setup()
    release = {"vllm": version("vllm"), "vllm-ascend": version("vllm-ascend")}
    rows = []
    for device_class in device_classes:
        towers.emulate_device_class(device_class)
        for name in census.CENSUS:
            if name not in census._MODULES:
                rows.append({"tower": name, "class": getattr(census.CENSUS[name], "classes", census.CENSUS[name].cls), "device_class": device_class,
                             "absent": True})
                continue
            forwards = []
            for run in census.side_by_side(stack, name, device_class):
                equal = bool(torch.equal(run.out, run.up))
                ref = census.reference_forward(stack, name, run.x, run.grid)
                scale = ref.abs().max().item()
                err_f64 = (run.out.double() - ref).abs().max().item() / scale
                err_sdpa = (run.out.double() - run.sdpa.double()).abs().max().item() / scale
                tol = TOWER_TOL[str(run.out.dtype).replace("torch.", "")]
                sites = {}
                for event in run.syncs.events:
                    key = "%s at %s" % (event.kind, _site(event))
                    sites[key] = sites.get(key, 0) + 1
                forwards.append({
                    "grid": run.grid, "upstream": run.up_syncs.count, "shim": run.syncs.count,
                    "upstream_h2d": run.up_syncs.h2d_count, "shim_h2d": run.syncs.h2d_count,
                    "shim_sites": sites, "equal_to_upstream": equal, "err_vs_float64": err_f64,
                    "err_vs_sdpa": err_sdpa, "tolerance": tol, "dtype": str(run.out.dtype).replace("torch.", ""),
                    "ok": equal and err_f64 <= tol and err_sdpa <= tol,
                })
            rows.append({"tower": name, "class": getattr(census.CENSUS[name], "classes", census.CENSUS[name].cls), "device_class": device_class,
                         "forwards": forwards})
    return release, rows


def patch_states():
    """What each patch does in this venv, as ``npu-shim status --import`` says it (targets
    imported the way the lanes' status imports them): [{name, state, family, reason}], the
    patches of frameworks that are not installed left out."""
    import contextlib

    from npu_shim import _startup
    from npu_shim.testing.towers import targets_importable

    with targets_importable(), contextlib.redirect_stdout(sys.stderr):
        rows = _startup.engine().status(import_targets=True)
    return [{key: row.get(key) for key in ("name", "state", "family", "reason")} for row in rows
            if not (row.get("reason") or "").startswith("not installed")]


def print_table(release, rows):
    print("vllm %s + vllm-ascend %s" % (release["vllm"], release["vllm-ascend"]))
    print("%-18s %-5s %-10s %-10s %-8s %-5s %s" % ("tower", "class", "forward 0", "forward 1", "h2d", "ok",
                                                 "what the shim leaves (reads per forward 0, by site)"))
    for row in rows:
        if row.get("absent"):
            print("%-18s %-5s not in this vLLM release" % (row["tower"], row["device_class"]))
            continue
        f = row["forwards"]
        print("%-18s %-5s %-10s %-10s %-8s %-5s %s" % (
            row["tower"], row["device_class"], "%d -> %d" % (f[0]["upstream"], f[0]["shim"]),
            "%d -> %d" % (f[1]["upstream"], f[1]["shim"]),
            "%d -> %d" % (max(x["upstream_h2d"] for x in f), max(x["shim_h2d"] for x in f)),
            all(x["ok"] for x in f), "; ".join("%s x%d" % kv for kv in f[0]["shim_sites"].items()) or "-"))


def _commit():
    import subprocess

    def git(*words):
        proc = subprocess.run(["git", *words], cwd=ROOT, capture_output=True, text=True)
        return proc.stdout.strip() if proc.returncode == 0 else ""

    head = git("rev-parse", "--short=12", "HEAD") or "no git commit"
    return head + (" + uncommitted changes" if git("status", "--porcelain", "--untracked-files=no") else "")


def write_result(lane, release, rows, probe=None):
    """``probe``: None for a lane, else {"venv": the command that made the probe's venv,
    "census": the command that measured it, "versions": other releases in the venv}."""
    import platform

    os.makedirs(RESULTS, exist_ok=True)
    path = os.path.join(RESULTS, "census-%s.json" % lane)
    commit = _commit()       # before the file is opened: truncating it makes the tree "uncommitted"
    result = {"lane": lane, "release": release, "rows": rows, "commit": commit,
              "ran": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
              "machine": "%s, %d cores, Python %s" % (platform.system(), os.cpu_count() or 0,
                                                      platform.python_version())}
    if probe is not None:
        result["probe"] = probe
    with open(path, "w") as handle:
        json.dump(result, handle, indent=1, sort_keys=True)
        handle.write("\n")
    return path


INTRO = """\
# Vision towers: device->host reads per forward, upstream -> shim

Generated by `benchmarks/bench_census.py` from `benchmarks/results/census-*.json`, which that
script writes when it measures (`python benchmarks/bench_census.py --lane LANE` in the lane's
venv). Every figure below is the last run's; do not edit them by hand (`--doc` regenerates this
file from the results alone).

How it is measured (`npu_shim.testing.census`): vLLM's own tower class at the lane's release,
from a tiny random config (3 layers, so upstream reads `cu_seqlens` back once per layer), run
on CPU with npu-shim's emulated torch_npu ops. The tower's parameters and inputs stand in for
device tensors (`npu_shim.testing.count_host_syncs`), and placement is followed from there; each
tower gets its grid where vLLM's multimodal field config puts it. Two forwards over different
grids, in `torch.inference_mode()`, the hardware dtype of the device class (A2: bfloat16, 310P:
float16). Upstream is vllm-ascend's untouched `AscendMMEncoderAttention` (310P: its 310P class)
with vLLM's tower code; the shim side has every patch that applies. A forward is `ok` when the
shim's output is `torch.equal` to upstream's and within the census test's tolerance (relative to
max |reference|) of a float64 copy of the tower (attention from its definition,
`npu_shim.testing.attention_f64`) and of vLLM's TORCH_SDPA tower.

The four towers with their own patches and benchmarks (Qwen2.5-VL, Qwen3-VL, Kimi-VL,
GLM-4.1V: 0 reads per forward) are in `benchmarks/results/towers-*.txt`.

Checked on a real GPU: the same forwards on CUDA, counted by CUDA itself
(`benchmarks/bench_cuda_syncs.py`, its run in `benchmarks/results/cuda-syncs.txt`), give the
counts below (reads plus blocking copies) for every tower, except one sync per
`repeat_interleave` with device repeats, which CUDA makes twice and the counter counts once
(dots.ocr, Ernie4.5-VL: docs/validation.md, "Checked on a real GPU"). The counter was corrected where that
run found it undercounting (dots.ocr, Ernie4.5-VL, Keye-VL), and these figures are its recount.
"""

READ_NOT_MEASURED = """\
## Read in the wheels, not measured

Other `MMEncoderAttention` users in vLLM 0.26.0 and 0.30.0, by where their `cu_seqlens` comes
from (read, not run):

- Through `maybe_recompute_cu_seqlens` (served by `vllm.mm_encoder_host_lengths`): Qwen2.5-VL's
  class (also Qwen2.5-Omni's thinker), EXAONE-4.5 (subclasses it), Kimi-K2.5's ViT; in 0.30.0 also
  `cohere_compass.py`, `muse_glimmer.py`, `pixtral.py`, `ultravox.py`.
- Built on the device from the grid or sizes (no host record to use): Isaac, Siglip2-NaViT,
  MiMo-V2-Omni's vision tower, openPangu-VL (plus `.item()` for windows), LFM2's Siglip2.
- Audio encoders, out of scope: FunASR, Fun-Audio-Chat, Qwen3-Omni's audio tower.

vLLM 0.33.0 (the probe) against 0.30.0: one more `MMEncoderAttention` user, MuseSpark's NaViT
(`vllm/models/muse_spark/common/vision.py`, measured above); `lilicorr.py` names the class only in
a comment (its lattice attention does not use it); every other file that names it is one of
0.30.0's (GLM-5-Next's multimodal module moved from `models/glm5next/nvidia/` to `common/`), and
where their `cu_seqlens` comes from was not re-read for 0.33.0.
"""


PROBE_NOTE = """\
A probe, not a lane: vLLM %(vllm)s with vllm-ascend %(ascend)s's attention, a pairing no release
makes (vllm-ascend %(ascend)s pairs with another vLLM; no vllm-ascend release pairs with vLLM
%(vllm)s yet). Upstream is vllm-ascend %(ascend)s's untouched class over vLLM %(vllm)s's towers;
the shim side has every patch that applies in that venv. Other releases in the venv: %(versions)s.
No CI lane runs this; to reproduce it from a checkout (the first command makes `.nox/probe`
and prints which family of each patch applies there):

    %(venv)s
    %(census)s
"""


def _version_key(text):
    """"0.30.0" -> (0, 30, 0): releases in order (0.100 after 0.33)."""
    return tuple(int(part) if part.isdigit() else 0 for part in text.split("+")[0].split("."))


def _table(out, result):
    """One result's section: its title, when and where it ran, its table."""
    release = result["release"]
    probe = result.get("probe")
    if probe:
        out.append("## Probe: vLLM %s over vllm-ascend %s (no release pair; `%s`)\n" % (
            release["vllm"], release["vllm-ascend"], result["lane"]))
        out.append(PROBE_NOTE % {"vllm": release["vllm"], "ascend": release["vllm-ascend"],
                                 "versions": ", ".join("%s %s" % kv for kv in sorted(probe["versions"].items())),
                                 "venv": probe["venv"], "census": probe["census"]})
    else:
        out.append("## vLLM %s + vllm-ascend %s (lane `%s`)\n" % (
            release["vllm"], release["vllm-ascend"], result["lane"]))
    out.append("Ran %s on %s, at commit %s.\n" % (result["ran"], result["machine"], result["commit"]))
    if probe and probe.get("patches"):
        out.append("What each patch does in the probe's venv (`npu-shim status --import`, asked by the run "
                   "after it measured; a patch skipped here is a fix this pairing would not get):\n")
        out.append("| patch | state (family) | reason |")
        out.append("|---|---|---|")
        for row in probe["patches"]:
            out.append("| `%s` | %s | %s |" % (row["name"], row["state"] + (" (`%s`)" % row["family"] if row.get("family")
                                                                          else ""), row["reason"] or "-"))
        out.append("")
    out.append("| tower (vLLM class) | device class | forward 0 | forward 1 | blocking H2D | ok | "
                "error vs float64 (worst) | the shim's reads, by site (forward 0) |")
    out.append("|---|---|---|---|---|---|---|---|")
    for row in result["rows"]:
        if row.get("absent"):
            out.append("| %s (`%s`) | %s | not in this release | | | | | |"
                       % (row["tower"], row["class"], row["device_class"]))
            continue
        f = row["forwards"]
        sites = "; ".join("`%s` x%d" % kv for kv in f[0]["shim_sites"].items()) or "none"
        out.append("| %s (`%s`) | %s | %d -> %d | %d -> %d | %d -> %d | %s | %.1e (tol %.0e, %s) | %s |" % (
            row["tower"], row["class"], row["device_class"], f[0]["upstream"], f[0]["shim"],
            f[1]["upstream"], f[1]["shim"], max(x["upstream_h2d"] for x in f),
            max(x["shim_h2d"] for x in f), "yes" if all(x["ok"] for x in f) else "**no**",
            max(x["err_vs_float64"] for x in f), f[0]["tolerance"], f[0]["dtype"], sites))
    out.append("")


def render(results):
    from npu_shim.testing import census

    out = [INTRO]
    key = lambda r: _version_key(r["release"]["vllm"])  # noqa: E731
    for result in sorted((r for r in results if not r.get("probe")), key=key):
        _table(out, result)
    for result in sorted((r for r in results if r.get("probe")), key=key):
        _table(out, result)
    out.append("## What remains, and why\n")
    for name in census.CENSUS:
        out.append("- **%s**: %s" % (name, WHY.get(name, "(no note)")))
    out.append("")
    if census.NOT_MEASURED:
        out.append("## Not measured\n")
        for name, why in census.NOT_MEASURED.items():
            out.append("- **%s**: %s." % (name, why))
        out.append("")
    out.append(READ_NOT_MEASURED)
    return "\n".join(out)


def write_doc():
    results = []
    for path in sorted(glob.glob(os.path.join(RESULTS, "census-*.json"))):
        with open(path) as handle:
            results.append(json.load(handle))
    with open(DOC, "w") as handle:
        handle.write(render(results))
    return DOC


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--lane", help="write benchmarks/results/census-LANE.json and docs/towers.md")
    parser.add_argument("--device-class", action="append", choices=("A2", "310P"))
    parser.add_argument("--doc", action="store_true", help="only regenerate docs/towers.md from the results")
    parser.add_argument("--probe", metavar="COMMAND",
                        help="this venv is a probe's, made by COMMAND (nox -s probe -- ...): the result is "
                             "marked as a probe and docs/towers.md prints it in its own section")
    args = parser.parse_args(sys.argv[1:] if argv is None else argv)
    if args.doc:
        print("wrote %s" % write_doc())
        return 0
    if args.probe and not (args.lane or "").startswith("probe-"):
        parser.error("--probe needs --lane probe-<name> (a probe's results are named apart from the lanes')")
    release, rows = measure(args.device_class or ["A2"])
    print_table(release, rows)
    if args.lane:
        probe = None
        if args.probe:
            import shlex
            from importlib.metadata import version

            # the probe's venv is always .nox/probe (noxfile.py, probe())
            census = shlex.join([os.path.join(".nox", "probe", "bin", "python"), "benchmarks/bench_census.py",
                                 *(sys.argv[1:] if argv is None else argv)])
            probe = {"venv": args.probe, "census": census, "patches": patch_states(),
                     "versions": {dist: version(dist) for dist in ("torch", "transformers", "tokenizers")}}
        print("wrote %s" % write_result(args.lane, release, rows, probe))
        print("wrote %s" % write_doc())
    failed = [r["tower"] for r in rows if not r.get("absent") and not all(f["ok"] for f in r["forwards"])]
    if failed:
        print("not ok: %s" % ", ".join(failed), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
