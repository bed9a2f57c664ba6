"""sglang.cp_npu_refuse — refuse NPU prefill context parallelism at start-up where it cannot run.

Why: from sglang 0.5.20 the older CP helpers in ``sglang.srt.layers.utils.cp_utils``
  are stubs that raise ``ValueError("Prefill CP on HIP/NPU/MUSA is deprecated ...")``;
  the Ascend backend's ``_cp_allgather_and_save_kv_npu`` still calls one of them
  (``cp_all_gather_rerange_kv_cache``), so NPU prefill CP fails at the first CP
  prefill of a started server, for every length. 0.5.20 also refused NPU prefill CP
  in ``validate_prefill_cp_platform`` (a server-argument check that runs before the
  model is resolved); 0.5.21 dropped NPU from that check (HIP/MUSA only) and 0.5.22
  checks MUSA only, while the NPU gather stayed a stub.
How: wrap ``sglang.srt.arg_groups.parallel_hook.validate_prefill_cp_platform``:
  upstream's check runs first, unchanged; then, when ``--enable-prefill-cp`` is on
  and sglang's platform is NPU, raise one ``ValueError`` saying what is wrong, that
  sglang 0.5.23 has a working NPU CP path, and which setting avoids it. Both of
  sglang's call sites (the resolution pipeline and ``handle_context_parallelism``)
  look the function up on the module at call time, and ``run_hook`` finds plugin
  overrides by the function's ``__name__``, which the wrapper keeps.
  Not a port of the strategy's gather: 0.5.20-0.5.22's Ascend backend would need its
  KV gather, its metadata use and its FIA call rebuilt around the CP-v2 strategy --
  that is 0.5.23's rewrite, not a small patch.
Upstream fix: 0.5.23 runs NPU CP through ``ZigzagCPStrategy`` (its own gather).
Remove when: no pinned sglang is in 0.5.21-0.5.22 (the window; 0.5.20 refuses by itself).
"""
from npu_shim.patch import Defect, Family, NotNeeded, Patch, Selftest, TargetMismatch

TARGET = "sglang.srt.arg_groups.parallel_hook"
CHECK = "validate_prefill_cp_platform"
CP_UTILS = "sglang.srt.layers.utils.cp_utils"
STUB = "_deprecated_platform_cp"
ALREADY_REFUSED = "upstream already refuses NPU prefill CP at start-up"

MESSAGE = (
    "sglang %s cannot run prefill context parallelism on Ascend NPU: its NPU KV gather "
    "(sglang.srt.layers.utils.cp_utils.cp_all_gather_rerange_kv_cache) is a stub that raises "
    "at the first CP prefill. sglang %s (where this patch's window ends) has a working NPU CP path; "
    "upgrade to it, or start without --enable-prefill-cp (refused by npu-shim's sglang.cp_npu_refuse)."
)


def window_end():
    """The release where the patch's window ends (its ``<`` bound): the first with a working
    NPU CP path."""
    from packaging.specifiers import SpecifierSet

    return next(spec.version for spec in SpecifierSet(PATCH.requires["sglang"]) if spec.operator == "<")


def check(module, context) -> None:
    import importlib

    from npu_shim.patches._shared.code import code_names

    cp_utils = importlib.import_module(CP_UTILS)
    gather = getattr(cp_utils, "cp_all_gather_rerange_kv_cache", None)
    if gather is None or STUB not in code_names(gather):
        raise TargetMismatch("%s.cp_all_gather_rerange_kv_cache is not the %s stub" % (CP_UTILS, STUB))
    validate = getattr(module, CHECK, None)
    if validate is None:
        raise TargetMismatch("%s.%s not found" % (TARGET, CHECK))
    names = code_names(validate)
    if "is_npu" in names:
        raise NotNeeded(ALREADY_REFUSED)
    missing = {"enable_prefill_cp", "get_platform", "resolving_view"} - names
    if missing:
        raise TargetMismatch("%s does not read %s" % (CHECK, ", ".join(sorted(missing))))
    for helper in ("get_platform", "resolving_view"):
        if not callable(getattr(module, helper, None)):
            raise TargetMismatch("%s.%s not found" % (TARGET, helper))


def make_validate(module, upstream, context):

    def validate_prefill_cp_platform(server_args):
        upstream(server_args)
        context.count("calls")
        if module.resolving_view(server_args).enable_prefill_cp and module.get_platform().is_npu:
            from importlib.metadata import version

            raise ValueError(MESSAGE % (version("sglang"), window_end()))

    # upstream's __name__ kept: run_hook keys on it
    return context.present(validate_prefill_cp_platform, upstream,
                           "upstream's check, then NPU prefill CP refused (its KV gather is a stub)")


def build(module, context):
    return {CHECK: make_validate(module, getattr(module, CHECK), context)}


PATCH = Patch(
    name="sglang.cp_npu_refuse",
    target=TARGET,
    replaces=(CHECK,),
    # The release below the window has the same stub gather, but its own start-up check refuses
    # NPU prefill CP (check() says so too, by structure): no family claims it.
    requires={"sglang": ">=0.5.21,<0.5.23"},
    outside_window={"sglang": "the NPU KV gather is a stub only from the release below the window to the "
                              "window's end, and in that first release " + ALREADY_REFUSED},
    families=(Family(__name__, id="platform-validation", keeps="upstream's validate_prefill_cp_platform for every other case"),),
    summary="refuse --enable-prefill-cp on NPU at start-up (the NPU KV gather is a stub)",
    # None: argument resolution touches no tensor.
    selftest=Selftest("npu_shim.selftest.sglang_cp_npu_refuse", host_syncs=0),
    defect=Defect("sglang starts NPU prefill context parallelism where it cannot run",
                  shows="raises", says="was not refused", fixed_at="sglang"),
)
