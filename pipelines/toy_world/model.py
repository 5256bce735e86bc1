"""A small, real torch world model: encode a world's look, denoise a chunk of views along a camera path, decode.

Three stages, as in the seeds (DESIGN §5):

1. :meth:`ToyWorldModel.encode_world` — the reference image (or, without one, a seeded procedural
   picture) to the world's latent *appearance*: textures, a palette and sky colours sampled from the
   image, packed in one flat tensor (:mod:`.appearance`). Once per session.
2. :meth:`ToyWorldModel.denoise_chunk` — per video frame: render the world at that frame's pose
   (:mod:`.render`: ground with perspective and a horizon, sky, objects placed per world cell from
   the seed), encode the render into the latent basis (``pixel_unshuffle(downscale)`` and an
   orthogonal 1x1 projection), start from it plus noise from the session's generator and run
   ``refine_steps`` steps of iterative refinement: each step pulls the latent toward the render by
   ``denoise_rate`` and adds a small seeded conv net's residual conditioned on the mean of the
   session's recent-latent cache; the frame is then rolled into the cache in place, so the cache
   carries state from chunk to chunk. The cache is stored at the default resolution's latent size
   (other resolutions are resized into and out of it), so a session's storage does not depend on
   the resolution it asks for.
3. :meth:`ToyWorldModel.decode_frames` — inverse projection, ``pixel_shuffle``, clamp, uint8.

Controls move the camera (:mod:`.pose`): ``w``/``s`` walk along the heading, ``a``/``d`` strafe,
``j``/``l`` turn, ``i``/``k`` look up/down. The prompt conditions the next chunk: it changes the
appearance (time of day, weather, a palette shift; :func:`.appearance.condition_appearance`).

Resolution: the config's ``height x width`` (default 160x96) is the default; a session may ask for any
``WxH`` with both multiples of ``downscale`` up to ``max_width x max_height`` (832x480), see
:func:`parse_resolution`.

Everything is deterministic for a seed: the weights come from ``torch.Generator(seed)`` in
``__init__`` (no files), the objects from integer hashes of their cells, the noise from a generator
seeded with ``noise_seed`` per chunk.
"""

from __future__ import annotations

import math
import re
from collections.abc import Sequence

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from engine.slots import SlotPool
from pipelines.json_objects import as_json

from .appearance import appearance_numel, condition_appearance, encode_appearance, image_to_picture
from .pose import IDENTITY_POSE, Pose, integrate_pose
from .render import noise_lattice, render_views, visible_objects

__all__ = [
    "IDENTITY_POSE", "MAX_SEED", "Pose", "SessionSlots", "ToyWorldConfig", "ToyWorldModel", "chunk_noise_seed",
    "integrate_pose", "parse_resolution",
]
def _positive_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"ToyWorldConfig.{attribute.name} must be an int >= 1, got {value!r}")


def _non_negative_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"ToyWorldConfig.{attribute.name} must be an int >= 0, got {value!r}")


#: the largest seed: a generator takes it (``manual_seed`` of the weights) as a signed 64-bit int, and ``chunkline run
#: --seed`` takes 0 to it
MAX_SEED = 2**63 - 1
#: a torch generator's seeds are 0 to 2**64 - 1 (one past: ``Overflow when unpacking long long``)
_GENERATOR_SEEDS = 1 << 64
#: a chunk's noise seed is the world's seed times this, plus the chunk's index (odd: see :func:`chunk_noise_seed`)
_NOISE_SEED_STRIDE = 1_000_003


def chunk_noise_seed(seed: int, index: int) -> int:
    """The seed of chunk ``index``'s noise in a world of ``seed``: ``seed * 1_000_003 + index``, reduced mod 2**64 into
    a generator's range. Every seed and chunk that fitted keeps its noise, and so its frames; past 2**64 (a seed from
    2**44 on) it failed the run, ``Overflow when unpacking long long``. The stride is odd, so the reduction keeps two
    seeds' noise for the same chunk apart; the small seeds of common use share none of their first 1,000,003
    chunks' noise."""
    return (seed * _NOISE_SEED_STRIDE + index) % _GENERATOR_SEEDS


