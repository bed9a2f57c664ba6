"""sglang's vision attention on Ascend, run on CPU: the layer case and the platform stand-ins.

Used by tests/lanes/test_sglang_vision_host_lengths.py, the selftest of
``sglang.vision_host_lengths`` and ``benchmarks/bench_towers.py``. sglang is
imported only inside the functions.

Real sglang (the installed release): ``VisionAscendAttention`` (its ``__init__``
and ``forward``) and, where the release has it, ``prepare_vision_attention_metadata``
building one metadata object that every layer of the forward shares, as the towers
do. Stand-ins, because this machine has no NPU:

* torch_npu is npu-shim's emulation, bound as ``torch_npu`` in sglang's vision
  module (which imports it only where it sees an NPU);
* sglang's ``_is_npu`` / ``is_npu()`` answer True inside :func:`npu_platform`
  (the vision module refuses to build ``VisionAscendAttention`` otherwise, and the
  towers move ``cu_seqlens`` to ``"cpu"`` only on NPU);
* ``Tensor.is_npu`` (torch_npu's attribute, which 0.5.11 - 0.5.16 read) answers
  whether the tensor is a device stand-in of the running sync counter.

Inputs: ``q`` (T, N, D), ``k``/``v`` (T, Nkv, D) in the model dtype (bfloat16 on
A2), one segment per image; ``packed`` puts the images back to back, ``padded``
pads each to the longest (the layout the 0.5.20+ ``valid_indices`` path serves),
with large values in the pad rows so that a pad row that leaks shows in the error.
"""
import contextlib
import importlib
from types import SimpleNamespace

import torch

from npu_shim.testing.attributes import attributes_set

VISION = "sglang.srt.layers.attention.vision"
PAD_VALUE = 1.0e3
# bfloat16 output vs float64: measured worst 3.9e-3 (lengths 64/100/36, D 64, N 4 over Nkv 2).
TOLERANCES = {torch.bfloat16: 2e-2, torch.float16: 4e-3, torch.float32: 1e-5}

_counter = [None]


def _tensor_is_npu(tensor):
    counter = _counter[0]
    return bool(counter is not None and counter.is_device(tensor))


@contextlib.contextmanager
def counting_as_npu(counter):
    """While the block runs, ``Tensor.is_npu`` answers True for ``counter``'s device stand-ins."""
    previous = _counter[0]
    _counter[0] = counter
    try:
        yield counter
    finally:
        _counter[0] = previous


@contextlib.contextmanager
def npu_platform(*model_modules):
    """sglang's vision module (and ``model_modules``) see an NPU and the emulated torch_npu."""
    from npu_shim import emulation

    emulation.install()
    import torch_npu

    vision = importlib.import_module(VISION)
    with attributes_set() as put:
        put(vision, "_is_npu", True)
        put(vision, "torch_npu", torch_npu)
        for module in model_modules:
            if "_is_npu" in vars(module):
                put(module, "_is_npu", True)
            if "is_npu" in vars(module):
                put(module, "is_npu", lambda: True)
        if "is_npu" not in vars(torch.Tensor):
            put(torch.Tensor, "is_npu", property(_tensor_is_npu))
        yield vision


def make_case(lengths, *, padded=False, heads=4, kv_heads=2, head_dim=64, dtype=torch.bfloat16, seed=0):
    """q, k, v and the host ``cu_seqlens`` (int32, leading 0) of images of ``lengths`` tokens."""
    g = torch.Generator().manual_seed(seed)
    n = len(lengths)
    cumulative = [0]
    for length in lengths:
        cumulative.append(cumulative[-1] + int(length))
    rows = max(lengths) * n if padded else cumulative[-1]
    q, k, v = (torch.randn(rows, h, head_dim, generator=g) for h in (heads, kv_heads, kv_heads))
    real = real_rows(lengths, padded)
    if padded:
        pad = torch.ones(rows, dtype=torch.bool)
        pad[real] = False
        for t in (q, k, v):
            t[pad] = PAD_VALUE
    return SimpleNamespace(q=q.to(dtype), k=k.to(dtype), v=v.to(dtype), lengths=tuple(lengths), padded=padded,
                           cu_seqlens=torch.tensor(cumulative, dtype=torch.int32), real=real, dtype=dtype)


def real_rows(lengths, padded):
    """Indices of the image rows (the others are padding)."""
    if not padded:
        return torch.arange(sum(lengths))
    width = max(lengths)
    return torch.cat([torch.arange(b * width, b * width + n) for b, n in enumerate(lengths)])


def reference(case):
    """float64 attention within each image, over the real rows: (real rows, N, D)."""
    from npu_shim.testing.reference import attention_f64

    idx = case.real
    return attention_f64(case.q[idx], case.k[idx], case.v[idx], case.cu_seqlens)


def error(case, out):
    """Largest absolute deviation of the real rows of ``out`` from the float64 reference."""
    return (out[case.real].double() - reference(case)).abs().max().item()


def make_attention(vision, case):
    heads, head_dim = case.q.shape[1], case.q.shape[2]
    return vision.VisionAscendAttention(head_dim=head_dim, num_heads=heads, num_kv_heads=case.k.shape[1],
                                        dropout=0.0, softmax_in_single_precision=False)


def run_layers(vision, case, layers, *, device_lengths=False, prepare=None, forward=None):
    """``layers`` attention calls sharing one metadata object (where the release builds one), as a
    tower forward makes them, under a sync counter with q, k, v (and, with ``device_lengths``,
    ``cu_seqlens``) as device stand-ins. ``prepare`` / ``forward``: the functions to run
    (default: what the vision module holds now). Returns (output, counter, recorded NPU calls)."""
    from npu_shim.testing import count_host_syncs, record_npu_calls

    attention = make_attention(vision, case)
    prepare = prepare or getattr(vision, "prepare_vision_attention_metadata", None)
    forward = forward or type(attention).forward
    stand_ins = [case.q, case.k, case.v] + ([case.cu_seqlens] if device_lengths else [])
    out = None
    with count_host_syncs(device_tensors=stand_ins, follow_placement=True) as syncs, \
            counting_as_npu(syncs), record_npu_calls() as calls:
        metadata = prepare(case.cu_seqlens, device=case.q.device) if prepare is not None else None
        extra = {"forward_metadata": metadata} if metadata is not None else {}
        for _ in range(layers):
            out = forward(attention, q=case.q, k=case.k, v=case.v, cu_seqlens=case.cu_seqlens, bsz=1,
                          seq_len=case.q.shape[0], **extra)
    return out, syncs, calls
