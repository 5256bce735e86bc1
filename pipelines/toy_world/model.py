"""A small, real torch world model: encode a world, denoise a chunk of views along a camera path, decode.

Three stages, as in the seeds (DESIGN §5):

1. :meth:`ToyWorldModel.encode_world` — an RGB image (or, without one, a procedural scene from the seed)
   resized to the *world* size ``(height * world_scale, width * world_scale)``, optionally tinted by the
   prompt, then ``pixel_unshuffle(downscale)`` and an orthogonal 1x1 projection: a latent world of
   ``C = 3 * downscale**2`` channels that :meth:`decode_frames` inverts exactly.
2. :meth:`ToyWorldModel.denoise_chunk` — per video frame: warp a view window out of the latent world at
   that frame's pose, add a little seeded noise, run ``refine_steps`` small residual steps of a seeded
   conv net conditioned on the mean of the session's recent-latent cache, and roll the frame into the
   cache in place.
3. :meth:`ToyWorldModel.decode_frames` — inverse projection, ``pixel_shuffle``, clamp, uint8.

View geometry (:meth:`ToyWorldModel.warp_view`, ``F.affine_grid`` + ``F.grid_sample``, bilinear, applied
in the latent's pixel basis so motion is smooth below the ``downscale`` block); content always moves
opposite to the camera:

- identity pose: the view is the centre ``height x width`` window of the world;
- ``x`` (``d`` +, ``a`` -): the window moves right by ``x * translation_scale * pan_per_unit`` view
  widths, so holding ``d`` moves content LEFT in the view;
- ``yaw`` (``l`` +, ``j`` -): the window moves right by ``yaw / fov_deg`` view widths (content moves
  LEFT, like ``d``); the world wraps around horizontally (it is tiled);
- ``pitch`` (``i`` +, ``k`` -): the window moves up by ``pitch / vfov`` view heights, with
  ``vfov = fov_deg * height / width`` (content moves DOWN); vertically the world is mirrored at its
  edges (``padding_mode="reflection"``);
- ``z`` (``w`` +, ``s`` -): the window is scaled by ``exp(-z * translation_scale * zoom_rate)`` about
  its centre, so moving forward zooms in (content grows away from the centre).

Prompt conditioning: a prompt (stripped, non-empty) is hashed with the seed (SHA-256) into a seeded
generator that draws an RGB tint in ``[-0.2, 0.2]`` and a contrast gain in ``[0.8, 1.2]``; the world is
``gain * pixels + tint`` (pixels in ``[-1, 1]``) before projection. Same prompt and seed, same world.
A prompt change mid-session means re-encoding the world (encode is cheap).

Everything is deterministic on CPU for a seed: the weights come from ``torch.Generator(seed)`` in
``__init__`` (no files), the noise from a generator seeded with ``noise_seed`` per chunk.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from engine.slots import SlotPool

from .pose import IDENTITY_POSE, Pose, integrate_pose

__all__ = ["IDENTITY_POSE", "Pose", "SessionSlots", "ToyWorldConfig", "ToyWorldModel", "integrate_pose"]


def _positive_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"ToyWorldConfig.{attribute.name} must be an int >= 1, got {value!r}")


def _non_negative_int(instance: object, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(f"ToyWorldConfig.{attribute.name} must be an int >= 0, got {value!r}")


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


@attrs.frozen
class ToyWorldConfig:
    """Sizes, rates and seed of the toy world model; every field is validated (errors name the field)."""

    height: int = attrs.field(default=96, validator=_positive_int)
    width: int = attrs.field(default=160, validator=_positive_int)
    frames_per_chunk: int = attrs.field(default=4, validator=_positive_int)
    fps: float = attrs.field(default=16.0, validator=_positive_float)
    downscale: int = attrs.field(default=4, validator=_positive_int)
    refine_steps: int = attrs.field(default=2, validator=_non_negative_int)
    hidden_channels: int = attrs.field(default=32, validator=_positive_int)
    cache_frames: int = attrs.field(default=4, validator=_positive_int)  # recent latents kept per session
    seed: int = attrs.field(default=0, validator=_non_negative_int)
    device: str = attrs.field(default="cpu", validator=_device)
    dtype: torch.dtype = attrs.field(default=torch.float32, validator=_float_dtype)
    world_scale: int = attrs.field(default=2, validator=_positive_int)  # world / view size, per direction
    # Denoising.
    noise_std: float = attrs.field(default=0.02, validator=_non_negative_float)
    step_size: float = attrs.field(default=0.1, validator=_non_negative_float)
    # Controls (reference C.5 defaults) and view geometry (module docstring).
    move_step: float = attrs.field(default=0.10, validator=_positive_float)
    lateral_step: float = attrs.field(default=0.10, validator=_positive_float)
    yaw_step_deg: float = attrs.field(default=0.5, validator=_positive_float)
    pitch_step_deg: float = attrs.field(default=0.5, validator=_positive_float)
    pitch_limit_deg: float = attrs.field(default=85.0, validator=_positive_float)
    translation_scale: float = attrs.field(default=3.0, validator=_positive_float)
    fov_deg: float = attrs.field(default=90.0, validator=_positive_float)
    pan_per_unit: float = attrs.field(default=0.05, validator=_non_negative_float)
    zoom_rate: float = attrs.field(default=0.1, validator=_non_negative_float)

    def __attrs_post_init__(self) -> None:
        for name in ("height", "width"):
            if getattr(self, name) % self.downscale:
                raise ValueError(
                    f"ToyWorldConfig.{name} must be a multiple of downscale={self.downscale}, got {getattr(self, name)}"
                )
        if self.pitch_limit_deg > 90:
            raise ValueError(f"ToyWorldConfig.pitch_limit_deg must be <= 90, got {self.pitch_limit_deg}")

    @property
    def latent_channels(self) -> int:
        return 3 * self.downscale**2

    @property
    def latent_size(self) -> tuple[int, int]:
        """``(h, w)`` of one view latent."""
        return (self.height // self.downscale, self.width // self.downscale)

    @property
    def world_size(self) -> tuple[int, int]:
        """``(H, W)`` of the world in pixels."""
        return (self.height * self.world_scale, self.width * self.world_scale)

    @property
    def world_latent_size(self) -> tuple[int, int]:
        h, w = self.latent_size
        return (h * self.world_scale, w * self.world_scale)


def _prompt_generator(seed: int, prompt: str) -> torch.Generator:
    digest = hashlib.sha256(f"{seed}\x00{prompt}".encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


class ToyWorldModel:
    """The three stages of the toy world; weights are seeded in ``__init__`` (no files).

    Holds no per-session state: a session's world latent, cache and pose live in :class:`SessionSlots`
    and are passed in. Calls that share a cache must be serialized by the caller (one chunk at a time).
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

    # -- stage 1: encode ---------------------------------------------------------------------------

    @torch.no_grad()
    def encode_world(self, image: np.ndarray | torch.Tensor | None = None, prompt: str | None = None) -> torch.Tensor:
        """The latent world ``C x Hw x Ww`` for an ``H x W x 3`` uint8 image (any size; resized to the
        world size) or, for ``None``, the seed's procedural scene; ``prompt`` tints it (module docstring)."""
        cfg = self.config
        world_h, world_w = cfg.world_size
        if image is None:
            pixels = self._procedural_scene()
        else:
            pixels = self._image_to_pixels(image)
            if pixels.shape[-2:] != (world_h, world_w):
                pixels = F.interpolate(
                    pixels[None], size=(world_h, world_w), mode="bilinear", align_corners=False, antialias=True
                )[0]
        pixels = pixels.to(self.device, cfg.dtype)
        unshuffled = F.pixel_unshuffle(pixels[None], cfg.downscale)[0]
        world = torch.einsum("dc,chw->dhw", self._proj, unshuffled)
        return self.condition_on_prompt(world, prompt).contiguous()

    def prompt_conditioning(self, prompt: str | None) -> tuple[float, torch.Tensor] | None:
        """``(gain, offset)`` a prompt applies to a latent world (``world * gain + offset``), or None.

        The prompt's seeded tint and contrast are linear in pixels, and so in the
        latent: a per-channel offset (``C x 1 x 1``) and a gain. Kept separate from
        encoding so a new prompt conditions the next chunk without re-encoding the image.
        """
        if prompt is None or not prompt.strip():
            return None
        cfg = self.config
        gen = _prompt_generator(cfg.seed, prompt.strip())
        tint = (torch.rand(3, 1, 1, generator=gen, dtype=torch.float64) * 0.4 - 0.2).float()
        gain = float(torch.rand((), generator=gen, dtype=torch.float64)) * 0.4 + 0.8
        flat = tint.expand(3, cfg.downscale, cfg.downscale).to(self.device, cfg.dtype)
        offset = torch.einsum("dc,chw->dhw", self._proj, F.pixel_unshuffle(flat[None], cfg.downscale)[0])
        return gain, offset

    def condition_on_prompt(self, world_latent: torch.Tensor, prompt: str | None) -> torch.Tensor:
        """The world as ``prompt`` conditions it (a new tensor; the input is unchanged)."""
        conditioning = self.prompt_conditioning(prompt)
        if conditioning is None:
            return world_latent
        gain, offset = conditioning
        return world_latent * gain + offset


    @staticmethod
    def _image_to_pixels(image: np.ndarray | torch.Tensor) -> torch.Tensor:
        tensor = torch.as_tensor(image)
        if tensor.ndim != 3 or tensor.shape[-1] not in (3, 4) or tensor.shape[0] < 1 or tensor.shape[1] < 1:
            raise ValueError(f"image must be H x W x 3 (or 4, alpha dropped), got shape {tuple(tensor.shape)}")
        if tensor.dtype != torch.uint8:
            raise ValueError(f"image must be uint8, got {tensor.dtype}")
        return tensor[..., :3].permute(2, 0, 1).to("cpu", torch.float32) / 127.5 - 1.0

    def _procedural_scene(self) -> torch.Tensor:
        """A ``3 x H x W`` scene in ``[-1, 1]`` from the seed: sky/ground gradient, a checkerboard floor,
        and coloured discs and boxes (horizontally periodic, so the tiled world has no seam)."""
        cfg = self.config
        height, width = cfg.world_size
        gen = torch.Generator().manual_seed(cfg.seed ^ 0x5EED)
        ys = torch.linspace(0.0, 1.0, height).view(height, 1).expand(height, width)
        xs = torch.arange(width, dtype=torch.float32).view(1, width).expand(height, width)
        sky, ground = torch.rand(3, generator=gen), torch.rand(3, generator=gen)
        horizon = 0.45
        img = torch.where(
            ys < horizon,
            sky.view(3, 1, 1) * (0.6 + 0.4 * ys / horizon),
            ground.view(3, 1, 1) * (0.5 + 0.5 * (ys - horizon) / (1 - horizon)),
        ).clone()
        cell = max(4, width // 20)
        checker = ((xs // cell + torch.arange(height).view(height, 1) // cell) % 2).float()
        img += torch.where(ys >= horizon, 0.25 * checker - 0.125, torch.zeros_like(ys))
        # Stripes in the sky: horizontal texture at several frequencies.
        img += 0.08 * torch.sin(xs * (2 * math.pi * 3 / width)) * (ys < horizon)
        for index in range(14):
            colour = torch.rand(3, generator=gen).view(3, 1, 1)
            cx = float(torch.rand((), generator=gen)) * width
            cy = float(torch.rand((), generator=gen)) * height
            size = 6 + float(torch.rand((), generator=gen)) * min(height, width) / 6
            dx = torch.remainder(xs - cx + width / 2, width) - width / 2  # periodic horizontal distance
            dy = torch.arange(height, dtype=torch.float32).view(height, 1) - cy
            mask = (dx.square() + dy.square() < size**2) if index % 2 else ((dx.abs() < size) & (dy.abs() < size * 0.6))
            img = torch.where(mask, colour.expand(3, height, width), img)
        return img.clamp(0.0, 1.0) * 2.0 - 1.0

    # -- view geometry -------------------------------------------------------------------------------

    def _view_grid(self, poses: Sequence[Pose]) -> torch.Tensor:
        """Sampling grid ``1 x (T*height) x width x 2`` into the horizontally 1-column-padded world."""
        cfg = self.config
        scale_w = float(cfg.world_scale)
        _, world_w = cfg.world_size
        vfov = cfg.fov_deg * cfg.height / cfg.width
        thetas = []
        for pose in poses:
            zoom = math.exp(-pose.z * cfg.translation_scale * cfg.zoom_rate)
            pan = pose.x * cfg.translation_scale * cfg.pan_per_unit + pose.yaw / cfg.fov_deg  # view widths, right
            rise = pose.pitch / vfov  # view heights, up
            # World-normalized coordinates: a view is 2/world_scale wide; image y grows downward.
            thetas.append([[zoom / scale_w, 0.0, 2.0 * pan / scale_w], [0.0, zoom / scale_w, -2.0 * rise / scale_w]])
        theta = torch.tensor(thetas, dtype=torch.float64)
        grid = F.affine_grid(theta, [len(thetas), 1, cfg.height, cfg.width], align_corners=False)
        # Wrap x into [-1, 1) (the world is tiled horizontally), then map into the padded world.
        grid[..., 0] = (torch.remainder(grid[..., 0] + 1.0, 2.0) - 1.0) * (world_w / (world_w + 2))
        return grid.reshape(1, len(thetas) * cfg.height, cfg.width, 2).to(self.device, cfg.dtype)

    @torch.no_grad()
    def warp_views(self, world_latent: torch.Tensor, poses: Sequence[Pose]) -> torch.Tensor:
        """The view latents ``T x C x h x w`` of ``world_latent`` at each pose (see module docstring).

        The warp is a linear map of the latent; it is applied in the latent's pixel basis (the inverse
        orthogonal projection and ``pixel_shuffle``, then back), so motion and zoom are smooth at
        pixel, not ``downscale``-block, resolution.
        """
        if not poses:
            raise ValueError("warp_views needs at least one pose")
        cfg = self.config
        self._check_world(world_latent)
        pixels = F.pixel_shuffle(torch.einsum("dc,chw->dhw", self._proj_inv, world_latent)[None], cfg.downscale)
        padded = F.pad(pixels, (1, 1, 0, 0), mode="circular")
        views = F.grid_sample(
            padded, self._view_grid(poses), mode="bilinear", padding_mode="reflection", align_corners=False
        )  # 1 x 3 x (T*height) x width
        views = views[0].view(3, len(poses), cfg.height, cfg.width).transpose(0, 1)
        return torch.einsum("dc,tchw->tdhw", self._proj, F.pixel_unshuffle(views, cfg.downscale)).contiguous()

    def warp_view(self, world_latent: torch.Tensor, pose: Pose) -> torch.Tensor:
        """The view latent ``C x h x w`` of ``world_latent`` at ``pose``."""
        return self.warp_views(world_latent, [pose])[0]

    def _check_world(self, world_latent: torch.Tensor) -> None:
        expected = (self.config.latent_channels, *self.config.world_latent_size)
        if tuple(world_latent.shape) != expected:
            raise ValueError(f"world latent must have shape {expected}, got {tuple(world_latent.shape)}")

    # -- stage 2: denoise ----------------------------------------------------------------------------

    def _refine(self, x: torch.Tensor, cond: torch.Tensor) -> torch.Tensor:
        h = F.silu(F.conv2d(torch.cat((x, cond), dim=1), self._w1, self._b1, padding=1))
        h = F.silu(F.conv2d(h, self._w2, self._b2, padding=1))
        return F.conv2d(h, self._w3, self._b3)

    @torch.no_grad()
    def denoise_chunk(
        self, world_latent: torch.Tensor, poses: Sequence[Pose], cache: torch.Tensor, noise_seed: int
    ) -> torch.Tensor:
        """Latents ``T x C x h x w`` for the frames at ``poses``; ``cache`` (``K x C x h x w``, the
        session's slot) is conditioned on and updated in place, oldest frame first."""
        cfg = self.config
        expected = (cfg.cache_frames, cfg.latent_channels, *cfg.latent_size)
        if tuple(cache.shape) != expected:
            raise ValueError(f"cache must have shape {expected}, got {tuple(cache.shape)}")
        views = self.warp_views(world_latent, poses)
        if cfg.noise_std > 0:
            gen = torch.Generator().manual_seed(int(noise_seed))
            noise = torch.randn(views.shape, generator=gen, dtype=torch.float32)
            views.add_(noise.to(self.device, cfg.dtype), alpha=cfg.noise_std)
        keep = cfg.cache_frames
        for t in range(views.shape[0]):
            x = views[t : t + 1]
            cond = cache.mean(dim=0, keepdim=True)
            for _ in range(cfg.refine_steps):
                x = x + cfg.step_size * self._refine(x, cond)
            views[t].copy_(x[0])
            for k in range(keep - 1):  # roll in place: no new storage for the session
                cache[k].copy_(cache[k + 1])
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
        world_latent: torch.Tensor,
        pose: Pose,
        held_keys: frozenset[str],
        cache: torch.Tensor,
        noise_seed: int,
    ) -> tuple[np.ndarray, list[Pose]]:
        """All three stages' middle and end for one chunk: ``(frames, per-frame poses)``; the last
        pose is the one to carry into the next chunk."""
        poses = integrate_pose(pose, held_keys, self.config.frames_per_chunk, self.config)
        return self.decode_frames(self.denoise_chunk(world_latent, poses, cache, noise_seed)), poses


class SessionSlots:
    """Preallocated per-session storage: world latents, recent-latent caches and poses, by slot.

    ``worlds``: ``[capacity, C, Hw, Ww]`` and ``caches``: ``[capacity, K, C, h, w]`` on the model
    device; ``poses``: ``[capacity, 4]`` float64 on the CPU (rows ``(x, z, yaw, pitch)``: control state,
    read by the host every chunk). Sessions only borrow slot ids from an :class:`engine.slots.SlotPool`;
    nothing is allocated per session or per chunk.
    """

    def __init__(self, capacity: int, config: ToyWorldConfig, name: str = "Toy world session") -> None:
        self.pool = SlotPool(capacity, name=name)
        c, (h, w), (hw, ww) = config.latent_channels, config.latent_size, config.world_latent_size
        device = torch.device(config.device)
        self.worlds = torch.zeros(capacity, c, hw, ww, device=device, dtype=config.dtype)
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
        """The slot's world latent ``C x Hw x Ww`` (a view: write it with ``copy_``)."""
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
