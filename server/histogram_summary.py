"""A Prometheus histogram read back as count, mean and p50/p95 estimates, for the JSON metrics summary.

The quantiles are estimated from the cumulative buckets the way PromQL's
``histogram_quantile`` does, so the JSON summary and a dashboard agree.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from prometheus_client import Histogram

__all__ = ["bucket_quantile", "histogram_summary"]


def histogram_summary(histogram: Histogram) -> dict[str, Any]:
    """Count, mean and bucket-interpolated p50/p95 estimates (None when empty)."""
    buckets: list[tuple[float, float]] = []
    total = 0.0
    observed = 0.0
    for metric in histogram.collect():
        for sample in metric.samples:
            if sample.name.endswith("_bucket"):
                buckets.append((float(sample.labels["le"]), sample.value))
            elif sample.name.endswith("_sum"):
                total = sample.value
            elif sample.name.endswith("_count"):
                observed = sample.value
    buckets.sort()
    n = int(observed)
    if n == 0:
        return {"count": 0, "mean": None, "p50": None, "p95": None}
    return {
        "count": n,
        "mean": total / n,
        "p50": bucket_quantile(buckets, 0.50),
        "p95": bucket_quantile(buckets, 0.95),
    }


def bucket_quantile(buckets: Sequence[tuple[float, float]], fraction: float) -> float:
    """Estimate a quantile from ascending cumulative ``(bound, count)`` buckets.

    Linear interpolation inside the bucket holding the target rank, from the previous
    bound (0 for the first bucket). A rank in the `+Inf` bucket reads as the largest finite
    bound, since nothing better is known.
    """
    observed = buckets[-1][1]
    target = fraction * observed
    lower_bound, lower_count = 0.0, 0.0
    for bound, cumulative in buckets:
        if cumulative >= target and cumulative > lower_count:
            if math.isinf(bound):
                return lower_bound
            share = (target - lower_count) / (cumulative - lower_count)
            return lower_bound + (bound - lower_bound) * share
        lower_bound, lower_count = bound, cumulative
    return lower_bound
