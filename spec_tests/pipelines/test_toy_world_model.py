"""The toy world model (DESIGN §5): a small 3D world, deterministic for a seed, that follows the controls.

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

from engine.slots import SlotPoolFullError, SlotReleaseError
from pipelines.toy_world.model import (
    IDENTITY_POSE,
    Pose,
    SessionSlots,
    ToyWorldConfig,
    ToyWorldModel,
    integrate_pose,
    parse_resolution,
)

from .toy_world_views import bottom_rows, column_profile, ground_shift_px

SMALL = dict(height=48, width=80)


@pytest.fixture(scope="module", autouse=True)
def one_intra_op_thread():
    """As the service runs its stages (one intra-op thread each): small tensors gain nothing from more."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def model() -> ToyWorldModel:
    return ToyWorldModel(ToyWorldConfig())


@pytest.fixture(scope="module")
def small() -> ToyWorldModel:
    return ToyWorldModel(ToyWorldConfig(**SMALL))


@pytest.fixture(scope="module")
def bare() -> ToyWorldModel:
    """Ground and sky only: for checks about the ground's motion."""
    return ToyWorldModel(ToyWorldConfig(object_density=0.0))


def fresh_cache(config: ToyWorldConfig) -> torch.Tensor:
    return torch.zeros(config.cache_frames, config.latent_channels, *config.latent_size)


def run_chunks(model: ToyWorldModel, keys: str, chunks: int = 1, *, image=None, prompt=None, pose=IDENTITY_POSE):
    """The frames of ``chunks`` chunks from ``pose`` with ``keys`` held, concatenated, and the poses."""
    world = model.encode_world(image, prompt)
    cache = fresh_cache(model.config)
    frames, all_poses = [], []
    for index in range(chunks):
        chunk, poses = model.generate_chunk(world, pose, frozenset(keys), cache, noise_seed=index)
        frames.append(chunk)
        all_poses += poses
        pose = poses[-1]
    return np.concatenate(frames), all_poses


def frames_of(model: ToyWorldModel, keys: str, chunks: int = 1, **kw) -> np.ndarray:
    return run_chunks(model, keys, chunks, **kw)[0]


def grey(frame: np.ndarray) -> np.ndarray:
    return frame.astype(np.float64).mean(axis=-1)


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


# -- config --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("height", 97),  # not a multiple of downscale
        ("width", 0),
        ("frames_per_chunk", 0),
        ("fps", -1.0),
        ("downscale", 0),
        ("refine_steps", -1),
        ("hidden_channels", 1.5),
        ("cache_frames", 0),
        ("seed", -3),
        ("device", "no-such-device"),
        ("dtype", torch.int32),
        ("noise_std", float("nan")),
        ("denoise_rate", 1.5),
        ("pitch_limit_deg", 120.0),
        ("fov_deg", 175.0),
        ("eye_height", 0.0),
        ("cell_size", -1.0),
        ("object_density", 2.0),
        ("view_distance", float("inf")),
        ("texture_size", 0),
    ],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"ToyWorldConfig\.{field}\b"):
        ToyWorldConfig(**{field: value})


def test_config_sizes():
    cfg = ToyWorldConfig()
    assert cfg.latent_channels == 48
    assert cfg.latent_size == (24, 40)
    assert cfg.resolution == (96, 160)
    assert cfg.appearance_numel == 3 * 64 * 64 * 4 + 8 * 3 + 3 * 3 + 4


def test_resolution_option_is_parsed_and_bounded():
    cfg = ToyWorldConfig()
    assert parse_resolution("832x480", cfg) == (480, 832)
    assert parse_resolution(" 320 X 192 ", cfg) == (192, 320)
    assert parse_resolution([96, 64], cfg) == (64, 96)
    for bad, why in (
        ("836x480", "width must be an int in"),
        ("832x484", "height must be an int in"),
        ("162x96", "multiple of 4"),
        ("160 by 96", "must be 'WxH'"),
        ([160], "must be 'WxH'"),
        (160, "must be 'WxH'"),
        ([160.0, 96], "width must be an int"),
    ):
        with pytest.raises(ValueError, match=rf"option 'resolution'.*{why}"):
            parse_resolution(bad, cfg)


