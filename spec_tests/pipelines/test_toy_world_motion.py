"""The toy world model (DESIGN §5) follows the controls: each key moves the view the way a pinhole camera over a
ground plane would, and a walk through the world keeps detail, passes objects and comes back where it started.
(The model's config, poses, determinism, encoding and slots: ``test_toy_world_model.py``.)

Everything is measured on the decoded uint8 frames (or, for which objects are in view, on the model's
own list of visible world cells), never on weights. Geometry the checks rely on (a pinhole camera over
a ground plane) is spelled out in :mod:`spec_tests.pipelines.toy_world_views`:

- shifts: the column-mean (row-mean) profile of a grey frame (or of a band of rows), brute-force shift
  search over the overlapping part, refined to sub-pixel with a parabola through the best three shifts;
- "detail": a frame's grey-level standard deviation and its edge density (the fraction of pixels whose
  horizontal or vertical grey difference exceeds a threshold).

Most checks render small frames (the default is 160x96) to stay fast; ``object_density=0`` isolates the
ground where a check is about the ground alone.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from pipelines.toy_world.model import IDENTITY_POSE, Pose, ToyWorldConfig, ToyWorldModel

from .toy_world_helpers import SMALL, fresh_cache, frames_of, grey, run_chunks
from .toy_world_views import bottom_rows, column_profile, ground_shift_px

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # the fixtures are in conftest.py


def best_shift(reference: np.ndarray, moved: np.ndarray, max_shift: int = 30) -> float:
    """``s`` such that ``moved[i] ~= reference[i + s]``: positive means content moved toward index 0."""
    n = len(reference)
    errors = []
    for s in range(-max_shift, max_shift + 1):
        lo, hi = max(0, -s), min(n, n - s)
        errors.append(np.mean((moved[lo:hi] - reference[lo + s : hi + s]) ** 2))
    errors = np.asarray(errors)
    k = int(np.argmin(errors))
    assert 0 < k < len(errors) - 1, "shift search hit its bound"
    a, b, c = errors[k - 1 : k + 2]
    denom = a - 2 * b + c
    return k - max_shift + (0.5 * (a - c) / denom if denom > 0 else 0.0)


def horizontal_shift(reference: np.ndarray, moved: np.ndarray, rows: slice | None = None) -> float:
    """Pixels the content (of ``rows``) moved LEFT (negative: right)."""
    return best_shift(column_profile(reference, rows), column_profile(moved, rows))


def vertical_shift(reference: np.ndarray, moved: np.ndarray) -> float:
    """Pixels the content moved UP (negative: down), from the row profile."""
    return best_shift(grey(reference).mean(axis=1), grey(moved).mean(axis=1), max_shift=20)


def block_shift_down(reference: np.ndarray, moved: np.ndarray, rows: slice, cols: slice, max_shift: int = 8) -> int:
    """The ``s`` minimizing the grey difference of ``moved[rows + s, cols]`` and ``reference[rows, cols]``:
    positive means the block's content moved DOWN by ``s`` pixels."""
    a, b = grey(reference), grey(moved)
    errors = {
        s: float(np.abs(b[rows.start + s : rows.stop + s, cols] - a[rows, cols]).mean())
        for s in range(-max_shift, max_shift + 1)
    }
    return min(errors, key=errors.__getitem__)


def edge_density(frame: np.ndarray, threshold: float = 6.0) -> float:
    g = grey(frame)
    edges = np.zeros_like(g, dtype=bool)
    edges[:, 1:] |= np.abs(np.diff(g, axis=1)) > threshold
    edges[1:, :] |= np.abs(np.diff(g, axis=0)) > threshold
    return float(edges.mean())


def mean_difference(a: np.ndarray, b: np.ndarray) -> float:
    return float(np.abs(a.astype(np.float64) - b.astype(np.float64)).mean())


def focal(config: ToyWorldConfig) -> float:
    return config.width / 2 / math.tan(math.radians(config.fov_deg) / 2)


# -- the view follows the controls ---------------------------------------------------------------------


