"""The toy world's latent appearance: what encode makes of the reference image, in one flat tensor.

A session's world is an infinite procedural place (:mod:`.render`); what the image decides is how it
*looks*. :func:`encode_appearance` samples from the image (or, without one, from a seeded procedural
picture):

- ``ground``: a ``3 x S x S`` texture from the image's lower half (tiled mirror-wise on the ground);
- ``sky``: a ``3 x S x 2S`` panorama from the image's upper half (mirrored in azimuth, so it wraps);
- ``surface``: a ``3 x S x S`` texture from the whole image, for the objects' surfaces;
- ``palette``: ``P`` colours of the image at seeded points (the objects' colours; without an image,
  ``P`` seeded colours);
- ``sky_top``, ``horizon``, ``sun``: colours (``horizon`` is also the fog colour);
- ``params``: ``(sun azimuth deg, sun elevation deg, fog scale, light level)``.

Everything is packed into one flat float tensor (:meth:`Appearance.pack`) so that it fits a session
slot and a tensor channel as one piece; :meth:`Appearance.unpack` gives views into it. Colours are in
``[-1, 1]`` like the frames.

Prompt conditioning (:func:`condition_appearance`) is a pure function of (appearance, prompt, seed):
words choose a time of day or weather (``night``, ``sunset``/``dusk``/``dawn``/``evening``,
``fog``/``mist``/``haze``, ``snow``/``winter``), and the whole prompt, hashed with the seed, shifts the
palette (a tint and a contrast gain). The same prompt and seed give the same world.
"""

from __future__ import annotations

import hashlib
import math

import attrs
import numpy as np
import torch
import torch.nn.functional as F

__all__ = ["Appearance", "appearance_numel", "condition_appearance", "encode_appearance"]

PALETTE = 8
PARAMS = 4  # sun azimuth (deg), sun elevation (deg), fog scale, light level


def _fields(texture: int) -> tuple[tuple[str, tuple[int, ...]], ...]:
    s = texture
    return (
        ("ground", (3, s, s)),
        ("sky", (3, s, 2 * s)),
        ("surface", (3, s, s)),
        ("palette", (PALETTE, 3)),
        ("sky_top", (3,)),
        ("horizon", (3,)),
        ("sun", (3,)),
        ("params", (PARAMS,)),
    )


def appearance_numel(texture: int) -> int:
    """Length of the packed appearance tensor for a ``texture`` x ``texture`` texture size."""
    return sum(math.prod(shape) for _, shape in _fields(texture))


@attrs.frozen
class Appearance:
    """Views into one packed appearance tensor (module docs)."""

    ground: torch.Tensor
    sky: torch.Tensor
    surface: torch.Tensor
    palette: torch.Tensor
    sky_top: torch.Tensor
    horizon: torch.Tensor
    sun: torch.Tensor
    params: torch.Tensor

    @classmethod
    def unpack(cls, packed: torch.Tensor, texture: int) -> Appearance:
        if packed.ndim != 1 or packed.numel() != appearance_numel(texture):
            raise ValueError(
                f"appearance must be a flat tensor of {appearance_numel(texture)} values, got shape {tuple(packed.shape)}"
            )
        views, offset = {}, 0
        for name, shape in _fields(texture):
            size = math.prod(shape)
            views[name] = packed[offset : offset + size].view(shape)
            offset += size
        return cls(**views)

    def pack(self) -> torch.Tensor:
        return torch.cat([getattr(self, name).reshape(-1) for name, _ in _fields(self.ground.shape[-1])])


