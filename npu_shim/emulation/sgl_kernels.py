"""Emulation of the ``sgl_kernel_npu`` kernels sglang's NPU text path launches (tests and development only).

``sgl_kernel_npu`` is sglang's NPU-only kernel package (Triton-Ascend kernels and AscendC ops); it is on
no package index and runs only on an Ascend device. The sglang lanes put an import placeholder of it on
``PYTHONPATH`` (tests/placeholders/sgl_kernel_npu), which refuses every kernel by name except the ones
listed in :data:`EMULATED` here, which it hands out from this module. Nothing on the production path
imports this module.

Each kernel is emulated from its source's semantics (sgl-project/sgl-kernel-npu), program by program:
a Triton launch ``kernel[grid](*args)`` runs the kernel's body once per program id of ``grid``, in order,
on the tensors' data (for a tensor on the emulated device, its held host data: the body stands in for a
device kernel, so its reads are not device->host transfers). Pointer arguments are flat: a tensor must
be contiguous (a Triton kernel reads ``ptr + offset`` in elements), else the launch is refused by name.

Kernels:

* ``sgl_kernel_npu.mem_cache.allocator.alloc_extend_kernel`` (sglang's
  ``NPUPagedTokenToKVPoolAllocator.alloc_extend``, launched with ``grid=(bs,)`` and
  ``(prefix_lens, seq_lens, last_loc, free_pages, out_indices, bs_upper, page_size,
  max_num_extend_tokens)``): request ``pid`` writes its ``seq_len - pre_len`` new token slots at
  ``out_indices[sum of the earlier requests' extend lengths:]``: first the rest of its last partial page
  (``last_loc + 1 ...``), then whole new pages, then one new partial page, the new pages taken in order
  from ``free_pages`` starting after those the earlier requests take
  (``ceil(seq/page) - ceil(prefix/page)`` each). Part 2 writes at most
  ``cdiv(max_num_extend_tokens, BLOCK_SIZE) * BLOCK_SIZE`` slots, as the kernel's loop does.
"""
import torch

__all__ = ["EMULATED", "KernelLaunchError", "SGLANG_KERNELS", "TritonKernel", "alloc_extend_kernel",
           "compute_position_kernel", "install_sglang_kernels", "sglang_modules", "write_req_to_token_pool_triton"]


class KernelLaunchError(ValueError):
    """A launch of an emulated sgl_kernel_npu kernel with arguments the kernel cannot take."""


def _data(tensor, kernel, name):
    """The tensor's data as the kernel addresses it: flat, its own elements (for an emulated device
    tensor, the held host tensor itself, so writes land in the device's memory)."""
    if not isinstance(tensor, torch.Tensor):
        raise KernelLaunchError("%s: %s must be a tensor (a pointer argument), got %s"
                                % (kernel, name, type(tensor).__name__))
    if not tensor.is_contiguous():
        raise KernelLaunchError("%s: %s is not contiguous (shape %s, stride %s); the kernel addresses it "
                                "as a flat pointer" % (kernel, name, tuple(tensor.shape), tensor.stride()))
    raw = getattr(tensor, "_raw", tensor)  # npu_shim.emulation.device.NpuTensor holds its data there
    return raw.view(-1)


def _same_device(kernel, **tensors):
    devices = {name: t.device for name, t in tensors.items()}
    if len(set(devices.values())) > 1:
        raise KernelLaunchError("%s: pointer arguments on different devices: %s" % (kernel, devices))


class TritonKernel:
    """A Triton kernel's emulation: ``kernel[grid](*args, **kwargs)`` runs ``body(pid, *args, **kwargs)``
    for each program id of a one-dimensional ``grid`` (a tuple, or a callable of the launch's keyword
    arguments, as Triton takes it)."""

    def __init__(self, name, body, prepare=None):
        self.name = name
        self._body = body
        self._prepare = prepare

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            shape = grid(kwargs) if callable(grid) else grid
            shape = tuple(shape) if isinstance(shape, (tuple, list)) else (shape,)
            if not shape or any(int(n) != 1 for n in shape[1:]):
                raise KernelLaunchError("%s: the emulation launches one-dimensional grids ((n,), (n, 1) ...), "
                                        "got %r" % (self.name, grid))
            state = self._prepare(*args, **kwargs) if self._prepare else None
            for pid in range(int(shape[0])):
                self._body(pid, state, *args, **kwargs)
        return launch

    def __call__(self, *args, **kwargs):
        raise TypeError("%s is a Triton kernel: launch it as kernel[grid](...)" % self.name)

    def __repr__(self):
        return "<npu-shim emulation of the sgl_kernel_npu Triton kernel %s>" % self.name


