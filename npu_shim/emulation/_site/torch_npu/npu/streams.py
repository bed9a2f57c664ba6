"""``torch_npu.npu.streams``: Stream and Event for code that imports them.

vllm-ascend 0.13's ``vllm_ascend.utils`` does ``from torch_npu.npu.streams import
Event`` at module top. The emulated ops finish before they return, so every
stream is already synchronised: waits and records are no-ops and queries report
completion. Event timing is not emulated and says so.
"""


class Stream:
    def __init__(self, device=None, priority=0, **kwargs):
        self.device = device
        self.priority = priority

    def wait_stream(self, stream):
        pass

    def wait_event(self, event):
        pass

    def record_event(self, event=None):
        event = event if event is not None else Event()
        event.record(self)
        return event

    def synchronize(self):
        pass

    def query(self):
        return True


class Event:
    def __init__(self, enable_timing=False, blocking=False, interprocess=False):
        self.enable_timing = enable_timing
        self.recorded = False

    def record(self, stream=None):
        self.recorded = True

    def wait(self, stream=None):
        pass

    def synchronize(self):
        pass

    def query(self):
        return True

    def elapsed_time(self, end_event):
        raise NotImplementedError("torch_npu emulation: Event.elapsed_time (no device timing)")
