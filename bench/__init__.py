"""Benchmarks: each prints JSON lines of figures and ratios measured in the same run."""
