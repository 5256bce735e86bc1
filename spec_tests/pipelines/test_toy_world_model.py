"""The toy world model (DESIGN §5), its parts: config validation and sizes, pose integration, determinism for a
seed (the world, the prompt, the noise and the cache), the image it encodes and the frames it decodes, and session
slots. How the view follows the controls, and a walk through the world: ``test_toy_world_motion.py``.

Everything is measured on the decoded uint8 frames (or on the model's own tensors), never on weights. Most checks
render small frames (the default is 160x96) to stay fast.
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

from .toy_world_helpers import SMALL, fresh_cache, frames_of, grey

pytestmark = pytest.mark.usefixtures("one_intra_op_thread")  # the fixtures are in conftest.py


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
