"""Pictures compared the way a viewer would: how far the content moved between two grey frames."""

from __future__ import annotations

import numpy as np


def horizontal_shift(before: np.ndarray, after: np.ndarray) -> tuple[int, float, float]:
    """``(s, error at s, error at 0)`` for the best ``s`` with ``after[:, x] ≈ before[:, x + s]``.

    ``s > 0``: the content moved LEFT by ``s`` pixels. Errors are mean absolute grey-level differences over
    the overlap, which stays at least a quarter of the width.
    """
    width = before.shape[1]
    errors = {}
    for s in range(-(3 * width) // 4, (3 * width) // 4 + 1):
        a, b = (after[:, : width - s], before[:, s:]) if s >= 0 else (after[:, -s:], before[:, : width + s])
        errors[s] = float(np.abs(a - b).mean())
    best = min(errors, key=errors.__getitem__)
    return best, errors[best], errors[0]


def near_ground_shift(before: np.ndarray, after: np.ndarray, rows: int = 3) -> tuple[int, float, float]:
    """:func:`horizontal_shift` of the bottom ``rows`` rows: the toy world's nearest ground.

    A strafe moves each row by its own depth's parallax (the sky not at all), so no single shift fits a
    whole frame; a thin band of the nearest ground moves the most and by one shift.
    """
    return horizontal_shift(before[-rows:], after[-rows:])
