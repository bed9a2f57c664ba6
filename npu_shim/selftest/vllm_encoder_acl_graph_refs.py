"""Selftest of ``vllm.encoder_acl_graph_refs``: vllm-ascend's encoder ACL-graph capture, patched.

Upstream's ``EncoderAclGraphManager.capture`` (as the shim edits it) captures two token budgets of
a toy encoder (:mod:`npu_shim.testing.encoder_graph`: it doubles its float32 input and registers
an FIA workspace as vllm-ascend's capture-time attention does); the capture's locals are then
collected and each budget's graph replayed. What the replay writes into (the output buffer, the
workspace) must still be owned: a released one raises the 507011 error
(:func:`npu_shim.testing.encoder_graph.replay`, vllm-ascend PR #16794), which fails the selftest.
The output buffer read after replay is compared with a float64 reference written from the toy's
definition (twice the input): a doubling of small integers in float32, so the tolerance is 0.
Capture and replay must read nothing back.

Off the device the graph is a stand-in that captures nothing (the capture runs eagerly): what is
checked there is that the metadata owns the buffers. On an NPU machine the real ``torch.npu``
graph captures the toy forward; that path has not been run in this project (no NPU here).
"""
import time

PATCH_NAME = "vllm.encoder_acl_graph_refs"
BUDGETS = (8, 16)
TOLERANCE = 0.0


def run(device=None):
    import npu_shim
    from npu_shim.selftest import applied_target
    from npu_shim.testing import count_host_syncs, encoder_graph

    device = device or "cpu"
    module = applied_target(PATCH_NAME)
    family = next(r for r in npu_shim.status() if r["name"] == PATCH_NAME)["family"]
    started = time.perf_counter()
    with encoder_graph.graph_stand_in() as stand_in, encoder_graph.npu_weak_refs(device), \
            count_host_syncs(cpu_is_device=device == "cpu") as syncs:
        manager, model = encoder_graph.capture(module, BUDGETS, device)
        outputs = {budget: encoder_graph.replay(module, manager, budget) for budget in BUDGETS}
        if device != "cpu":
            import torch

            torch.npu.synchronize()
    seconds = time.perf_counter() - started
    err = max((outputs[budget].double().cpu() - 2 * model.inputs[budget].double().cpu()).abs().max().item()
              for budget in BUDGETS)
    return {
        "max_abs_err": err,
        "tolerance": TOLERANCE,
        "host_syncs": syncs.count,
        "seconds": seconds,
        "detail": "vllm-ascend's encoder graph capture of budgets %s on %s%s, replayed after the capture's "
                  "locals went: output buffer and FIA workspaces owned; family %s"
                  % (", ".join(map(str, BUDGETS)), device, " (graph stand-in)" if stand_in else "", family),
    }