# -- pose ----------------------------------------------------------------------------------------------


def test_integrate_pose_steps_once_per_video_frame():
    cfg = ToyWorldConfig()
    poses = integrate_pose(IDENTITY_POSE, frozenset("w"), 4, cfg)
    assert [p.z for p in poses] == pytest.approx([0.1, 0.2, 0.3, 0.4])
    assert all(p.x == p.yaw == p.pitch == 0 for p in poses)
    # The next chunk continues from the last pose.
    more = integrate_pose(poses[-1], frozenset("w"), 4, cfg)
    assert [p.z for p in more] == pytest.approx([0.5, 0.6, 0.7, 0.8])


def test_integrate_pose_key_signs_and_cancellation():
    cfg = ToyWorldConfig()

    def last(keys: str, frames: int = 4) -> Pose:
        return integrate_pose(IDENTITY_POSE, frozenset(keys), frames, cfg)[-1]

    assert last("d").x == pytest.approx(0.4) and last("a").x == pytest.approx(-0.4)
    assert last("s").z == pytest.approx(-0.4)
    assert last("l").yaw == pytest.approx(2.0) and last("j").yaw == pytest.approx(-2.0)
    assert last("i").pitch == pytest.approx(2.0) and last("k").pitch == pytest.approx(-2.0)
    assert last("wsadjlik") == IDENTITY_POSE  # opposite keys cancel
    assert last("wd").as_tuple() == pytest.approx((0.4, 0.4, 0.0, 0.0))


def test_steps_go_along_the_heading():
    cfg = ToyWorldConfig()
    east = Pose(yaw=90.0)
    ahead = integrate_pose(east, frozenset("w"), 10, cfg)[-1]
    assert (ahead.x, ahead.z) == pytest.approx((1.0, 0.0), abs=1e-9)
    right = integrate_pose(east, frozenset("d"), 10, cfg)[-1]
    assert (right.x, right.z) == pytest.approx((0.0, -1.0), abs=1e-9)  # facing east, right is south
    # Turning while walking bends the path the way of the turn (to the right for "l").
    arc = integrate_pose(IDENTITY_POSE, frozenset("wl"), 40, cfg)[-1]
    assert arc.x > 0.5 and 0 < arc.z < 4.0 and arc.yaw == pytest.approx(20.0)


def test_pitch_is_clamped_at_the_limit_every_frame(small):
    cfg = ToyWorldConfig()
    up = integrate_pose(IDENTITY_POSE, frozenset("i"), 200, cfg)
    assert max(p.pitch for p in up) == 85.0 and up[-1].pitch == 85.0
    assert up[169].pitch == pytest.approx(85.0) and up[168].pitch < 85.0
    down = integrate_pose(up[-1], frozenset("k"), 400, cfg)
    assert min(p.pitch for p in down) == -85.0 and down[-1].pitch == -85.0
    # Views at the limits still render.
    world = small.encode_world()
    for pose in (up[-1], down[-1]):
        assert torch.isfinite(small.render_views(world, [pose])).all()


def test_integrate_pose_rejects_bad_input():
    cfg = ToyWorldConfig()
    with pytest.raises(ValueError, match="unknown held keys"):
        integrate_pose(IDENTITY_POSE, frozenset({"q"}), 4, cfg)
    with pytest.raises(ValueError, match="frames"):
        integrate_pose(IDENTITY_POSE, frozenset(), 0, cfg)


# -- determinism ---------------------------------------------------------------------------------------


