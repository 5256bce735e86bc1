"""How tests read the toy world's frames (shared by the model, service, runner and browser tests).

The toy world is a pinhole camera over a ground plane (:mod:`pipelines.toy_world.render`). With no
pitch, image row ``r`` below the horizon sees the ground at depth ``eye_height * f / (r + 0.5 - H/2)``
(``f`` the focal length in pixels), so a sideways step of ``dx`` moves that row's content by
``dx * (r + 0.5 - H/2) / eye_height`` pixels (whatever ``f`` is): the bottom rows, nearest, move the
most (parallax), rows near the horizon barely, and the sky (infinitely far) not at all. The checks
that "the view follows ``d``" measure the bottom band of the frame against that.
"""

from __future__ import annotations

import numpy as np

__all__ = ["bottom_rows", "column_profile", "ground_shift_px"]


def bottom_rows(height: int) -> slice:
    """The bottom eighth of a frame (at least two rows): ground near the camera when pitch is 0."""
    return slice(height - max(2, height // 8), height)


def column_profile(frame: np.ndarray, rows: slice | None = None) -> np.ndarray:
    """Mean grey level of each column over ``rows`` (all rows by default)."""
    picked = frame if rows is None else frame[rows]
    return picked.astype(np.float64).mean(axis=-1).mean(axis=0)


def ground_shift_px(dx: float, rows: slice, height: int, eye_height: float) -> float:
    """Mean pixels the ground in ``rows`` moves left when the camera steps ``dx`` to the right (pitch 0)."""
    indices = np.arange(height)[rows]
    return float(dx * np.mean(indices + 0.5 - height / 2) / eye_height)
