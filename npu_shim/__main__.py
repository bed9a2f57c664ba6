import sys

from npu_shim.cli import main

sys.exit(main())