def _seeded(seed: int, *salt: object) -> torch.Generator:
    digest = hashlib.sha256("\x00".join(str(part) for part in (seed, *salt)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") & ((1 << 63) - 1))


def _value_noise(gen: torch.Generator, height: int, width: int, cells: int) -> torch.Tensor:
    """Smooth noise in ``[0, 1]``: a ``cells`` lattice of random values, bicubically enlarged."""
    lattice = torch.rand(1, 1, cells, max(2, cells * width // height), generator=gen)
    return F.interpolate(lattice, size=(height, width), mode="bicubic", align_corners=False)[0, 0].clamp(0, 1)


def procedural_picture(seed: int, height: int = 96, width: int = 160) -> torch.Tensor:
    """A ``3 x H x W`` picture in ``[0, 1]`` from the seed: a sky with clouds over a field."""
    gen = _seeded(seed, "picture")
    ys = torch.linspace(0.0, 1.0, height).view(height, 1)
    sky_hue, ground_hue = torch.rand(3, generator=gen), torch.rand(3, generator=gen)
    sky_top = 0.25 + 0.45 * sky_hue
    sky = sky_top.view(3, 1, 1) + (0.9 - sky_top.view(3, 1, 1)) * (ys / 0.5) ** 1.5
    clouds = _value_noise(gen, height, width, 6) * _value_noise(gen, height, width, 14)
    sky = sky + 0.5 * (clouds - 0.25).clamp(min=0)
    ground = (0.3 + 0.6 * ground_hue).view(3, 1, 1) * (
        0.45 + 0.4 * _value_noise(gen, height, width, 10) + 0.45 * _value_noise(gen, height, width, 40)
    )
    picture = torch.where(ys.view(1, height, 1) < 0.5, sky.expand(3, height, width), ground.expand(3, height, width))
    return picture.clamp(0.0, 1.0)


def encode_appearance(image: torch.Tensor | None, seed: int, texture: int) -> Appearance:
    """The appearance of a ``3 x H x W`` picture in ``[0, 1]`` (CPU, float32) or, for None, the seed's."""
    picture = procedural_picture(seed) if image is None else image
    if picture.ndim != 3 or picture.shape[0] != 3 or min(picture.shape[1:]) < 2:
        raise ValueError(f"picture must be 3 x H x W with H, W >= 2, got {tuple(picture.shape)}")
    height, width = picture.shape[1:]
    half = height // 2

    def resized(part: torch.Tensor, size: tuple[int, int]) -> torch.Tensor:
        return F.interpolate(part[None], size=size, mode="bilinear", align_corners=False, antialias=True)[0]

    top, bottom = picture[:, : max(1, half)], picture[:, half:]
    gen = _seeded(seed, "appearance")
    # Palette: the image's colours at seeded points (of a slightly blurred copy, so one noisy pixel
    # does not decide), pushed away from grey so objects stand out from the ground.
    smooth = resized(picture, (32, 32))
    points = torch.randint(0, 32, (PALETTE, 2), generator=gen)
    if image is None:  # the seed's own colours: bright, varied
        palette = 0.2 + 0.75 * torch.rand(PALETTE, 3, generator=gen)
    else:
        palette = smooth[:, points[:, 0], points[:, 1]].T
    grey = palette.mean(dim=1, keepdim=True)
    palette = (grey + 1.6 * (palette - grey)).clamp(0.05, 0.95)
    sky_top = top[:, : max(1, half // 4)].mean(dim=(1, 2))
    horizon = top[:, -max(1, half // 4) :].mean(dim=(1, 2)) * 0.6 + bottom.mean(dim=(1, 2)) * 0.1 + 0.3
    params = torch.tensor(
        [float(torch.rand((), generator=gen)) * 360.0, 25.0 + 20.0 * float(torch.rand((), generator=gen)), 1.0, 1.0]
    )
    appearance = Appearance(
        ground=resized(bottom, (texture, texture)),
        sky=resized(top, (texture, 2 * texture)),
        surface=resized(picture, (texture, texture)),
        palette=palette,
        sky_top=sky_top,
        horizon=horizon.clamp(0, 1),
        sun=torch.tensor([1.0, 0.95, 0.85]),
        params=params,
    )
    return _scaled(appearance, lambda colour: colour * 2.0 - 1.0)


def _scaled(appearance: Appearance, colour_map) -> Appearance:
    """Apply ``colour_map`` to every colour field (not to ``params``)."""
    return attrs.evolve(
        appearance,
        **{name: colour_map(getattr(appearance, name)) for name in ("ground", "sky", "surface", "palette", "sky_top", "horizon", "sun")},
    )


_NIGHT = {"night", "midnight", "dark", "moon", "moonlit", "stars"}
_SUNSET = {"sunset", "dusk", "dawn", "evening", "sunrise", "twilight"}
_FOG = {"fog", "foggy", "mist", "misty", "haze", "hazy"}
_SNOW = {"snow", "snowy", "winter", "ice", "icy", "frozen"}


def condition_appearance(packed: torch.Tensor, prompt: str | None, seed: int, texture: int) -> torch.Tensor:
    """The packed appearance as ``prompt`` conditions it (a new tensor; the input is unchanged)."""
    if prompt is None or not prompt.strip():
        return packed
    text = prompt.strip()
    words = {word.strip(".,;:!?\"'").lower() for word in text.split()}
    a = Appearance.unpack(packed.clone(), texture)
    gen = _seeded(seed, "prompt", text)
    device, dtype = packed.device, packed.dtype
    tint = (torch.rand(3, generator=gen, dtype=torch.float64) * 0.3 - 0.15).to(device, dtype)
    gain = float(torch.rand((), generator=gen, dtype=torch.float64)) * 0.4 + 0.8

    def colour(values: list[float]) -> torch.Tensor:
        return torch.tensor(values, device=device, dtype=dtype) * 2 - 1

    for field in (a.ground, a.surface, a.palette.T):  # palette shift: contrast gain and tint
        field.mul_(gain).add_(tint.view(3, *([1] * (field.ndim - 1))))
    if words & _SNOW:
        for field in (a.ground, a.surface):
            field.mul_(0.35).add_(0.6)
    if words & _SUNSET:
        a.horizon.copy_(colour([0.95, 0.55, 0.3]))
        a.sky_top.copy_(colour([0.3, 0.25, 0.5]))
        a.sun.copy_(colour([1.0, 0.7, 0.4]))
        a.params[1] = 4.0
    if words & _NIGHT:
        a.horizon.copy_(colour([0.08, 0.1, 0.2]))
        a.sky_top.copy_(colour([0.01, 0.01, 0.05]))
        a.sun.copy_(colour([0.7, 0.75, 0.9]))  # the moon
        a.params[3] = 0.35
    if words & _FOG:
        a.params[2] = 0.3
    for field in (a.ground, a.sky, a.surface, a.palette):
        field.clamp_(-1.0, 1.0)
    return a.pack()


def image_to_picture(image: np.ndarray | torch.Tensor) -> torch.Tensor:
    """An ``H x W x 3`` (or 4, alpha dropped) uint8 image as a ``3 x H x W`` float picture in ``[0, 1]``."""
    tensor = torch.as_tensor(image)
    if tensor.ndim != 3 or tensor.shape[-1] not in (3, 4) or tensor.shape[0] < 2 or tensor.shape[1] < 2:
        raise ValueError(f"image must be H x W x 3 (or 4, alpha dropped), at least 2 x 2, got shape {tuple(tensor.shape)}")
    if tensor.dtype != torch.uint8:
        raise ValueError(f"image must be uint8, got {tensor.dtype}")
    return tensor[..., :3].permute(2, 0, 1).to("cpu", torch.float32) / 255.0
