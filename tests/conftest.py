"""The repository root on sys.path: the benchmark modules live in `benchmarks/` there, outside the installed library."""
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)
