"""sglang.npu_kv_cpu_copy_v_head_dim — the NPU MHA pool's CPU offload copies view V with its own head dim.

Why: ``NPUMHATokenToKVPool.get_cpu_copy`` and ``load_cpu_copy`` (0.5.14 on) view each layer's
  V buffer as ``(-1, head_num, head_dim)``, K's head dim. In a pool whose V is narrower
  (``v_head_dim`` 128 with K 192: MiMo-V2-Flash, once ``sglang.npu_mha_v_head_dim`` builds the
  pool right) that view has the wrong rows: the copy takes and restores the wrong tokens' V,
  silently, or fails where the buffer does not divide.
How: upstream's two methods, edited
  (:class:`~npu_shim.patches._shared.source_edit.ReplaceExpression`): the V view takes
  ``self.v_head_dim``. A pool whose V head dim equals K's runs upstream's methods, unedited.
Upstream fix: none released (sglang PR #39058, closed unmerged, passed v_head_dim to the pool
  only).
Remove when: the pinned sglang views V with ``v_head_dim`` there.
"""
from npu_shim.patch import Defect, Family, NotNeeded, Patch, Selftest
from npu_shim.patches._shared.source_edit import ReplaceExpression, edit_function
from npu_shim.patches._shared.structure import Edited, edit_of, module_class, own_function, replace_own

TARGET = "sglang.srt.hardware_backend.npu.memory_pool_npu"
POOL = "NPUMHATokenToKVPool"
METHODS = ("get_cpu_copy", "load_cpu_copy")
K_WIDE_V = "self.v_buffer[local_layer_id].view(-1, self.head_num, self.head_dim)"
V_VIEW = ReplaceExpression(K_WIDE_V, "self.v_buffer[local_layer_id].view(-1, self.head_num, self.v_head_dim)")
KEEPS = "upstream's chunked device<->host copies, V viewed with v_head_dim"


class CpuCopies:
    """The two methods view V as ``(-1, head_num, head_dim)`` once each."""

    def check(self, module, context):
        cls = module_class(module, POOL)
        found = {}
        for name in METHODS:
            function = own_function(cls, name)
            if "v_head_dim" in function.__code__.co_names:
                raise NotNeeded("%s.%s reads v_head_dim" % (POOL, name))
            found["%s.%s" % (POOL, name)] = Edited(function, edit_function(function, (V_VIEW,)))
        return found

    def build(self, module, context):
        return {"%s.%s" % (POOL, name): replace_own(module, POOL, name, self.make, context,
                                                    "V viewed with the pool's v_head_dim")
                for name in METHODS}

    def make(self, module, original, context):
        edited = edit_of(context, "%s.%s" % (POOL, original.__name__))

        def method(self, *args, **kwargs):
            if self.v_head_dim == self.head_dim:
                context.count("upstream_calls")
                return original(self, *args, **kwargs)
            context.count("calls")
            return edited(self, *args, **kwargs)

        return method


CPU_COPIES = CpuCopies()

PATCH = Patch(
    name="sglang.npu_kv_cpu_copy_v_head_dim",
    target=TARGET,
    replaces=tuple("%s.%s" % (POOL, name) for name in METHODS),
    requires={"sglang": ""},
    outside_window={"sglang": "below the window NPUMHATokenToKVPool has no CPU copies of its own (and one "
                              "head dim for K and V)"},
    needs_npu=True,
    families=(Family(__name__ + ":CPU_COPIES", fence=">=0.5.14", keeps=KEEPS),),
    summary="the NPU MHA pool's get_cpu_copy/load_cpu_copy view V with the pool's v_head_dim",
    selftest=Selftest("npu_shim.selftest.sglang_v_head_dim:run", host_syncs=4,
                      arguments={"round_trip": "cpu_copy"}),
    defect=Defect("sglang's NPU MHA pool's CPU offload copies view V with K's head dim",
                  shows="raises", says="read back (4, 2, 192), wrote (4, 2, 128)"),
)