def _seed(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or not 0 <= value <= MAX_SEED:
        raise ValueError(f"ToyWorldConfig.{attribute.name} must be an int from 0 to 2**63-1, got {value!r}")


def _positive_float(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not (math.isfinite(value) and value > 0):
        raise ValueError(f"ToyWorldConfig.{attribute.name} must be a finite number > 0, got {value!r}")


def _non_negative_float(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not (math.isfinite(value) and value >= 0):
        raise ValueError(f"ToyWorldConfig.{attribute.name} must be a finite number >= 0, got {value!r}")


def _device(instance: object, attribute: attrs.Attribute, value: object) -> None:
    try:
        torch.device(value)  # type: ignore[arg-type]
    except (RuntimeError, TypeError) as exc:
        raise ValueError(f"ToyWorldConfig.{attribute.name} is not a torch device: {value!r}") from exc


def _float_dtype(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, torch.dtype) or not value.is_floating_point:
        raise ValueError(f"ToyWorldConfig.{attribute.name} must be a floating torch dtype, got {value!r}")


def _unit_interval(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int | float) or isinstance(value, bool) or not (math.isfinite(value) and 0 <= value <= 1):
        raise ValueError(f"ToyWorldConfig.{attribute.name} must be a number in [0, 1], got {value!r}")


@attrs.frozen
class ToyWorldConfig:
    """Sizes, rates, world layout and seed of the toy world model; every field is validated (errors name the field)."""

    height: int = attrs.field(default=96, validator=_positive_int)
    width: int = attrs.field(default=160, validator=_positive_int)
    frames_per_chunk: int = attrs.field(default=4, validator=_positive_int)
    fps: float = attrs.field(default=16.0, validator=_positive_float)
    downscale: int = attrs.field(default=4, validator=_positive_int)
    refine_steps: int = attrs.field(default=2, validator=_non_negative_int)
    hidden_channels: int = attrs.field(default=32, validator=_positive_int)
    cache_frames: int = attrs.field(default=4, validator=_positive_int)  # recent latents kept per session
    seed: int = attrs.field(default=0, validator=_seed)
    device: str = attrs.field(default="cpu", validator=_device)
    dtype: torch.dtype = attrs.field(default=torch.float32, validator=_float_dtype)
    # Denoising.
    noise_std: float = attrs.field(default=0.02, validator=_non_negative_float)
    denoise_rate: float = attrs.field(default=0.5, validator=_unit_interval)
    step_size: float = attrs.field(default=0.1, validator=_non_negative_float)
    # Controls (reference C.5 defaults): per video frame.
    move_step: float = attrs.field(default=0.10, validator=_positive_float)
    lateral_step: float = attrs.field(default=0.10, validator=_positive_float)
    yaw_step_deg: float = attrs.field(default=0.5, validator=_positive_float)
    pitch_step_deg: float = attrs.field(default=0.5, validator=_positive_float)
    pitch_limit_deg: float = attrs.field(default=85.0, validator=_positive_float)
    # The camera and the world (world units; :mod:`.render`).
    fov_deg: float = attrs.field(default=90.0, validator=_positive_float)
    eye_height: float = attrs.field(default=1.5, validator=_positive_float)
    cell_size: float = attrs.field(default=4.0, validator=_positive_float)
    object_density: float = attrs.field(default=0.5, validator=_unit_interval)
    view_distance: float = attrs.field(default=32.0, validator=_positive_float)
    ground_tile: float = attrs.field(default=6.0, validator=_positive_float)
    texture_size: int = attrs.field(default=64, validator=_positive_int)
    # The largest resolution a session may ask for.
    max_height: int = attrs.field(default=480, validator=_positive_int)
    max_width: int = attrs.field(default=832, validator=_positive_int)

    def __attrs_post_init__(self) -> None:
        for name in ("height", "width"):
            if getattr(self, name) % self.downscale:
                raise ValueError(
                    f"ToyWorldConfig.{name} must be a multiple of downscale={self.downscale}, got {getattr(self, name)}"
                )
        if self.pitch_limit_deg > 89:
            raise ValueError(f"ToyWorldConfig.pitch_limit_deg must be <= 89, got {self.pitch_limit_deg}")
        if self.fov_deg >= 170:
            raise ValueError(f"ToyWorldConfig.fov_deg must be < 170, got {self.fov_deg}")

    @property
    def latent_channels(self) -> int:
        return 3 * self.downscale**2

    @property
    def latent_size(self) -> tuple[int, int]:
        """``(h, w)`` of one view latent at the default resolution (also the cache's size)."""
        return (self.height // self.downscale, self.width // self.downscale)

    @property
    def resolution(self) -> tuple[int, int]:
        """The default ``(height, width)`` of a frame."""
        return (self.height, self.width)

    @property
    def world_size(self) -> tuple[int, int]:
        """``(H, W)`` a reference image is read at, at most (twice the default frame: the encoder samples
        ``texture_size`` textures from it, so more pixels would add nothing)."""
        return (2 * self.height, 2 * self.width)

    @property
    def appearance_numel(self) -> int:
        """Length of the packed appearance tensor (a session's world)."""
        return appearance_numel(self.texture_size)

    def check_resolution(self, height: int, width: int) -> tuple[int, int]:
        """``(height, width)`` if a session may ask for it, else a ``ValueError`` naming ``resolution``."""
        for name, value, limit in (("width", width, self.max_width), ("height", height, self.max_height)):
            if not isinstance(value, int) or isinstance(value, bool) or value < self.downscale or value > limit:
                raise ValueError(f"option 'resolution': {name} must be an int in [{self.downscale}, {limit}], got {as_json(value)}")
            if value % self.downscale:
                raise ValueError(f"option 'resolution': {name} must be a multiple of {self.downscale}, got {value}")
        return (height, width)


_RESOLUTION = re.compile(r"\s*([0-9]{1,5})\s*[xX]\s*([0-9]{1,5})\s*")  # fullmatch: ASCII digits only


def parse_resolution(value: object, config: ToyWorldConfig) -> tuple[int, int]:
    """``(height, width)`` of a session's ``resolution`` option: ``"WxH"`` (e.g. ``"832x480"``) or ``[W, H]``."""
    if isinstance(value, str):
        match = _RESOLUTION.fullmatch(value)
        if match is None:
            raise ValueError(f"option 'resolution' must be 'WxH' (e.g. 320x192), got {as_json(value)}")
        width, height = int(match.group(1)), int(match.group(2))
    elif isinstance(value, list | tuple) and len(value) == 2:
        width, height = value
    else:
        raise ValueError(f"option 'resolution' must be 'WxH' (e.g. 320x192) or [W, H], got {as_json(value)}")
    return config.check_resolution(height, width)


class ToyWorldModel:
    """The three stages of the toy world; weights are seeded in ``__init__`` (no files).

    Holds no per-session state: a session's world (appearance), cache and pose live in
    :class:`SessionSlots` and are passed in. Calls that share a cache must be serialized by the
    caller (one chunk at a time).
    """

    def __init__(self, config: ToyWorldConfig | None = None) -> None:
        self.config = cfg = config if config is not None else ToyWorldConfig()
        self.device = torch.device(cfg.device)
        c, hidden = cfg.latent_channels, cfg.hidden_channels
        gen = torch.Generator().manual_seed(cfg.seed)
        # Orthogonal 1x1 projection (QR of a Gaussian, signs fixed so it is unique for the seed).
        q, r = torch.linalg.qr(torch.randn(c, c, generator=gen, dtype=torch.float64))
        q = q * torch.sign(torch.diagonal(r)).unsqueeze(0)
        self._proj = q.to(self.device, cfg.dtype).contiguous()  # latent = proj @ unshuffled
        self._proj_inv = q.T.to(self.device, cfg.dtype).contiguous()

        def conv(cout: int, cin: int, k: int, gain: float) -> tuple[torch.Tensor, torch.Tensor]:
            w = torch.randn(cout, cin, k, k, generator=gen) * (gain / math.sqrt(cin * k * k))
            b = torch.randn(cout, generator=gen) * 0.01
            return w.to(self.device, cfg.dtype), b.to(self.device, cfg.dtype)

        # Residual refiner: [frame, cache mean] -> 3x3 -> SiLU -> 3x3 -> SiLU -> 1x1 (small output).
        self._w1, self._b1 = conv(hidden, 2 * c, 3, math.sqrt(2.0))
        self._w2, self._b2 = conv(hidden, hidden, 3, math.sqrt(2.0))
        self._w3, self._b3 = conv(c, hidden, 1, 0.5)
        self._lattice = noise_lattice(cfg.seed).to(self.device, cfg.dtype)

    # -- stage 1: encode ---------------------------------------------------------------------------

    @torch.no_grad()
    def encode_world(self, image: np.ndarray | torch.Tensor | None = None, prompt: str | None = None) -> torch.Tensor:
        """The world's packed appearance for an ``H x W x 3`` uint8 image (any size) or, for ``None``,
        the seed's procedural picture; ``prompt`` conditions it (:meth:`condition_on_prompt`)."""
        cfg = self.config
        picture = None if image is None else image_to_picture(image)
        packed = encode_appearance(picture, cfg.seed, cfg.texture_size).pack()
        return self.condition_on_prompt(packed.to(self.device, cfg.dtype), prompt).contiguous()

    def condition_on_prompt(self, world: torch.Tensor, prompt: str | None) -> torch.Tensor:
        """The world as ``prompt`` conditions it (a new tensor; the input is unchanged). Cheap, so a
        new prompt conditions the next chunk without re-encoding the image."""
        self._check_world(world)
        return condition_appearance(world, prompt, self.config.seed, self.config.texture_size)

    def _check_world(self, world: torch.Tensor) -> None:
        expected = (self.config.appearance_numel,)
        if tuple(world.shape) != expected:
            raise ValueError(f"world (appearance) must have shape {expected}, got {tuple(world.shape)}")

    # -- the world's geometry ------------------------------------------------------------------------

    def _size(self, size: tuple[int, int] | None) -> tuple[int, int]:
        return self.config.resolution if size is None else self.config.check_resolution(*size)

    @torch.no_grad()
    def render_views(
        self, world: torch.Tensor, poses: Sequence[Pose], size: tuple[int, int] | None = None
    ) -> torch.Tensor:
        """Clean renders ``T x 3 x H x W`` in ``[-1, 1]`` of the world at ``poses`` (``size = (H, W)``)."""
        self._check_world(world)
        height, width = self._size(size)
        return render_views(world, poses, height, width, self.config, self._lattice)

    def visible_objects(self, pose: Pose, size: tuple[int, int] | None = None) -> set[tuple[int, int]]:
        """The world cells whose object is in view at ``pose`` (what a frame there shows)."""
        height, width = self._size(size)
        return visible_objects(pose, height, width, self.config)

    def encode_views(self, pixels: torch.Tensor) -> torch.Tensor:
        """``T x 3 x H x W`` pixels in ``[-1, 1]`` to latents ``T x C x H/downscale x W/downscale``."""
        unshuffled = F.pixel_unshuffle(pixels.to(self.device, self.config.dtype), self.config.downscale)
        return torch.einsum("dc,tchw->tdhw", self._proj, unshuffled).contiguous()

    # -- stage 2: denoise ----------------------------------------------------------------------------

    def _refine(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = F.silu(F.conv2d(torch.cat((x, cond), dim=1), self._w1, self._b1, padding=1))
        h = F.silu(F.conv2d(h, self._w2, self._b2, padding=1))
        return F.conv2d(h, self._w3, self._b3)

    @torch.no_grad()
    def denoise_chunk(
        self,
        world: torch.Tensor,
        poses: Sequence[Pose],
        cache: torch.Tensor,
        noise_seed: int,
        size: tuple[int, int] | None = None,
    ) -> torch.Tensor:
        """Latents ``T x C x h x w`` for the frames at ``poses``; ``cache`` (``K x C x h0 x w0``, the
        session's slot, at the default latent size) is conditioned on and updated in place, oldest
        frame first."""
        cfg = self.config
        expected = (cfg.cache_frames, cfg.latent_channels, *cfg.latent_size)
        if tuple(cache.shape) != expected:
            raise ValueError(f"cache must have shape {expected}, got {tuple(cache.shape)}")
        target = self.encode_views(self.render_views(world, poses, size))
        views = target.clone()
        if cfg.noise_std > 0:
            gen = torch.Generator().manual_seed(int(noise_seed))
            noise = torch.randn(views.shape, generator=gen, dtype=torch.float32)
            views.add_(noise.to(self.device, cfg.dtype), alpha=cfg.noise_std)
        latent_size = tuple(views.shape[-2:])
        resized = latent_size != cfg.latent_size
        keep = cfg.cache_frames
        for t in range(views.shape[0]):
            x, clean = views[t : t + 1], target[t : t + 1]
            cond = cache.mean(dim=0, keepdim=True)
            if resized:
                cond = F.interpolate(cond, size=latent_size, mode="bilinear", align_corners=False)
            for _ in range(cfg.refine_steps):
                x = x + cfg.denoise_rate * (clean - x) + cfg.step_size * self._refine(x, cond)
            views[t].copy_(x[0])
            for k in range(keep - 1):  # roll in place: no new storage for the session
                cache[k].copy_(cache[k + 1])
            if resized:
                x = F.interpolate(x, size=cfg.latent_size, mode="bilinear", align_corners=False, antialias=True)
            cache[keep - 1].copy_(x[0])
        return views

    # -- stage 3: decode -----------------------------------------------------------------------------

    @torch.no_grad()
    def decode_frames(self, latents: torch.Tensor) -> np.ndarray:
        """``T x C x h x w`` latents (any ``h, w``) to ``T x (h*downscale) x (w*downscale) x 3`` uint8."""
        cfg = self.config
        if latents.ndim != 4 or latents.shape[1] != cfg.latent_channels:
            raise ValueError(f"latents must be T x {cfg.latent_channels} x h x w, got {tuple(latents.shape)}")
        unshuffled = torch.einsum("dc,tchw->tdhw", self._proj_inv, latents.to(self.device, cfg.dtype))
        pixels = F.pixel_shuffle(unshuffled, cfg.downscale)
        frames = ((pixels.float() + 1.0) * 127.5).round_().clamp_(0, 255).to(torch.uint8)
        return frames.permute(0, 2, 3, 1).contiguous().cpu().numpy()

    # -- convenience ---------------------------------------------------------------------------------

    def generate_chunk(
        self,
        world: torch.Tensor,
        pose: Pose,
        held_keys: frozenset[str],
        cache: torch.Tensor,
        noise_seed: int,
        size: tuple[int, int] | None = None,
    ) -> tuple[np.ndarray, list[Pose]]:
        """All three stages' middle and end for one chunk: ``(frames, per-frame poses)``; the last
        pose is the one to carry into the next chunk."""
        poses = integrate_pose(pose, held_keys, self.config.frames_per_chunk, self.config)
        return self.decode_frames(self.denoise_chunk(world, poses, cache, noise_seed, size)), poses


class SessionSlots:
    """Preallocated per-session storage: world latents, recent-latent caches and poses, by slot.

    ``worlds``: ``[capacity, appearance_numel]`` (packed appearances) and ``caches``: ``[capacity, K, C, h, w]`` on the model
    device; ``poses``: ``[capacity, 4]`` float64 on the CPU (rows ``(x, z, yaw, pitch)``: control state,
    read by the host every chunk). Sessions only borrow slot ids from an :class:`engine.slots.SlotPool`;
    nothing is allocated per session or per chunk.
    """

    def __init__(self, capacity: int, config: ToyWorldConfig, name: str = "Toy world session") -> None:
        self.pool = SlotPool(capacity, name=name)
        c, (h, w) = config.latent_channels, config.latent_size
        device = torch.device(config.device)
        self.worlds = torch.zeros(capacity, config.appearance_numel, device=device, dtype=config.dtype)
        self.caches = torch.zeros(capacity, config.cache_frames, c, h, w, device=device, dtype=config.dtype)
        self.poses = torch.zeros(capacity, 4, dtype=torch.float64)

    @property
    def capacity(self) -> int:
        return self.pool.capacity

    @property
    def bytes_per_session(self) -> int:
        """Device bytes one slot holds (for memory budgets)."""
        return (self.worlds[0].numel() * self.worlds.element_size()) + (
            self.caches[0].numel() * self.caches.element_size()
        )

    def acquire(self) -> int:
        """A free slot (zeroed storage); raises ``SlotPoolFullError`` when all are in use."""
        return self.pool.acquire()

    def release(self, slot: int) -> None:
        """Zero the slot's storage and return it to the pool (``SlotReleaseError`` if not in use)."""
        if slot not in self.pool.in_use_slots():
            self.pool.release(slot)  # raises the pool's SlotReleaseError, naming the pool
        self.worlds[slot].zero_()
        self.caches[slot].zero_()
        self.poses[slot].zero_()
        self.pool.release(slot)

    def world(self, slot: int) -> torch.Tensor:
        """The slot's world (packed appearance; a view: write it with ``copy_``)."""
        self._check_in_use(slot)
        return self.worlds[slot]

    def cache(self, slot: int) -> torch.Tensor:
        """The slot's cache ``K x C x h x w`` (a view, updated in place by ``denoise_chunk``)."""
        self._check_in_use(slot)
        return self.caches[slot]

    def pose(self, slot: int) -> Pose:
        self._check_in_use(slot)
        return Pose.from_sequence(self.poses[slot].tolist())

    def set_pose(self, slot: int, pose: Pose) -> None:
        self._check_in_use(slot)
        for index, value in enumerate(pose.as_tuple()):
            self.poses[slot, index] = value

    def _check_in_use(self, slot: int) -> None:
        if slot not in self.pool.in_use_slots():
            raise ValueError(f"{self.pool.name} slot {slot!r} is not in use")
