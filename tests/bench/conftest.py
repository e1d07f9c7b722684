"""The benchmarks' own helpers, imported from bench/ (appended to the path: the `routing` app keeps its name)."""

import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench"
if str(BENCH) not in sys.path:
    sys.path.append(str(BENCH))