# --------------------------------------------------------------------------- alloc_extend_kernel

_ALLOC_EXTEND = "sgl_kernel_npu.mem_cache.allocator.alloc_extend_kernel"


def _alloc_extend_prepare(pre_lens_ptr, seq_lens_ptr, last_loc_ptr, free_page_ptr, out_indices, bs_upper,
                          page_size, max_num_extend_tokens, BLOCK_SIZE=2048):  # noqa: N803 (the kernel's names)
    k = _ALLOC_EXTEND
    _same_device(k, pre_lens=pre_lens_ptr, seq_lens=seq_lens_ptr, last_loc=last_loc_ptr,
                 free_pages=free_page_ptr, out_indices=out_indices)
    for name, t in (("pre_lens", pre_lens_ptr), ("seq_lens", seq_lens_ptr), ("last_loc", last_loc_ptr),
                    ("free_pages", free_page_ptr), ("out_indices", out_indices)):
        if t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool:
            raise KernelLaunchError("%s: %s must be an integer tensor, got %s" % (k, name, t.dtype))
    if int(page_size) < 1:
        raise KernelLaunchError("%s: page_size must be positive, got %r" % (k, page_size))
    pre = _data(pre_lens_ptr, k, "pre_lens").tolist()
    seq = _data(seq_lens_ptr, k, "seq_lens").tolist()
    if len(pre) != len(seq) or len(seq) > int(bs_upper):
        raise KernelLaunchError("%s: %d prefix lengths, %d sequence lengths, bs_upper %d"
                                % (k, len(pre), len(seq), int(bs_upper)))
    return {"pre": pre, "seq": seq, "last_loc": _data(last_loc_ptr, k, "last_loc").tolist(),
            "free": _data(free_page_ptr, k, "free_pages"), "out": _data(out_indices, k, "out_indices")}


