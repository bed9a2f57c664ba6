"""The lane that pins the newest sglang, read from the pin files (variant lanes, e.g. another
Python, left out): the tests that follow the newest release run there, naming no release."""
import os

from packaging.version import Version

from npu_shim.reference import lane_table, variant_lanes

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
_LANES = {lane: pins for lane, pins in lane_table(ROOT).items() if "sglang" in pins and lane not in variant_lanes(ROOT)}
LANE = max(_LANES, key=lambda lane: Version(_LANES[lane]["sglang"]))
RELEASE = _LANES[LANE]["sglang"]
