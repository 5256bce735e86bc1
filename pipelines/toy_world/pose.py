"""Camera pose of the toy world and its per-video-frame integration (reference C.5 "Service semantics").

Sign conventions (all in the camera's own frame, angles in degrees):

- ``x`` lateral: ``d`` adds ``lateral_step`` (camera moves right), ``a`` subtracts it;
- ``z`` forward: ``w`` adds ``move_step`` (camera moves forward), ``s`` subtracts it;
- ``yaw``: ``l`` adds ``yaw_step_deg`` (camera turns right), ``j`` subtracts it; not wrapped;
- ``pitch``: ``i`` adds ``pitch_step_deg`` (camera looks up), ``k`` subtracts it; clamped to
  ``[-pitch_limit_deg, +pitch_limit_deg]`` after every frame.

Opposite keys held together cancel. The identity pose is all zeros. How a pose moves the picture
(content moves opposite to the camera) is :func:`pipelines.toy_world.model.ToyWorldModel.warp_view`'s
business.
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
    """Where the camera is: lateral ``x``, forward ``z`` (world units), ``yaw``/``pitch`` (degrees)."""

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
        x += lateral * config.lateral_step
        z += forward * config.move_step
        yaw += turn * config.yaw_step_deg
        pitch = min(limit, max(-limit, pitch + look * config.pitch_step_deg))
        out.append(Pose(x, z, yaw, pitch))
    return out