def test_same_seed_same_frames_and_different_seed_different_frames():
    image = np.random.default_rng(5).integers(0, 256, (120, 200, 3), dtype=np.uint8)
    a = frames_of(ToyWorldModel(ToyWorldConfig(seed=3, **SMALL)), "wl", chunks=3, image=image, prompt="a lake")
    b = frames_of(ToyWorldModel(ToyWorldConfig(seed=3, **SMALL)), "wl", chunks=3, image=image, prompt="a lake")
    c = frames_of(ToyWorldModel(ToyWorldConfig(seed=4, **SMALL)), "wl", chunks=3, image=image, prompt="a lake")
    assert a.shape == (12, 48, 80, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_procedural_world_is_deterministic_per_seed():
    w0 = ToyWorldModel(ToyWorldConfig(seed=0)).encode_world()
    assert torch.equal(w0, ToyWorldModel(ToyWorldConfig(seed=0)).encode_world())
    assert not torch.equal(w0, ToyWorldModel(ToyWorldConfig(seed=1)).encode_world())


def test_objects_are_placed_per_cell_by_the_seed():
    one, other = ToyWorldConfig(seed=0), ToyWorldConfig(seed=1)
    ahead = Pose(z=40.0)
    seen = ToyWorldModel(one).visible_objects(ahead)
    assert seen and seen == ToyWorldModel(one).visible_objects(ahead)
    assert seen != ToyWorldModel(other).visible_objects(ahead)


def test_prompt_changes_the_world_deterministically(model):
    plain = model.encode_world()
    castle = model.encode_world(prompt="a red castle")
    assert torch.equal(castle, model.encode_world(prompt="  a red castle "))
    assert not torch.equal(castle, plain)
    assert not torch.equal(castle, model.encode_world(prompt="a blue sea"))
    assert torch.equal(plain, model.encode_world(prompt="   "))
    assert torch.equal(model.condition_on_prompt(plain, "a red castle"), castle)


def test_prompt_words_set_the_time_of_day_and_weather(small):
    def mean_grey(prompt: str | None) -> float:
        return float(grey(frames_of(small, "", prompt=prompt)[-1]).mean())

    day = mean_grey(None)
    assert mean_grey("a quiet night") < 0.6 * day
    assert mean_grey("snow everywhere") > day
    foggy, clear = frames_of(small, "", prompt="thick fog"), frames_of(small, "", prompt="thick air")
    assert grey(foggy[-1]).std() < grey(clear[-1]).std()  # fog washes detail out
    sunset = frames_of(small, "", prompt="sunset")[-1].astype(np.float64)
    assert sunset[:8, :, 0].mean() > sunset[:8, :, 2].mean()  # a warm sky


def test_noise_seed_and_cache_state_change_the_frames(small):
    world = small.encode_world()
    poses = integrate_pose(IDENTITY_POSE, frozenset(), 4, small.config)
    a = small.denoise_chunk(world, poses, fresh_cache(small.config), noise_seed=1)
    b = small.denoise_chunk(world, poses, fresh_cache(small.config), noise_seed=1)
    c = small.denoise_chunk(world, poses, fresh_cache(small.config), noise_seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    warm = fresh_cache(small.config).fill_(0.5)
    assert not torch.equal(a, small.denoise_chunk(world, poses, warm, noise_seed=1))


def test_denoise_refines_toward_the_render_and_rolls_frames_into_the_cache(small):
    cfg = small.config
    world = small.encode_world()
    cache = fresh_cache(cfg)
    pointer = cache.data_ptr()
    poses = integrate_pose(IDENTITY_POSE, frozenset("d"), 4, cfg)
    latents = small.denoise_chunk(world, poses, cache, noise_seed=0)
    assert cache.data_ptr() == pointer
    assert latents.shape == (4, cfg.latent_channels, *cfg.latent_size)
    assert torch.equal(cache, latents[-cfg.cache_frames :])
    # The refinement ends close to the clean render: closer than the noise it started from.
    clean = small.encode_views(small.render_views(world, poses))
    assert float((latents - clean).abs().mean()) < 0.6 * cfg.noise_std * math.sqrt(2 / math.pi)
    unrefined = ToyWorldModel(attrs_evolve(cfg, refine_steps=0)).denoise_chunk(world, poses, fresh_cache(cfg), 0)
    assert float((unrefined - clean).abs().mean()) == pytest.approx(cfg.noise_std * math.sqrt(2 / math.pi), rel=0.05)


def attrs_evolve(cfg: ToyWorldConfig, **changes) -> ToyWorldConfig:
    import attrs

    return attrs.evolve(cfg, **changes)


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


# -- encode and decode ---------------------------------------------------------------------------------


def test_the_image_decides_how_the_world_looks(small):
    red = np.zeros((60, 90, 3), dtype=np.uint8)
    red[..., 0] = 220
    blue = np.zeros((60, 90, 3), dtype=np.uint8)
    blue[..., 2] = 220
    on_red = frames_of(small, "", image=red)[-1].astype(np.float64)
    on_blue = frames_of(small, "", image=blue)[-1].astype(np.float64)
    ground = slice(small.config.height * 3 // 4, None)
    assert on_red[ground, :, 0].mean() > on_red[ground, :, 2].mean() + 30
    assert on_blue[ground, :, 2].mean() > on_blue[ground, :, 0].mean() + 30


def test_images_of_any_size_are_accepted_and_bad_ones_refused(small):
    for image in (np.full((30, 50, 3), 200, dtype=np.uint8), torch.full((40, 40, 4), 10, dtype=torch.uint8)):
        assert small.encode_world(image).shape == (small.config.appearance_numel,)
    with pytest.raises(ValueError, match="uint8"):
        small.encode_world(np.zeros((8, 8, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="H x W x 3"):
        small.encode_world(np.zeros((8, 8), dtype=np.uint8))
    with pytest.raises(ValueError, match="appearance"):
        small.render_views(torch.zeros(10), [IDENTITY_POSE])


def test_decode_inverts_the_latent_encoding_of_a_frame(small):
    cfg = small.config
    pixels = torch.from_numpy(np.random.default_rng(0).integers(0, 256, (2, 3, cfg.height, cfg.width))).float() / 127.5 - 1
    frames = small.decode_frames(small.encode_views(pixels))
    expected = ((pixels + 1) * 127.5).round().permute(0, 2, 3, 1).numpy()
    assert frames.shape == (2, cfg.height, cfg.width, 3)
    assert np.abs(frames.astype(int) - expected).max() <= 1


# -- session slots -------------------------------------------------------------------------------------


def test_session_slots_reuse_storage_without_growth(small):
    model = small
    cfg = model.config
    slots = SessionSlots(3, cfg)
    pointers = (slots.worlds.data_ptr(), slots.caches.data_ptr(), slots.poses.data_ptr())
    assert slots.worlds.shape == (3, cfg.appearance_numel)
    assert slots.caches.shape == (3, cfg.cache_frames, cfg.latent_channels, *cfg.latent_size)
    assert slots.poses.shape == (3, 4)
    world = model.encode_world()
    seen = set()
    for session in range(12):
        slot = slots.acquire()
        seen.add(slot)
        assert not slots.worlds[slot].any() and not slots.caches[slot].any() and not slots.poses[slot].any()
        slots.world(slot).copy_(world)
        _, poses = model.generate_chunk(
            slots.world(slot), slots.pose(slot), frozenset("d"), slots.cache(slot), noise_seed=session
        )
        slots.set_pose(slot, poses[-1])
        assert slots.pose(slot) == poses[-1]
        assert slots.caches[slot].any()
        slots.release(slot)
        assert not slots.worlds[slot].any() and not slots.caches[slot].any() and not slots.poses[slot].any()
    assert seen == {0}  # LIFO: the released slot is reused
    assert (slots.worlds.data_ptr(), slots.caches.data_ptr(), slots.poses.data_ptr()) == pointers


def test_session_slots_isolate_sessions_and_refuse_misuse(small):
    model = small
    cfg = model.config
    slots = SessionSlots(2, cfg)
    a, b = slots.acquire(), slots.acquire()
    with pytest.raises(SlotPoolFullError):
        slots.acquire()
    world = model.encode_world()
    slots.world(a).copy_(world)
    model.denoise_chunk(slots.world(a), [IDENTITY_POSE] * 4, slots.cache(a), noise_seed=0)
    assert slots.caches[a].any() and not slots.caches[b].any() and not slots.worlds[b].any()
    slots.release(a)
    with pytest.raises(SlotReleaseError):
        slots.release(a)
    with pytest.raises(ValueError, match="not in use"):
        slots.cache(a)
    assert slots.bytes_per_session == 4 * (cfg.appearance_numel + cfg.cache_frames * cfg.latent_channels * 12 * 20)
