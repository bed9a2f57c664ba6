"""The emulated Ascend device (npu_shim.emulation.device): ``npu`` as a device type, as upstream code
uses it unedited, and its device->host transfer counter.

PyTorch renames its PrivateUse1 backend once per process and every other test file of the lane
relies on ``torch.npu.is_available() == False`` (plain ``NPU_SHIM_EMULATE=1``), so these cases run
in a child pytest with the documented switch ``NPU_SHIM_EMULATE_DEVICE=1``: in the lane's process
``test_in_own_process`` starts it and checks every case passed; in the child the cases run.
"""
import os
import re
import subprocess
import sys

import pytest

CHILD = os.environ.get("NPU_SHIM_EMULATE_DEVICE") == "1"
child_only = pytest.mark.usefixtures()  # the cases are collected in the child only (end of file)


def test_in_own_process():
    if CHILD:
        pytest.skip("this is the child")
    env = dict(os.environ, NPU_SHIM_EMULATE="1", NPU_SHIM_EMULATE_DEVICE="1")
    flags = ["-P"] if getattr(sys.flags, "safe_path", False) else []   # -P: Python 3.11 on
    proc = subprocess.run([sys.executable, *flags, "-m", "pytest", "-q", "-p", "no:cacheprovider", __file__],
                          env=env, capture_output=True, text=True, timeout=600)
    tail = proc.stdout[-4000:] + proc.stderr[-2000:]
    assert proc.returncode == 0, tail
    assert re.search(r"\b%d passed" % CASES, proc.stdout), tail


if CHILD:
    import torch

    from npu_shim import emulation

    emulation.install()
    import torch_npu  # noqa: F401  (the emulated one: it activates the device)
    from npu_shim.emulation import device as D


@child_only
def test_allocation_and_moves_stay_on_npu():
    assert torch.npu.is_available() and torch.npu.device_count() == 1
    dev = torch.device("npu", 0)
    made = [torch.empty(2, 3, device="npu"), torch.zeros(4, device=dev), torch.arange(5, device="npu:0"),
            torch.tensor([1, 2], device="npu"), torch.randn(3, 4).npu(), torch.randn(3, 4).to("npu:0"),
            torch.ones(2, device="npu").to(torch.float16)]
    for t in made:
        assert t.device == dev, t
    a, b = made[4], made[5]
    for t in (a + b, a @ b.t(), torch.softmax(a, -1), a.t().contiguous(), a[1:], a.sum(0)):
        assert t.device == dev and isinstance(t, D.NpuTensor)
    torch.testing.assert_close((a @ b.t()).cpu(), a.cpu() @ b.cpu().t(), rtol=0, atol=0)
    layer = torch.nn.Linear(4, 4).npu()
    assert layer.weight.device == dev and layer(a).device == dev
    y = a.clone()
    assert y.add_(1) is y and y.device == dev
    x = torch.randn(3, device="npu", requires_grad=True)
    (x * x).sum().backward()
    assert x.grad.device == dev
    torch.testing.assert_close(x.grad.cpu(), 2 * x.detach().cpu())


@child_only
def test_streams_events_sync():
    s = torch.npu.Stream()
    e = torch.npu.Event()
    with torch.npu.stream(s):
        t = torch.ones(2, device="npu") * 3
    context = torch.npu.stream(s)  # made once, entered per batch (sglang's scheduler)
    for _ in range(2):
        with context as current:
            assert current is s
    e.record(s)
    torch.npu.current_stream().wait_event(e)
    e.wait()
    assert e.query() and s.query()
    torch.npu.synchronize()
    torch.npu.current_stream().synchronize()
    assert t.cpu().tolist() == [3.0, 3.0]


