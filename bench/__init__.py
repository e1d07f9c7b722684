"""The benchmarks: modules run from the repository root as `.venv/bin/python -m bench.<name>` (see harness.py)."""
