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

__all__ = ["EMULATED", "KernelLaunchError", "TritonKernel", "alloc_extend_kernel"]


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