@child_only
def test_memory_answers():
    torch.npu.set_device(0)
    torch.npu.set_device("npu:0")
    assert torch.npu.current_device() == 0
    assert torch.npu.get_device_name(0).startswith("Ascend")
    free, total = torch.npu.mem_get_info()
    assert total == int(float(os.environ.get(D.MEMORY_ENV, D.DEFAULT_MEMORY_MIB)) * 2 ** 20)
    torch.npu.empty_cache()
    torch.npu.reset_peak_memory_stats()
    before = torch.npu.memory_allocated()
    t = torch.empty(1024, 1024, device="npu")  # 4 MiB
    assert torch.npu.memory_allocated() - before == 4 * 2 ** 20
    assert torch.npu.mem_get_info()[0] == free - 4 * 2 ** 20
    del t
    assert torch.npu.memory_allocated() == before
    assert torch.npu.max_memory_allocated() == before + 4 * 2 ** 20
    with pytest.raises(RuntimeError, match="invalid device"):
        torch.npu.set_device(1)
    with pytest.raises(torch.OutOfMemoryError, match=D.MEMORY_ENV):
        torch.empty(total // 2 + 8, dtype=torch.int16, device="npu")


@child_only
def test_hccl_opens_a_one_rank_gloo_group(tmp_path):
    import torch.distributed as dist

    dist.init_process_group("hccl", init_method="file://%s" % (tmp_path / "store"), rank=0, world_size=1)
    try:
        assert dist.get_backend() == "hccl" and dist.get_world_size() == 1
        dist.barrier()
        t = torch.ones(3)
        dist.all_reduce(t)
        assert t.tolist() == [1.0, 1.0, 1.0]
        # torch_npu's communicator name, as vllm-ascend's MoE dispatchers ask it: "" before the
        # communicator is initialised with init_comm=False, then a name, one per group
        world = dist.group.WORLD._get_backend(torch.device("npu"))
        assert world.get_hccl_comm_name(0, init_comm=False) == ""
        name = world.get_hccl_comm_name(0)
        assert name and world.get_hccl_comm_name(0, init_comm=False) == name
        other = dist.new_group([0])._get_backend(torch.device("npu")).get_hccl_comm_name(0)
        assert other and other != name
        with pytest.raises(TypeError, match="rankid"):
            world.get_hccl_comm_name("0")
    finally:
        dist.destroy_process_group()


def _kinds(block):
    with D.count_transfers() as counter:
        block()
    return counter.by_kind()


@child_only
def test_transfer_counter_per_kind():
    t = torch.tensor([3.0, -1.0, 2.0, 0.0], device="npu")
    reps = torch.tensor([1, 2, 0, 1], device="npu")
    cases = {
        "item": lambda: t.sum().item(), "tolist": lambda: t.tolist(), "cpu": lambda: t.cpu(),
        "to": lambda: t.to("cpu"), "bool": lambda: bool(t[0] > 0), "int": lambda: int(t[0]),
        "float": lambda: float(t[0]), "nonzero": lambda: t.nonzero(), "masked_select": lambda: t.masked_select(t > 0),
        "unique": lambda: torch.unique(t), "repeat_interleave": lambda: torch.repeat_interleave(t, reps),
        "getitem": lambda: t[t > 0], "equal": lambda: torch.equal(t, t),
    }
    for kind, block in cases.items():
        assert _kinds(block) == {kind: 1}, kind
    # non-blocking is still a read the host waits for before it uses the values
    assert _kinds(lambda: t.to("cpu", non_blocking=True)) == {"to": 1}
    host = torch.empty(4)
    assert _kinds(lambda: host.copy_(t)) == {"copy_": 1}


@child_only
def test_transfer_counter_zero_on_device_work():
    t = torch.randn(8, 4, device="npu")
    reps = torch.tensor([1, 2, 0, 1, 1, 1, 1, 1], device="npu")
    host = torch.randn(8, 8)

    def device_only():
        u = (t @ t.t()).softmax(-1)
        u = u + host.npu()  # host -> device: not a read
        torch.repeat_interleave(t, reps, dim=0, output_size=8)
        u[torch.arange(3)] = 0  # a host index goes to the device
        torch.where(u > 0, u, 0).sum(-1).to(torch.float16)

    assert _kinds(device_only) == {}


@child_only
def test_unsupported_op_and_mixed_devices_name_the_op():
    t = torch.randn(2, 8, 4, 16, device="npu", dtype=torch.float16)
    with pytest.raises(NotImplementedError, match="_efficient_attention_forward"):
        torch.ops.aten._efficient_attention_forward(t, t, t, None, None, None, None, None, 0.0, 0, False)
    with pytest.raises(RuntimeError, match=r"aten\.add\.Tensor .*npu:0.*cpu"):
        torch.randn(3, device="npu") + torch.randn(3)
    with pytest.raises(TypeError, match="npu:0 device type tensor to numpy"):
        torch.randn(3, device="npu").numpy()


@child_only
def test_emulated_attention_on_npu_tensors_against_float64():
    from npu_shim.testing import attention_f64, dense_segments

    lengths = [5, 33, 1, 8]
    cu = dense_segments(lengths)
    g = torch.Generator().manual_seed(3)
    q, k, v = (torch.randn(cu[-1], 4, 64, generator=g).to(torch.float16) for _ in range(3))
    want = attention_f64(q, k, v, cu, scale=0.125)
    qn, kn, vn = q.npu(), k.npu(), v.npu()
    with D.count_transfers() as counter:
        out = torch_npu.npu_fusion_attention(qn, kn, vn, 4, "TND", scale=0.125,
                                             actual_seq_qlen=cu[1:], actual_seq_kvlen=cu[1:])[0]
    assert out.device == torch.device("npu", 0) and counter.count == 0
    torch.testing.assert_close(out.cpu().double(), want, atol=2e-3, rtol=0)
    # host-only arguments keep their documented behaviour: a device tensor there is one read each
    cun = torch.tensor(cu[1:], device="npu")
    with D.count_transfers() as counter:
        out2 = torch_npu.npu_fusion_attention(qn, kn, vn, 4, "TND", scale=0.125,
                                              actual_seq_qlen=cun, actual_seq_kvlen=cun)[0]
    assert counter.by_kind() == {"host_arg": 2}
    torch.testing.assert_close(out2.cpu(), out.cpu(), atol=0, rtol=0)


@child_only
def test_seed_profiler_patches_and_ipc_as_sglang_uses_them():
    # torch.manual_seed seeds every custom device too (torch.random._seed_custom_device calls
    # torch.npu.manual_seed): with the device active that must not recurse (it did, without end).
    torch.manual_seed(7)
    first = torch.randn(4, device="npu").cpu()
    torch.npu.manual_seed(7)
    assert torch.equal(torch.randn(4, device="npu").cpu(), first)
    # torch_npu._apply_patches: each [dotted name under torch, value] is set on torch (sglang's
    # profile_utils swaps in torch_npu's profiler at import); a name torch lacks is refused by name.
    import torch.profiler as torch_profiler

    saved = torch_profiler.profile
    try:
        torch_npu._apply_patches([["profiler.profile", torch_npu.profiler.profile],
                                  ["profiler.ProfilerActivity.CPU", torch_npu.profiler.ProfilerActivity.CPU]])
        assert torch_profiler.profile is torch_npu.profiler.profile
        assert torch_npu.profiler.ProfilerActivity.NPU == torch_profiler.ProfilerActivity.CPU
    finally:
        torch_profiler.profile = saved
    with pytest.raises(AttributeError, match="no_such_module"):
        torch_npu._apply_patches([["no_such_module.f", None]])
    # sharing a device tensor between processes is refused by name, not faked
    from torch_npu.multiprocessing import reductions

    with pytest.raises(NotImplementedError, match="rebuild_npu_tensor"):
        reductions.rebuild_npu_tensor()


TRANSFER_TO_NPU = """
import torch, torch_npu
import torch.distributed as dist
stream = torch.npu.current_stream()
with torch.npu.StreamContext(stream) as entered:
    assert entered is stream
torch_npu.npu.set_compile_mode(jit_compile=False)
assert torch_npu.npu.is_jit_compile_false()
from torch_npu.contrib import transfer_to_npu  # noqa: F401
assert torch.cuda.is_available is torch.npu.is_available and torch.cuda.synchronize is torch.npu.synchronize
assert torch.zeros(2, device="cuda").device.type == "npu"
assert torch.arange(3, device=torch.device("cuda", 0)).device == torch.device("npu", 0)
assert torch.ones(2).cuda().device.type == "npu" and torch.ones(2).to("cuda:0").device.type == "npu"
assert torch.nn.Linear(2, 2).cuda().weight.device.type == "npu"
with torch.device("npu"):  # the device context still places the (now wrapped) factories
    assert torch.empty(1).device.type == "npu" and torch.nn.Linear(2, 2).weight.device.type == "npu"
assert torch.jit.script(len) is len
dist.init_process_group("nccl", init_method="tcp://127.0.0.1:%d" % PORT, rank=0, world_size=1)
assert dist.get_backend() == "hccl"
dist.destroy_process_group()
storage = torch.zeros(6, device="npu").untyped_storage()
assert storage.nbytes() == 24 and storage.device.type == "npu"
try:
    storage.resize_(0)
except NotImplementedError as exc:
    assert "resize_" in str(exc)
else:
    raise AssertionError("resize_ of an emulated device storage was not refused")
print("TRANSFER_TO_NPU OK")
"""


def test_transfer_to_npu_and_what_sglang_start_up_asks():
    # transfer_to_npu rewrites torch for the rest of its process: its own child
    import socket

    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = probe.getsockname()[1]
    proc = subprocess.run([sys.executable, "-c", TRANSFER_TO_NPU.replace("PORT", str(port))],
                          env=dict(os.environ), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0 and "TRANSFER_TO_NPU OK" in proc.stdout, proc.stdout[-2000:] + proc.stderr[-3000:]


@child_only
def test_names_vllm_ascend_reads_as_its_worker_uses_them():
    # vllm-ascend's patch_torch_accelerator points torch.accelerator at these; vLLM's memory
    # profiling reads "allocated_bytes.all.peak" (vllm.utils.mem_utils, vllm_ascend.worker.worker).
    torch.npu.reset_peak_memory_stats()
    before = torch.npu.memory_stats()
    t = torch.empty(256, 1024, device="npu")  # 1 MiB
    stats = torch.npu.memory_stats()
    assert stats["allocated_bytes.all.current"] - before["allocated_bytes.all.current"] == 2 ** 20
    assert stats["allocated_bytes.all.peak"] == torch.npu.max_memory_allocated()
    assert stats["reserved_bytes.all.current"] == torch.npu.memory_reserved()
    del t
    assert torch.npu.memory_stats()["allocated_bytes.all.current"] == before["allocated_bytes.all.current"]
    assert torch.npu.memory.memory_stats is torch.npu.memory_stats
    # torch_npu adds torch.distributed.is_hccl_available; hccl is the one-rank gloo group above
    import torch.distributed as dist

    assert dist.is_hccl_available() is True
    # import-only names: building one refuses by name (never a silent stand-in)
    from npu_shim.emulation.placeholders import ImportPlaceholderError
    from torch_npu._C._distributed_c10d import ProcessGroupHCCL

    for cls, name in ((ProcessGroupHCCL, "ProcessGroupHCCL"),
                      (torch.npu.memory.NPUPluggableAllocator, "NPUPluggableAllocator")):
        with pytest.raises(ImportPlaceholderError, match=name):
            cls()
    # its Options are real: hccl_config kept as set, and a group opened with them (one-rank gloo)
    options = ProcessGroupHCCL.Options()
    assert options.hccl_config == {} and options.is_high_priority_stream is False
    options.hccl_config = {"hccl_buffer_size": 200}
    assert options.hccl_config == {"hccl_buffer_size": 200}
    from torch_npu.op_plugin.atb._atb_ops import _register_atb_extensions
    from torch_npu.profiler import dynamic_profile

    _register_atb_extensions()
    assert not hasattr(torch.ops.atb, "npu_no_such_atb_op")  # no ATB op is registered
    with pytest.raises(RuntimeError, match="dynamic_profile.step"):
        dynamic_profile.step()


@child_only
def test_pinned_host_memory_and_host_likes_of_device_tensors():
    # engines allocate host staging buffers pinned (vLLM's runners): plain host memory here
    for make in (lambda: torch.empty(4, pin_memory=True), lambda: torch.zeros(2, 3, pin_memory=True),
                 lambda: torch.empty_strided((2, 3), (3, 1), pin_memory=True),
                 lambda: torch.arange(5.0).pin_memory()):
        t = make()
        assert t.device.type == "cpu" and not isinstance(t, D.NpuTensor)
    assert torch.arange(5.0).pin_memory().tolist() == [0.0, 1.0, 2.0, 3.0, 4.0]
    # an op asked for the host makes a host tensor (vllm-ascend: empty_like(output, device="cpu",
    # pin_memory=True)); it reads no device data, so it is no transfer
    x = torch.ones(3, device="npu")
    with D.count_transfers() as counter:
        for t in (torch.empty_like(x, device="cpu"), torch.zeros_like(x, device="cpu"),
                  x.new_empty(2, device="cpu"), torch.empty_like(x, device="cpu", pin_memory=True)):
            assert t.device.type == "cpu" and not isinstance(t, D.NpuTensor), t.device
        assert torch.empty_like(x).device.type == "npu" and x.new_empty(2).device.type == "npu"
    assert counter.count == 0


if CHILD:
    class _LoaderParameter(torch.nn.Parameter):
        """A Parameter subclass shaped as vLLM's ``BasevLLMParameter``: its own ``__new__`` through
        Parameter's, an ``__init__`` storing a weight loader, a property, a method writing a shard
        into ``self.data``, and its own ``__torch_function__``."""

        def __new__(cls, data, **kwargs):
            return super().__new__(cls, data=data, requires_grad=False)

        def __init__(self, data, weight_loader, output_dim):
            self._weight_loader = weight_loader
            self._output_dim = output_dim

        @property
        def weight_loader(self):
            return self._weight_loader

        def load_shard(self, loaded, offset):
            shard = self.data.narrow(self._output_dim, offset, loaded.shape[self._output_dim])
            shard.copy_(loaded)

        @classmethod
        def __torch_function__(cls, func, types, args=(), kwargs=None):
            return super().__torch_function__(func, types, args, kwargs or {})

    class _Child(_LoaderParameter):
        pass


@child_only
def test_parameter_subclasses_on_the_device():
    # vLLM's linear layers make BasevLLMParameter subclasses of device tensors; PyTorch's path for
    # tensor subclasses returned the device tensor itself (its class, no __init__, no loader)
    loader = object()
    p = _LoaderParameter(torch.empty(4, 3, device="npu"), weight_loader=loader, output_dim=0)
    assert isinstance(p, _LoaderParameter) and isinstance(p, torch.nn.Parameter) and isinstance(p, D.NpuTensor)
    assert p.device == torch.device("npu", 0) and not p.requires_grad and p.weight_loader is loader
    assert type(p) is D.parameter_class(_LoaderParameter) and type(p).__name__ == "_LoaderParameter"
    c = _Child(torch.zeros(2, device="npu"), weight_loader=loader, output_dim=0)
    assert isinstance(c, _Child) and isinstance(c, _LoaderParameter) and type(c) is not type(p)
    layer = torch.nn.Module()
    layer.weight = p
    assert dict(layer.named_parameters()) == {"weight": p}
    # the loader writes into the device data, and reads count as reads of the device
    w = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    with D.count_transfers() as counter:
        p.load_shard(w[:2], 0)
        p.load_shard(w[2:], 2)
        y = p * 2
    assert counter.count == 0
    assert type(y) is D.NpuTensor and y.device == p.device
    with D.count_transfers() as counter:
        torch.testing.assert_close(p.cpu(), w, rtol=0, atol=0)
        assert p.sum().item() == 66.0
    assert counter.by_kind() == {"cpu": 1, "item": 1}
    # a plain Parameter of a device tensor is a device Parameter too; it trains on the device
    q = torch.nn.Parameter(torch.ones(3, device="npu"))
    assert isinstance(q, torch.nn.Parameter) and isinstance(q, D.NpuTensor) and q.requires_grad
    (q * q).sum().backward()
    torch.testing.assert_close(q.grad.cpu(), torch.full((3,), 2.0))
    # vLLM's to_meta_tensor / materialize_meta_tensor: the class and attributes move between a
    # meta tensor and a device tensor; no data leaves the device
    with D.count_transfers() as counter:
        meta = p.data.to("meta")
        assert meta.device.type == "meta" and not isinstance(meta, D.NpuTensor)
        meta.__class__ = p.__class__
        meta.__dict__ = p.__dict__.copy()
        assert isinstance(meta, _LoaderParameter) and meta.weight_loader is loader
        fresh = torch.empty_strided(tuple(meta.size()), tuple(meta.stride()), dtype=meta.dtype, device="npu")
        fresh.__class__ = meta.__class__
    assert counter.count == 0 and isinstance(fresh, _LoaderParameter) and fresh.device.type == "npu"
    # ``param.data = t`` (Module._apply, weight post-processing) moves the held data with the metadata
    p.data = torch.full((3, 4), 7.0, device="npu")
    assert p.shape == (3, 4) and isinstance(p, _LoaderParameter)
    torch.testing.assert_close(p.cpu(), torch.full((3, 4), 7.0), rtol=0, atol=0)
    lin = torch.nn.Linear(3, 2).npu().to(torch.float64)
    assert lin.weight.dtype == torch.float64 and lin.weight._raw.dtype == torch.float64
    assert lin(torch.ones(1, 3, device="npu", dtype=torch.float64)).dtype == torch.float64

@child_only
def test_ops_registered_for_the_device_run_their_kernel_on_device_tensors():
    # vLLM's direct_register_custom_op registers its ops (vllm::unquantized_gemm) for the platform's
    # dispatch key, PrivateUse1 on vllm-ascend: the device runs that kernel on the device tensors
    lib = torch.library.Library("npu_shim_device_test", "DEF")
    lib.define("scaled(Tensor x, float s) -> Tensor")
    seen = []

    def kernel(x, s):
        seen.append(type(x))
        return x * s

    lib.impl("scaled", kernel, "PrivateUse1")
    x = torch.arange(4.0, device="npu")
    with D.count_transfers() as counter:
        y = torch.ops.npu_shim_device_test.scaled(x, 2.0)
    assert counter.count == 0 and seen == [D.NpuTensor] and isinstance(y, D.NpuTensor)
    assert y.cpu().tolist() == [0.0, 2.0, 4.0, 6.0]
    lib.define("host_only(Tensor x) -> Tensor")   # no kernel for the device: refused, by name
    lib.impl("host_only", lambda x: x, "CPU")
    with pytest.raises(D.UnsupportedOpError, match="host_only"):
        torch.ops.npu_shim_device_test.host_only(x)


@child_only
def test_fused_slot_mapping_kernels_write_the_device_tensors_their_addresses_name():
    """vllm-ascend's fused slot-mapping kernels (emulated launches, npu_shim.emulation.triton_kernels)
    on the device, as vllm-ascend calls them: the groups' tables and slot mappings handed as the
    ``data_ptr()`` addresses of device tensors; the slots land in those device tensors, with no
    device->host read counted (the kernel reads device memory)."""
    from npu_shim.emulation import triton_kernels

    npu, pad = torch.device("npu"), -1
    qsl = torch.tensor([0, 3, 4], dtype=torch.int32, device=npu)
    positions = torch.tensor([0, 1, 2, 5], dtype=torch.int64, device=npu)
    tables = [torch.tensor([[2, 0], [1, 3]], dtype=torch.int32, device=npu),
              torch.tensor([[4, 0, 0], [6, 7, 8]], dtype=torch.int32, device=npu)]
    slots = [torch.zeros(6, dtype=torch.int32, device=npu) for _ in tables]
    addresses = [torch.tensor([t.data_ptr() for t in ts], dtype=torch.uint64, device=npu) for ts in (tables, slots)]
    strides = torch.tensor([2, 3], dtype=torch.int64, device=npu)
    sizes = torch.tensor([4, 2], dtype=torch.int32, device=npu)
    circular = torch.zeros(2, dtype=torch.int32, device=npu)
    with D.count_transfers() as counter:
        triton_kernels.compute_slot_mapping_fused_groups_adaptive[(2, 3)](
            4, 6, qsl, positions, *addresses, strides, sizes, circular, HAS_CIRCULAR=True, PAD_ID=pad,
            SMALL_TILE_BLOCK_SIZE=16, SMALL_BLOCK_TABLE_WINDOW_SIZE=8, LARGE_BLOCK_TABLE_WINDOW_SIZE=512)
    assert counter.count == 0
    assert all(isinstance(s, D.NpuTensor) for s in slots)
    assert slots[0].cpu().tolist() == [8, 9, 10, 13, pad, pad]      # block size 4: table[1][1] = 3
    assert slots[1].cpu().tolist() == [8, 9, 0, 17, pad, pad]       # block size 2: table[0][1] = 0, table[1][2] = 8


# The cases run in the child only: in the lane's process they are not collected (not skipped).
CASES = sum(1 for name in list(globals()) if name.startswith("test_") and name != "test_in_own_process")
if not CHILD:
    for _name in [n for n in globals() if n.startswith("test_") and n != "test_in_own_process"]:
        del globals()[_name]
