"""``torch_npu.contrib`` of the emulated torch_npu: ``transfer_to_npu`` only (imported by name)."""