def test_d_moves_the_near_ground_left_faster_than_the_far_ground_and_not_the_sky(bare):
    cfg = bare.config
    still = frames_of(bare, "")[-1]
    moved = frames_of(bare, "d", chunks=2)[-1]  # 8 frames: 0.8 units to the right
    near, far = bottom_rows(cfg.height), slice(cfg.height // 2 + 12, cfg.height // 2 + 20)
    expected_near = ground_shift_px(0.8, near, cfg.height, cfg.eye_height)
    expected_far = ground_shift_px(0.8, far, cfg.height, cfg.eye_height)
    assert expected_near > 2.5 * expected_far > 0
    near_shift, far_shift = horizontal_shift(still, moved, near), horizontal_shift(still, moved, far)
    assert near_shift == pytest.approx(expected_near, rel=0.15)
    # Farther ground moves less (it is fainter in the haze, so only the ordering is measured there).
    assert 1.0 < far_shift < 0.5 * near_shift
    assert abs(horizontal_shift(still, moved, slice(0, 12))) < 0.5  # the sky is infinitely far
    back = frames_of(bare, "a", chunks=2)[-1]
    assert horizontal_shift(still, back, near) == pytest.approx(-expected_near, rel=0.15)
    # Within the chunk the content keeps moving, frame by frame.
    steps = [horizontal_shift(still, frame, near) for frame in frames_of(bare, "d")]
    assert steps == sorted(steps) and steps[0] > 0.5


def test_near_objects_cross_the_view_faster_than_far_ones(model):
    """Strafing: the screen position of each visible object's base moves by f * dx / depth."""
    from pipelines.toy_world.render import camera_basis, objects_near

    cfg = model.config
    prims = objects_near(0.0, 0.0, cfg.view_distance, cfg)
    f = focal(cfg)

    def screen_x(x: float) -> np.ndarray:
        rel = prims.centre - np.array([x, cfg.eye_height, 0.0])
        cam = rel @ camera_basis(Pose(x=x)).T
        return cam[:, 0] / cam[:, 2] * f, cam[:, 2]

    (before, depth), (after, _) = screen_x(0.0), screen_x(0.8)
    ahead = depth > 2.0
    moved = (before - after)[ahead]
    assert np.allclose(moved, f * 0.8 / depth[ahead])
    near, far = depth[ahead] < 8, depth[ahead] > 16
    assert near.any() and far.any() and moved[near].min() > moved[far].max()


def test_turning_l_moves_content_left_and_j_right(model):
    cfg = model.config
    still = frames_of(model, "")[-1]
    expected = focal(cfg) * math.tan(math.radians(4.0))  # 8 frames of l: 4 degrees
    assert horizontal_shift(still, frames_of(model, "l", chunks=2)[-1]) == pytest.approx(expected, abs=1.5)
    assert horizontal_shift(still, frames_of(model, "j", chunks=2)[-1]) == pytest.approx(-expected, abs=1.5)


def pitch_displacement(cfg: ToyWorldConfig, degrees: float) -> float:
    """Mean pixels a row's content moves DOWN when the camera looks up by ``degrees`` (a rotation: a row
    at angle ``a`` above the axis goes to ``a - degrees``), over the rows that stay in the frame."""
    f, rows = focal(cfg), np.arange(cfg.height)
    angle = np.arctan((cfg.height / 2 - rows - 0.5) / f)
    moved = cfg.height / 2 - 0.5 - f * np.tan(angle - math.radians(degrees))
    inside = (moved >= 0) & (moved < cfg.height)
    return float(np.mean((moved - rows)[inside]))


def test_looking_up_i_moves_content_down_and_k_up(model):
    cfg = model.config
    still = frames_of(model, "")[-1]
    expected = pitch_displacement(cfg, 8.0)  # 16 frames of i: about f * tan(8 deg) at the centre, more at the edges
    assert focal(cfg) * math.tan(math.radians(8.0)) < expected
    assert vertical_shift(still, frames_of(model, "i", chunks=4)[-1]) == pytest.approx(-expected, abs=1.5)
    assert vertical_shift(still, frames_of(model, "k", chunks=4)[-1]) == pytest.approx(-pitch_displacement(cfg, -8.0), abs=1.5)


def test_w_brings_the_ground_toward_the_camera_and_s_takes_it_away(bare):
    """A ground point ``y`` pixels below the horizon is at depth ``eye_height * f / y``; 0.4 units
    forward move the band 16-32 px below the horizon (depth 7.5-3.75) down by about 1-4 px."""
    cfg = bare.config
    still = frames_of(bare, "")[-1]
    band, centre = slice(cfg.height // 2 + 16, cfg.height // 2 + 32), slice(cfg.width // 2 - 20, cfg.width // 2 + 20)
    assert 1 <= block_shift_down(still, frames_of(bare, "w")[-1], band, centre) <= 4
    assert -4 <= block_shift_down(still, frames_of(bare, "s")[-1], band, centre) <= -1


def test_no_keys_means_a_still_view(model):
    frames = frames_of(model, "", chunks=2)
    for frame in frames[1:]:
        assert abs(horizontal_shift(frames[0], frame)) < 0.3
        assert abs(vertical_shift(frames[0], frame)) < 0.3


# -- a world to walk through ---------------------------------------------------------------------------


def test_a_full_turn_returns_to_the_starting_view():
    cfg = ToyWorldConfig(yaw_step_deg=15.0, **SMALL)  # 24 frames: a full circle in 6 chunks
    model = ToyWorldModel(cfg)
    world = model.encode_world()
    renders = model.render_views(world, [IDENTITY_POSE, Pose(yaw=360.0), Pose(yaw=-720.0)])
    assert torch.allclose(renders[1], renders[0], atol=1e-4) and torch.allclose(renders[2], renders[0], atol=1e-4)
    frames, poses = run_chunks(model, "l", chunks=6)
    start = frames_of(model, "")[-1]
    assert poses[-1].yaw == pytest.approx(360.0)
    assert mean_difference(frames[-1], start) < 1.5
    assert mean_difference(frames[11], start) > 10  # half way round it looks elsewhere


def test_stepping_back_undoes_stepping_forward(small):
    forward, poses = run_chunks(small, "w", chunks=8)
    back, _ = run_chunks(small, "s", chunks=8, pose=poses[-1])
    start = frames_of(small, "")[-1]
    assert mean_difference(forward[-1], start) > 8  # 3.2 units on: another view
    assert mean_difference(back[-1], start) < 1.5  # and back where it started


def test_thirty_seconds_of_walking_forward_keeps_detail_and_passes_objects():
    small = ToyWorldModel(ToyWorldConfig(frames_per_chunk=16, **SMALL))  # long chunks: fewer calls, same path
    cfg = small.config
    chunks = round(30 * cfg.fps / cfg.frames_per_chunk)
    frames, poses = run_chunks(small, "w", chunks=chunks)
    assert len(frames) == 30 * cfg.fps
    stds = [grey(frame).std() for frame in frames]
    edges = [edge_density(frame) for frame in frames]
    assert min(stds) > 12, min(stds)
    assert min(edges) > 0.04, min(edges)
    window = int(5 * cfg.fps)
    starts = list(range(0, len(frames), window))
    seen = [small.visible_objects(poses[i]) for i in starts]
    for earlier, later, i in zip(seen, seen[1:], starts[1:]):
        assert later - earlier, f"nothing new in view at frame {i}"
        assert earlier - later, f"nothing left behind by frame {i}"
    for a, b in zip(starts, starts[1:]):
        assert mean_difference(frames[a], frames[b]) > 8
    assert not (seen[0] & seen[-1])  # after 30 s, none of the first objects is in view


def test_any_resolution_shows_the_same_view(model):
    world = model.encode_world()
    cache = fresh_cache(model.config)
    big, _ = model.generate_chunk(world, IDENTITY_POSE, frozenset(), cache, 0, size=(192, 320))
    default = frames_of(model, "")
    assert big.shape == (4, 192, 320, 3) and cache.shape == fresh_cache(model.config).shape
    halved = big.astype(np.float64).reshape(4, 96, 2, 160, 2, 3).mean(axis=(2, 4))
    assert mean_difference(halved[-1], default[-1]) < 4
    with pytest.raises(ValueError, match="resolution"):
        model.generate_chunk(world, IDENTITY_POSE, frozenset(), cache, 0, size=(96, 1000))
