"""Test and benchmark utilities: the float64 reference, the host-sync counter and
the torch_npu call recorder.

* :func:`attention_f64` -- reference attention from the definition (reference.py).
* :func:`count_host_syncs` -- counts device->host syncs of the code under test
  (syncs.py); CPU tensors can stand in for device tensors; :func:`collect_host_syncs`
  opens one such count per block a helper runs (``around_decode``) and keeps each.
* :func:`record_npu_calls` -- records ``torch_npu.X`` / ``torch.ops.npu.X`` calls
  (calls.py); :func:`unemulated_op` lets a call to an op the emulation lacks be
  recorded (dispatch only, it computes nothing); :func:`recorded_not_run` does the same for
  an op the emulation has but would refuse with upstream's arguments.
* :func:`float32_not_on_hardware` -- lets the emulated attention ops take float32, which
  the real ones reject, for math checks against the float64 reference.
"""
from npu_shim.emulation.dtypes import float32_not_on_hardware
from npu_shim.testing.calls import NpuCall, record_npu_calls, recorded_not_run, unemulated_op
from npu_shim.testing.reference import attention_f64, dense_segments
from npu_shim.testing.syncs import (HostArgumentError, HostSyncCounter, SyncEvent, collect_host_syncs,
                                    count_host_syncs)

__all__ = ["HostArgumentError", "HostSyncCounter", "NpuCall", "SyncEvent", "attention_f64",
           "collect_host_syncs", "count_host_syncs", "dense_segments", "float32_not_on_hardware",
           "record_npu_calls", "recorded_not_run", "unemulated_op"]
