"""What the engine tests share (issue 38): the tiny random-weight model each saves, the float64
reference it is compared with, and the child-process runner that never hangs."""
