"""Lets lane tests import their helper package ``sglang_support``.

pytest runs in importlib mode (test basenames repeat across lanes), which does
not put test directories on ``sys.path``.
"""
import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
if HERE not in sys.path:
    sys.path.insert(0, HERE)
