"""The toy world model (DESIGN §5): real, deterministic for a seed, and its output follows the controls.

Motion is measured on the decoded uint8 frames, never on the model's internals:

- horizontal/vertical shift: the column-mean (row-mean) profile of a grey frame, brute-force shift search
  over the overlapping part, refined to sub-pixel with a parabola through the best three shifts;
- zoom: the best-matching magnification of the identity frame about its centre (grid_sample over a
  range of factors, central crop compared), which is insensitive to the content's colours and layout.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from engine.slots import SlotPoolFullError, SlotReleaseError
from pipelines.toy_world.model import (
    IDENTITY_POSE,
    Pose,
    SessionSlots,
    ToyWorldConfig,
    ToyWorldModel,
    integrate_pose,
)


@pytest.fixture(scope="module")
def model() -> ToyWorldModel:
    return ToyWorldModel(ToyWorldConfig())


def fresh_cache(config: ToyWorldConfig) -> torch.Tensor:
    return torch.zeros(config.cache_frames, config.latent_channels, *config.latent_size)


def run_chunks(model: ToyWorldModel, keys: str, chunks: int = 1, *, image=None, prompt=None) -> np.ndarray:
    """The frames of ``chunks`` chunks from the identity pose with ``keys`` held, concatenated."""
    world = model.encode_world(image, prompt)
    cache = fresh_cache(model.config)
    pose, frames = IDENTITY_POSE, []
    for index in range(chunks):
        chunk, poses = model.generate_chunk(world, pose, frozenset(keys), cache, noise_seed=index)
        frames.append(chunk)
        pose = poses[-1]
    return np.concatenate(frames)


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


def horizontal_shift(reference: np.ndarray, moved: np.ndarray) -> float:
    """Pixels the content moved LEFT (negative: right)."""
    return best_shift(grey(reference).mean(axis=0), grey(moved).mean(axis=0))


def vertical_shift(reference: np.ndarray, moved: np.ndarray) -> float:
    """Pixels the content moved UP (negative: down)."""
    return best_shift(grey(reference).mean(axis=1), grey(moved).mean(axis=1))


def best_zoom(reference: np.ndarray, zoomed: np.ndarray) -> float:
    """The magnification about the centre that best turns ``reference`` into ``zoomed``."""
    ref = torch.from_numpy(grey(reference))[None, None]
    target = torch.from_numpy(grey(zoomed))
    h, w = target.shape
    crop = (slice(h // 5, h - h // 5), slice(w // 5, w - w // 5))
    factors = np.linspace(0.8, 1.4, 61)
    errors = []
    for factor in factors:
        theta = torch.tensor([[[1 / factor, 0, 0], [0, 1 / factor, 0]]], dtype=torch.float64)
        grid = F.affine_grid(theta, [1, 1, h, w], align_corners=False)
        resampled = F.grid_sample(ref, grid, mode="bilinear", align_corners=False)[0, 0]
        errors.append(float(((resampled - target)[crop] ** 2).mean()))
    return float(factors[int(np.argmin(errors))])


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
        ("world_scale", 0),
        ("noise_std", float("nan")),
        ("pitch_limit_deg", 120.0),
    ],
)
def test_config_validation_names_the_field(field, value):
    with pytest.raises(ValueError, match=rf"ToyWorldConfig\.{field}\b"):
        ToyWorldConfig(**{field: value})


def test_config_sizes():
    cfg = ToyWorldConfig()
    assert cfg.latent_channels == 48
    assert cfg.latent_size == (24, 40)
    assert cfg.world_size == (192, 320)
    assert cfg.world_latent_size == (48, 80)


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


def test_pitch_is_clamped_at_the_limit_every_frame():
    cfg = ToyWorldConfig()
    up = integrate_pose(IDENTITY_POSE, frozenset("i"), 200, cfg)
    assert max(p.pitch for p in up) == 85.0 and up[-1].pitch == 85.0
    assert up[169].pitch == pytest.approx(85.0) and up[168].pitch < 85.0
    down = integrate_pose(up[-1], frozenset("k"), 400, cfg)
    assert min(p.pitch for p in down) == -85.0 and down[-1].pitch == -85.0
    # A view at the limit still renders.
    model = ToyWorldModel(cfg)
    view = model.warp_view(model.encode_world(), down[-1])
    assert torch.isfinite(view).all()


def test_integrate_pose_rejects_bad_input():
    cfg = ToyWorldConfig()
    with pytest.raises(ValueError, match="unknown held keys"):
        integrate_pose(IDENTITY_POSE, frozenset({"q"}), 4, cfg)
    with pytest.raises(ValueError, match="frames"):
        integrate_pose(IDENTITY_POSE, frozenset(), 0, cfg)


# -- determinism ---------------------------------------------------------------------------------------


def test_same_seed_same_frames_and_different_seed_different_frames():
    image = np.random.default_rng(5).integers(0, 256, (120, 200, 3), dtype=np.uint8)
    a = run_chunks(ToyWorldModel(ToyWorldConfig(seed=3)), "dl", chunks=3, image=image, prompt="a lake")
    b = run_chunks(ToyWorldModel(ToyWorldConfig(seed=3)), "dl", chunks=3, image=image, prompt="a lake")
    c = run_chunks(ToyWorldModel(ToyWorldConfig(seed=4)), "dl", chunks=3, image=image, prompt="a lake")
    assert a.shape == (12, 96, 160, 3) and a.dtype == np.uint8
    assert np.array_equal(a, b)
    assert not np.array_equal(a, c)


def test_procedural_world_is_deterministic_per_seed():
    w0 = ToyWorldModel(ToyWorldConfig(seed=0)).encode_world()
    assert torch.equal(w0, ToyWorldModel(ToyWorldConfig(seed=0)).encode_world())
    assert not torch.equal(w0, ToyWorldModel(ToyWorldConfig(seed=1)).encode_world())


def test_prompt_changes_the_world_deterministically(model):
    plain = model.encode_world()
    castle = model.encode_world(prompt="a red castle")
    assert torch.equal(castle, model.encode_world(prompt="  a red castle "))
    assert not torch.equal(castle, plain)
    assert not torch.equal(castle, model.encode_world(prompt="a blue sea"))
    assert torch.equal(plain, model.encode_world(prompt="   "))


def test_noise_seed_and_cache_state_change_the_frames(model):
    world = model.encode_world()
    poses = integrate_pose(IDENTITY_POSE, frozenset(), 4, model.config)
    a = model.denoise_chunk(world, poses, fresh_cache(model.config), noise_seed=1)
    b = model.denoise_chunk(world, poses, fresh_cache(model.config), noise_seed=1)
    c = model.denoise_chunk(world, poses, fresh_cache(model.config), noise_seed=2)
    assert torch.equal(a, b) and not torch.equal(a, c)
    warm = fresh_cache(model.config).fill_(0.5)
    assert not torch.equal(a, model.denoise_chunk(world, poses, warm, noise_seed=1))


def test_denoise_rolls_frames_into_the_cache_in_place(model):
    cfg = model.config
    world = model.encode_world()
    cache = fresh_cache(cfg)
    pointer = cache.data_ptr()
    poses = integrate_pose(IDENTITY_POSE, frozenset("d"), 4, cfg)
    latents = model.denoise_chunk(world, poses, cache, noise_seed=0)
    assert cache.data_ptr() == pointer
    assert latents.shape == (4, cfg.latent_channels, *cfg.latent_size)
    assert torch.equal(cache, latents[-cfg.cache_frames :])
    # Content survives the refinement: the frames stay close to the plain warped views.
    views = model.warp_views(world, poses)
    assert float((latents - views).abs().mean()) < 0.05


# -- control response ----------------------------------------------------------------------------------


def expected_pan_pixels(cfg: ToyWorldConfig, pose: Pose) -> float:
    pan = pose.x * cfg.translation_scale * cfg.pan_per_unit + pose.yaw / cfg.fov_deg
    return pan * cfg.width


def test_holding_d_moves_content_left_and_a_moves_it_right(model):
    cfg = model.config
    still = run_chunks(model, "")[-1]
    expected = expected_pan_pixels(cfg, integrate_pose(IDENTITY_POSE, frozenset("d"), 4, cfg)[-1])
    assert expected == pytest.approx(9.6)
    assert horizontal_shift(still, run_chunks(model, "d")[-1]) == pytest.approx(expected, abs=1.0)
    assert horizontal_shift(still, run_chunks(model, "a")[-1]) == pytest.approx(-expected, abs=1.0)
    # Within the chunk the content keeps moving, frame by frame.
    frames = run_chunks(model, "d")
    steps = [horizontal_shift(still, frame) for frame in frames]
    assert steps == sorted(steps) and steps[0] > 1.0


def test_yaw_l_moves_content_left_like_d_and_j_right(model):
    cfg = model.config
    still = run_chunks(model, "")[-1]
    pose = integrate_pose(IDENTITY_POSE, frozenset("l"), 8, cfg)[-1]
    expected = expected_pan_pixels(cfg, pose)  # 4 deg of a 90 deg view, 160 px wide
    assert expected == pytest.approx(4.0 / 90.0 * 160)
    assert horizontal_shift(still, run_chunks(model, "l", chunks=2)[-1]) == pytest.approx(expected, abs=1.0)
    assert horizontal_shift(still, run_chunks(model, "j", chunks=2)[-1]) == pytest.approx(-expected, abs=1.0)


def test_pitch_up_i_moves_content_down(model):
    cfg = model.config
    still = run_chunks(model, "")[-1]
    vfov = cfg.fov_deg * cfg.height / cfg.width
    expected = 8.0 / vfov * cfg.height  # 16 frames of i
    up = vertical_shift(still, run_chunks(model, "i", chunks=4)[-1])
    assert up == pytest.approx(-expected, abs=1.5)
    assert vertical_shift(still, run_chunks(model, "k", chunks=4)[-1]) == pytest.approx(expected, abs=1.5)


def test_holding_w_zooms_in_and_s_zooms_out(model):
    cfg = model.config
    still = run_chunks(model, "")[-1]
    z = integrate_pose(IDENTITY_POSE, frozenset("w"), 4, cfg)[-1].z
    magnification = math.exp(z * cfg.translation_scale * cfg.zoom_rate)  # 1 / window scale
    assert magnification == pytest.approx(1.1275, abs=1e-3)
    assert best_zoom(still, run_chunks(model, "w")[-1]) == pytest.approx(magnification, abs=0.03)
    assert best_zoom(still, run_chunks(model, "s")[-1]) == pytest.approx(1 / magnification, abs=0.03)


def test_no_keys_means_a_still_view(model):
    frames = run_chunks(model, "", chunks=2)
    for frame in frames[1:]:
        assert abs(horizontal_shift(frames[0], frame)) < 0.3
        assert abs(vertical_shift(frames[0], frame)) < 0.3


def test_the_world_wraps_around_horizontally(model):
    cfg = model.config
    world = model.encode_world()
    period_deg = cfg.fov_deg * cfg.world_scale  # the world is world_scale views wide
    for yaw in (period_deg, -period_deg, 3 * period_deg):
        assert torch.allclose(model.warp_view(world, Pose(yaw=yaw)), model.warp_view(world, IDENTITY_POSE), atol=1e-4)


# -- round trip ----------------------------------------------------------------------------------------


def test_encode_decode_round_trip_is_exact_at_the_world_size(model):
    cfg = model.config
    image = np.random.default_rng(0).integers(0, 256, (*cfg.world_size, 3), dtype=np.uint8)
    world = model.encode_world(image)
    assert world.shape == (cfg.latent_channels, *cfg.world_latent_size)
    assert np.abs(model.decode_frames(world[None])[0].astype(int) - image).max() <= 1


def test_identity_view_without_noise_or_refinement_is_the_centre_of_the_image():
    cfg = ToyWorldConfig(noise_std=0.0, refine_steps=0)
    model = ToyWorldModel(cfg)
    image = np.random.default_rng(1).integers(0, 256, (*cfg.world_size, 3), dtype=np.uint8)
    world = model.encode_world(image)
    h, w = cfg.latent_size
    assert torch.allclose(
        model.warp_view(world, IDENTITY_POSE), world[:, h // 2 : h // 2 + h, w // 2 : w // 2 + w], atol=1e-3
    )
    frames, _ = model.generate_chunk(world, IDENTITY_POSE, frozenset(), fresh_cache(cfg), noise_seed=0)
    centre = image[cfg.height // 2 : cfg.height // 2 + cfg.height, cfg.width // 2 : cfg.width // 2 + cfg.width]
    assert frames.shape == (4, cfg.height, cfg.width, 3)
    assert np.abs(frames.astype(int) - centre).max() <= 1


def test_images_of_any_size_are_resized_to_the_world(model):
    cfg = model.config
    small = np.full((30, 50, 3), 200, dtype=np.uint8)
    frames = model.decode_frames(model.encode_world(small)[None])
    assert frames.shape == (1, *cfg.world_size, 3)
    assert np.abs(frames.astype(int) - 200).max() <= 1
    rgba = torch.full((40, 40, 4), 10, dtype=torch.uint8)
    assert np.abs(model.decode_frames(model.encode_world(rgba)[None]).astype(int) - 10).max() <= 1
    with pytest.raises(ValueError, match="uint8"):
        model.encode_world(np.zeros((8, 8, 3), dtype=np.float32))
    with pytest.raises(ValueError, match="H x W x 3"):
        model.encode_world(np.zeros((8, 8), dtype=np.uint8))


# -- session slots -------------------------------------------------------------------------------------


def test_session_slots_reuse_storage_without_growth(model):
    cfg = model.config
    slots = SessionSlots(3, cfg)
    pointers = (slots.worlds.data_ptr(), slots.caches.data_ptr(), slots.poses.data_ptr())
    assert slots.worlds.shape == (3, cfg.latent_channels, *cfg.world_latent_size)
    assert slots.caches.shape == (3, cfg.cache_frames, cfg.latent_channels, *cfg.latent_size)
    assert slots.poses.shape == (3, 4)
    world = model.encode_world()
    seen = set()
    for session in range(50):
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


def test_session_slots_isolate_sessions_and_refuse_misuse(model):
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
    assert slots.bytes_per_session == 4 * cfg.latent_channels * (48 * 80 + cfg.cache_frames * 24 * 40)