def _alloc_extend_body(pid, state, pre_lens_ptr, seq_lens_ptr, last_loc_ptr, free_page_ptr, out_indices,
                       bs_upper, page_size, max_num_extend_tokens, BLOCK_SIZE=2048):  # noqa: N803
    k = _ALLOC_EXTEND
    page_size = int(page_size)
    pre, seq, free, out = state["pre"], state["seq"], state["free"], state["out"]
    pre_len, seq_len = pre[pid], seq[pid]
    # the loads are masked to programs 0..pid, so each sum is over this request and those before it
    output_start_loc = sum(s - p for s, p in zip(seq[:pid], pre[:pid]))
    self_pages = (seq_len + page_size - 1) // page_size - (pre_len + page_size - 1) // page_size
    new_page_start_loc = sum((s + page_size - 1) // page_size - (p + page_size - 1) // page_size
                             for s, p in zip(seq[:pid], pre[:pid]))

    def store(start, values):
        if start < 0 or start + len(values) > out.numel():
            raise KernelLaunchError("%s: program %d writes out_indices[%d:%d], which has %d elements"
                                    % (k, pid, start, start + len(values), out.numel()))
        out[start:start + len(values)] = torch.tensor(values, dtype=out.dtype)

    def page(index):
        if not 0 <= index < free.numel():
            raise KernelLaunchError("%s: program %d reads free_pages[%d], which has %d elements"
                                    % (k, pid, index, free.numel()))
        return int(free[index])

    # Part 1: the rest of the old partial page
    ceil_pre = (pre_len + page_size - 1) // page_size * page_size
    num_part1 = min(seq_len, ceil_pre) - pre_len
    last_loc = state["last_loc"][pid]
    store(output_start_loc, [last_loc + 1 + i for i in range(max(0, min(num_part1, page_size)))])
    if pre_len + num_part1 == seq_len:
        return
    # Part 2: new full pages
    num_part2 = seq_len // page_size * page_size - ceil_pre
    block = int(BLOCK_SIZE)
    reach = -(-int(max_num_extend_tokens) // block) * block  # the kernel's loop covers this many offsets
    store(output_start_loc + num_part1,
          [page(new_page_start_loc + off // page_size) * page_size + off % page_size
           for off in range(max(0, min(num_part2, reach)))])
    if pre_len + num_part1 + num_part2 == seq_len:
        return
    # Part 3: one new partial page
    num_part3 = seq_len - seq_len // page_size * page_size
    start_loc = page(new_page_start_loc + self_pages - 1)
    store(output_start_loc + num_part1 + num_part2,
          [start_loc * page_size + i for i in range(max(0, min(num_part3, page_size)))])


alloc_extend_kernel = TritonKernel(_ALLOC_EXTEND, _alloc_extend_body, _alloc_extend_prepare)

# The kernels the placeholder package hands out: "module of sgl_kernel_npu" -> {name: emulation}.
EMULATED = {
    "sgl_kernel_npu.mem_cache.allocator": {"alloc_extend_kernel": alloc_extend_kernel},
}


# --------------------------------------------------------------------------- sglang's own Triton kernels
# Releases whose ``support_triton(backend)`` is true on an NPU (it reads only the backend's name) launch
# sglang's own Triton kernels on the engine's text path, which triton-ascend compiles on the device:
# ``write_req_to_token_pool_triton`` (``mem_cache.common.write_cache_indices``) and
# ``compute_position_kernel`` (``forward_batch_info.compute_position``). Later releases ask the platform
# (``supports_triton``, false on NPU) and take sglang's pure-torch branches instead.

_WRITE_REQ = "sglang.srt.mem_cache.common.write_req_to_token_pool_triton"


def _host_int64(address, count, kernel, pid):
    """``count`` int64 at ``address``: a pointer into the emulated device's memory (a device tensor's
    ``data_ptr()`` is its held host data's address), read as the kernel's ``tl.load`` reads it."""
    import ctypes

    if count <= 0:
        return torch.empty(0, dtype=torch.int64)
    if not address:
        raise KernelLaunchError("%s: program %d reads %d values at a null pointer" % (kernel, pid, count))
    return torch.frombuffer((ctypes.c_int64 * count).from_address(address), dtype=torch.int64).clone()


def _write_req_prepare(req_to_token_ptr, req_pool_indices, prefix_tensors, pre_lens, seq_lens, extend_lens,
                       out_cache_loc, req_to_token_ptr_stride):
    k = _WRITE_REQ
    _same_device(k, req_to_token=req_to_token_ptr, req_pool_indices=req_pool_indices,
                 prefix_tensors=prefix_tensors, pre_lens=pre_lens, seq_lens=seq_lens, extend_lens=extend_lens,
                 out_cache_loc=out_cache_loc)
    if prefix_tensors.dtype not in (torch.uint64, torch.int64):
        raise KernelLaunchError("%s: prefix_tensors must hold pointers (uint64), got %s" % (k, prefix_tensors.dtype))
    if req_to_token_ptr.dim() != 2 or int(req_to_token_ptr_stride) != req_to_token_ptr.stride(0):
        raise KernelLaunchError("%s: req_to_token_ptr_stride %r is not req_to_token's row stride (shape %s)"
                                % (k, req_to_token_ptr_stride, tuple(req_to_token_ptr.shape)))
    return {"table": _data(req_to_token_ptr, k, "req_to_token"),
            "rows": _data(req_pool_indices, k, "req_pool_indices").tolist(),
            "prefix": _data(prefix_tensors, k, "prefix_tensors").view(torch.int64).tolist(),
            "pre": _data(pre_lens, k, "pre_lens").tolist(), "seq": _data(seq_lens, k, "seq_lens").tolist(),
            "extend": _data(extend_lens, k, "extend_lens").tolist(), "out": _data(out_cache_loc, k, "out_cache_loc")}


def _write_req_body(pid, state, req_to_token_ptr, req_pool_indices, prefix_tensors, pre_lens, seq_lens,
                    extend_lens, out_cache_loc, req_to_token_ptr_stride):
    """Row ``req_pool_indices[pid]`` of ``req_to_token``: ``[0, pre_len)`` from the prefix tensor the
    pointer addresses, ``[pre_len, seq_len)`` from ``out_cache_loc`` after the earlier programs'
    ``extend_lens``."""
    k = _WRITE_REQ
    table, stride = state["table"], int(req_to_token_ptr_stride)
    row, pre_len, seq_len = state["rows"][pid], state["pre"][pid], state["seq"][pid]
    start = row * stride
    if not 0 <= pre_len <= seq_len <= stride or start + stride > table.numel():
        raise KernelLaunchError("%s: program %d writes row %d [0, %d) of a table of %d rows of %d"
                                % (k, pid, row, seq_len, table.numel() // stride, stride))
    table[start:start + pre_len] = _host_int64(state["prefix"][pid], pre_len, k, pid).to(table.dtype)
    cumsum_start = sum(state["extend"][:pid])
    out = state["out"]
    if cumsum_start + seq_len - pre_len > out.numel():
        raise KernelLaunchError("%s: program %d reads out_cache_loc[%d:%d], which has %d elements"
                                % (k, pid, cumsum_start, cumsum_start + seq_len - pre_len, out.numel()))
    table[start + pre_len:start + seq_len] = out[cumsum_start:cumsum_start + seq_len - pre_len].to(table.dtype)


write_req_to_token_pool_triton = TritonKernel(_WRITE_REQ, _write_req_body, _write_req_prepare)

_POSITION = "sglang.srt.model_executor.forward_batch_info.compute_position_kernel"


def _position_prepare(positions, extend_start_loc, extend_prefix_lens, extend_seq_lens, has_prefix):
    k = _POSITION
    _same_device(k, positions=positions, extend_start_loc=extend_start_loc, extend_prefix_lens=extend_prefix_lens,
                 extend_seq_lens=extend_seq_lens)
    return {"positions": _data(positions, k, "positions"), "start": _data(extend_start_loc, k, "extend_start_loc"),
            "prefix": _data(extend_prefix_lens, k, "extend_prefix_lens").tolist() if has_prefix else None,
            "seq": _data(extend_seq_lens, k, "extend_seq_lens").tolist()}


def _position_body(pid, state, positions, extend_start_loc, extend_prefix_lens, extend_seq_lens, has_prefix):
    """``positions[cumsum_start + i] = prefix_len + i`` for ``i < seq_len``; ``extend_start_loc[pid] =
    cumsum_start``, the sum of the earlier programs' ``extend_seq_lens`` (``prefix_len`` 0 without
    ``has_prefix``)."""
    k = _POSITION
    seq_len = state["seq"][pid]
    prefix_len = state["prefix"][pid] if state["prefix"] is not None else 0
    cumsum_start = sum(state["seq"][:pid])
    out = state["positions"]
    if cumsum_start + seq_len > out.numel():
        raise KernelLaunchError("%s: program %d writes positions[%d:%d], which has %d elements"
                                % (k, pid, cumsum_start, cumsum_start + seq_len, out.numel()))
    out[cumsum_start:cumsum_start + seq_len] = torch.arange(prefix_len, prefix_len + seq_len, dtype=out.dtype)
    state["start"][pid] = cumsum_start


compute_position_kernel = TritonKernel(_POSITION, _position_body, _position_prepare)

# sglang's own kernels: "module of sglang" -> {name: emulation}; ``install_sglang_kernels`` puts them in
# place of the Triton functions (an engine test's child, before the engine starts).
# A release defines each kernel in one of the modules listed for it: ``compute_position_kernel`` moved from
# ``forward_batch_info`` to ``model_executor.triton_ops.position`` (its launcher ``compute_position_triton``
# with it; read in 0.5.14 and 0.5.15), which earlier releases do not have.
SGLANG_KERNELS = {
    "sglang.srt.mem_cache.common": {"write_req_to_token_pool_triton": write_req_to_token_pool_triton},
    "sglang.srt.model_executor.forward_batch_info": {"compute_position_kernel": compute_position_kernel},
    "sglang.srt.model_executor.triton_ops.position": {"compute_position_kernel": compute_position_kernel},
}


def sglang_modules():
    """The modules of :data:`SGLANG_KERNELS` the installed sglang has, imported: ``{name: module}``."""
    import importlib

    modules = {}
    for module_name in SGLANG_KERNELS:
        try:
            modules[module_name] = importlib.import_module(module_name)
        except ModuleNotFoundError as exc:
            if exc.name is None or not module_name.startswith(exc.name):
                raise   # something the module imports is missing, not the module
    return modules


def install_sglang_kernels():
    """Put the emulations of :data:`SGLANG_KERNELS` in place of sglang's Triton functions of those names
    (those the installed sglang defines, in the modules it has; a later release without them keeps its
    code). Returns the names replaced. Tests and development only: on the NPU, triton-ascend compiles the real kernels."""
    replaced = []
    for module_name, module in sglang_modules().items():
        for name, emulation in SGLANG_KERNELS[module_name].items():
            if hasattr(module, name):
                setattr(module, name, emulation)
                replaced.append(module_name + "." + name)
    return replaced
