"""Camera pose of the toy world and its per-video-frame integration (reference C.5 "Service semantics").

The pose is in world coordinates (``x`` east, ``z`` north, on the ground; angles in degrees); the
keys move the camera in its own frame, frame by frame:

- ``yaw``: ``l`` adds ``yaw_step_deg`` (the camera turns right, clockwise seen from above), ``j``
  subtracts it; not wrapped (a yaw of 360 looks where 0 does);
- ``w`` / ``s``: a step of ``move_step`` forward / back along the heading (after this frame's turn);
- ``d`` / ``a``: a step of ``lateral_step`` to the right / left of the heading;
- ``pitch``: ``i`` adds ``pitch_step_deg`` (the camera looks up), ``k`` subtracts it; clamped to
  ``[-pitch_limit_deg, +pitch_limit_deg]`` after every frame. Pitch does not change where steps go.

At yaw 0, ``w`` adds to ``z`` and ``d`` to ``x`` exactly (the same floats as plain sums). Opposite keys
held together cancel. The identity pose is all zeros. What a pose shows is :mod:`.render`'s business.
"""

from __future__ import annotations

import math
from collections.abc import Iterable
from typing import TYPE_CHECKING

import attrs

from pipelines.contract import KNOWN_KEYS

if TYPE_CHECKING:
    from .model import ToyWorldConfig

__all__ = ["IDENTITY_POSE", "Pose", "integrate_pose"]


def _finite_float(instance: object, attribute: attrs.Attribute, value: float) -> None:
    if not math.isfinite(value):
        raise ValueError(f"pose {attribute.name} must be finite, got {value!r}")


@attrs.frozen
class Pose:
    """Where the camera is: ``x`` east, ``z`` north (world units), ``yaw``/``pitch`` (degrees)."""

    x: float = attrs.field(default=0.0, converter=float, validator=_finite_float)
    z: float = attrs.field(default=0.0, converter=float, validator=_finite_float)
    yaw: float = attrs.field(default=0.0, converter=float, validator=_finite_float)
    pitch: float = attrs.field(default=0.0, converter=float, validator=_finite_float)

    def as_tuple(self) -> tuple[float, float, float, float]:
        """``(x, z, yaw, pitch)``: the row layout of a pose tensor (``SessionSlots.poses``)."""
        return (self.x, self.z, self.yaw, self.pitch)

    @classmethod
    def from_sequence(cls, values: Iterable[float]) -> Pose:
        """The inverse of :meth:`as_tuple` (accepts a 4-element tensor row too)."""
        x, z, yaw, pitch = (float(v) for v in values)
        return cls(x, z, yaw, pitch)


IDENTITY_POSE = Pose()


def integrate_pose(pose: Pose, held_keys: frozenset[str], frames: int, config: ToyWorldConfig) -> list[Pose]:
    """The pose after each of ``frames`` video frames with ``held_keys`` held, one step per frame.

    The first element is already one step past ``pose``; the last is the pose to carry into the next
    chunk. E.g. with the default step of 0.10, four frames of ``w`` give ``z = 0.1, 0.2, 0.3, 0.4``.
    """
    if not isinstance(frames, int) or isinstance(frames, bool) or frames < 1:
        raise ValueError(f"frames must be an int >= 1, got {frames!r}")
    keys = frozenset(held_keys)
    unknown = sorted(keys - KNOWN_KEYS)
    if unknown:
        raise ValueError(f"unknown held keys {unknown} (known: {sorted(KNOWN_KEYS)})")

    def axis(plus: str, minus: str) -> int:
        return (plus in keys) - (minus in keys)

    forward, lateral = axis("w", "s"), axis("d", "a")
    turn, look = axis("l", "j"), axis("i", "k")
    limit = config.pitch_limit_deg
    x, z, yaw, pitch = pose.as_tuple()
    out: list[Pose] = []
    for _ in range(frames):
        # Accumulate per frame (not step * n) so chunk boundaries give the same floats as one long run.
        yaw += turn * config.yaw_step_deg
        heading = math.radians(yaw)
        sin, cos = math.sin(heading), math.cos(heading)
        ahead, aside = forward * config.move_step, lateral * config.lateral_step
        x += aside * cos + ahead * sin
        z += ahead * cos - aside * sin
        pitch = min(limit, max(-limit, pitch + look * config.pitch_step_deg))
        out.append(Pose(x, z, yaw, pitch))
    return out
