"""The lanes the sglang engine tests run on, read from the pin files (variant lanes, e.g. another
Python, left out): the lane pinning the newest sglang, and the lane pinning the oldest, where the
shim's sglang patches have their oldest families (tests/lanes/test_engine_sglang*.py), naming no
release."""
from packaging.version import Version

from sglang_support import newest

OLDEST = min(newest._LANES, key=lambda lane: Version(newest._LANES[lane]["sglang"]))
LANES = (newest.LANE, OLDEST)
