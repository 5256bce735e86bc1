"""The toy world's geometry: a pinhole camera in an endless, seeded world, rendered with torch ops.

World coordinates: ``x`` east, ``y`` up, ``z`` north; the ground is the plane ``y = 0`` and the camera
stands at ``(pose.x, eye_height, pose.z)`` looking along its heading (``yaw`` degrees clockwise from
``+z``, seen from above) tilted by ``pitch`` (up is positive). Pixels are square; ``fov_deg`` is the
horizontal field of view.

What a frame shows, per pixel ray:

- **ground** (rays that go down): the ray-plane hit; the ground texture is laid on the plane
  mirror-tiled every ``ground_tile`` units and modulated by two octaves of lattice noise in world
  coordinates (so the ground never repeats); detail fades and fog thickens with distance;
- **sky** (rays that go up): a gradient from the horizon colour up, the appearance's sky panorama by
  (azimuth, elevation) and a sun glow; it depends on the direction only (it is infinitely far, so
  walking does not move it, turning does);
- **objects**: every ``cell_size`` x ``cell_size`` cell of the ground holds at most one object, decided
  by a hash of ``(seed, cell x, cell z)``: a tree (trunk cylinder and canopy sphere), a pillar
  (cylinder) or a boulder (sphere), with a palette colour. Rays are intersected with the primitives
  (ray-cylinder and ray-sphere) inside each primitive's screen bounding box; a depth buffer keeps the
  nearest hit. Objects fade in at ``view_distance`` and fade out when the camera is about to walk
  through them.

Because objects live in world cells, walking forward passes objects and reveals new ones without end,
walking back shows the same ones again, and strafing moves near things across the view faster than far
ones (parallax). Everything is deterministic for a seed: object placement is integer hashing on the
CPU, pixel work is elementwise torch ops and bilinear ``grid_sample`` on the model's device.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import TYPE_CHECKING

import attrs
import numpy as np
import torch
import torch.nn.functional as F

from .appearance import Appearance
from .pose import Pose

if TYPE_CHECKING:
    from .model import ToyWorldConfig

__all__ = ["Primitives", "camera_basis", "noise_lattice", "objects_near", "render_views", "visible_objects"]

NEAR = 0.05  # closest hit distance, world units
_MASK64 = (1 << 64) - 1
CYLINDER, SPHERE = 0, 1


def camera_basis(pose: Pose) -> np.ndarray:
    """``3 x 3`` rows ``(right, up, forward)`` of the camera at ``pose``, in world coordinates."""
    yaw, pitch = math.radians(pose.yaw), math.radians(pose.pitch)
    sy, cy, sp, cp = math.sin(yaw), math.cos(yaw), math.sin(pitch), math.cos(pitch)
    return np.array([[cy, 0.0, -sy], [-sy * sp, cp, -cy * sp], [sy * cp, sp, cy * cp]], dtype=np.float64)


def focal_pixels(width: int, config: ToyWorldConfig) -> float:
    return (width / 2) / math.tan(math.radians(config.fov_deg) / 2)


# -- objects -------------------------------------------------------------------------------------------


def _splitmix(values: np.ndarray) -> np.ndarray:
    with np.errstate(over="ignore"):
        z = values + np.uint64(0x9E3779B97F4A7C15)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def _cell_uniforms(seed: int, ix: np.ndarray, iz: np.ndarray, count: int) -> np.ndarray:
    """``len(ix) x count`` uniforms in ``[0, 1)`` from a hash of ``(seed, ix, iz)``."""
    key = _splitmix(np.full(ix.shape, seed & _MASK64, dtype=np.uint64))
    key = _splitmix(key ^ ix.astype(np.int64).view(np.uint64))
    key = _splitmix(key ^ iz.astype(np.int64).view(np.uint64))
    with np.errstate(over="ignore"):
        draws = [_splitmix(key + np.uint64(j + 1)) >> np.uint64(11) for j in range(count)]
    return np.stack(draws, axis=-1).astype(np.float64) / float(1 << 53)


@attrs.frozen
class Primitives:
    """Object primitives as parallel arrays (one row each): a cylinder stands on the ground at
    ``(cx, cz)`` with height ``h``; a sphere is centred at ``(cx, cy, cz)``; ``cell`` is the owner's cell."""

    kind: np.ndarray
    centre: np.ndarray  # n x 3 (cylinders: the base centre, y = 0)
    height: np.ndarray
    radius: np.ndarray
    colour: np.ndarray  # palette index
    shade: np.ndarray  # colour multiplier (trunks are darker)
    cell: np.ndarray  # n x 2 int

    def __len__(self) -> int:
        return len(self.kind)

    def bounds(self) -> tuple[np.ndarray, np.ndarray]:
        """Bounding spheres ``(centres n x 3, radii n)``."""
        cyl = self.kind == CYLINDER
        centre = self.centre.copy()
        centre[cyl, 1] = self.height[cyl] / 2
        radius = np.where(cyl, np.hypot(self.radius, self.height / 2), self.radius)
        return centre, radius


def objects_near(x: float, z: float, reach: float, config: ToyWorldConfig) -> Primitives:
    """The primitives of every object whose cell lies within ``reach`` (a square) of ``(x, z)``."""
    size = config.cell_size
    xs = np.arange(math.floor((x - reach) / size), math.floor((x + reach) / size) + 1)
    zs = np.arange(math.floor((z - reach) / size), math.floor((z + reach) / size) + 1)
    ix, iz = (grid.ravel() for grid in np.meshgrid(xs, zs, indexing="ij"))
    u = _cell_uniforms(config.seed, ix, iz, 8)
    present = u[:, 0] < config.object_density
    ix, iz, u = ix[present], iz[present], u[present]
    cx, cz = (ix + 0.2 + 0.6 * u[:, 1]) * size, (iz + 0.2 + 0.6 * u[:, 2]) * size
    palette = (u[:, 4] * 8).astype(np.int64) % 8
    tree, pillar = u[:, 3] < 0.45, (u[:, 3] >= 0.45) & (u[:, 3] < 0.75)
    boulder = ~(tree | pillar)
    rows: list[tuple] = []
    # Trees: a trunk and a canopy.
    trunk_h = 1.4 + 0.8 * u[:, 6]
    canopy_r = 0.7 + 0.5 * u[:, 7]
    for sel, kind, cy, h, r, colour, shade in (
        (tree, CYLINDER, 0 * cx, trunk_h, 0.12 + 0.08 * u[:, 5], (palette + 3) % 8, 0.45),
        (tree, SPHERE, trunk_h + 0.5 * canopy_r, 0 * cx, canopy_r, palette, 1.0),
        (pillar, CYLINDER, 0 * cx, 2.0 + 3.0 * u[:, 6], 0.3 + 0.3 * u[:, 5], palette, 1.0),
        (boulder, SPHERE, 0.35 * (0.4 + 0.5 * u[:, 5]), 0 * cx, 0.4 + 0.5 * u[:, 5], palette, 0.9),
    ):
        n = int(sel.sum())
        rows.append((
            np.full(n, kind), np.stack([cx[sel], cy[sel], cz[sel]], axis=-1), h[sel], r[sel], colour[sel],
            np.full(n, shade), np.stack([ix[sel], iz[sel]], axis=-1),
        ))
    return Primitives(*(np.concatenate(parts) for parts in zip(*rows)))


def _camera_space(points: np.ndarray, pose: Pose, config: ToyWorldConfig) -> np.ndarray:
    rel = points - np.array([pose.x, config.eye_height, pose.z])
    return rel @ camera_basis(pose).T  # n x 3: (right, up, forward)


def _screen_boxes(
    prims: Primitives, poses: Sequence[Pose], height: int, width: int, config: ToyWorldConfig
) -> tuple[np.ndarray, np.ndarray]:
    """Per primitive: ``(visible in some pose, box [y0, y1, x0, x1] over the poses)`` in pixels.

    A box bounds the projection of the primitive's axis-aligned bounding box (its 8 corners) where all
    of them are in front of the camera, else the projection of its bounding sphere with the near side
    clamped to the near plane (still a bound when the sphere straddles the camera)."""
    centre, radius = prims.bounds()
    lo = np.stack([prims.centre[:, 0] - prims.radius, centre[:, 1] - np.where(prims.kind == CYLINDER, prims.height / 2, prims.radius),
                   prims.centre[:, 2] - prims.radius], axis=1)
    hi = np.stack([prims.centre[:, 0] + prims.radius, centre[:, 1] + np.where(prims.kind == CYLINDER, prims.height / 2, prims.radius),
                   prims.centre[:, 2] + prims.radius], axis=1)
    corners = np.stack([np.where(np.array(bits, dtype=bool), hi, lo) for bits in np.ndindex(2, 2, 2)], axis=1)  # n x 8 x 3
    f = focal_pixels(width, config)
    boxes = np.tile(np.array([height, 0, width, 0], dtype=np.int64), (len(prims), 1))
    visible = np.zeros(len(prims), dtype=bool)
    for pose in poses:
        c = _camera_space(centre, pose, config)
        distance = np.linalg.norm(c, axis=1)
        ahead = (c[:, 2] + radius > NEAR) & (distance - radius < config.view_distance)
        zn = np.maximum(c[:, 2] - radius, NEAR)
        zf = c[:, 2] + radius
        with np.errstate(divide="ignore", invalid="ignore"):
            left = np.minimum((c[:, 0] - radius) / zn, (c[:, 0] - radius) / zf)
            right = np.maximum((c[:, 0] + radius) / zn, (c[:, 0] + radius) / zf)
            top = np.maximum((c[:, 1] + radius) / zn, (c[:, 1] + radius) / zf)
            bottom = np.minimum((c[:, 1] - radius) / zn, (c[:, 1] - radius) / zf)
            k = _camera_space(corners.reshape(-1, 3), pose, config).reshape(-1, 8, 3)
            in_front = (k[..., 2] > NEAR).all(axis=1)
            kx, ky = k[..., 0] / k[..., 2], k[..., 1] / k[..., 2]
        left = np.where(in_front, kx.min(axis=1), left)
        right = np.where(in_front, kx.max(axis=1), right)
        top = np.where(in_front, ky.max(axis=1), top)
        bottom = np.where(in_front, ky.min(axis=1), bottom)
        box = np.stack([np.floor(height / 2 - top * f), np.ceil(height / 2 - bottom * f) + 1,
                        np.floor(width / 2 + left * f), np.ceil(width / 2 + right * f) + 1], axis=1)
        box = np.clip(np.nan_to_num(box), [0, 0, 0, 0], [height, height, width, width]).astype(np.int64)
        on_screen = ahead & (box[:, 1] > box[:, 0]) & (box[:, 3] > box[:, 2])
        visible |= on_screen
        boxes[on_screen, 0] = np.minimum(boxes[on_screen, 0], box[on_screen, 0])
        boxes[on_screen, 1] = np.maximum(boxes[on_screen, 1], box[on_screen, 1])
        boxes[on_screen, 2] = np.minimum(boxes[on_screen, 2], box[on_screen, 2])
        boxes[on_screen, 3] = np.maximum(boxes[on_screen, 3], box[on_screen, 3])
    return visible, boxes


def visible_objects(pose: Pose, height: int, width: int, config: ToyWorldConfig) -> set[tuple[int, int]]:
    """The cells whose object is (at least partly) in view at ``pose``, within ``view_distance``."""
    prims = objects_near(pose.x, pose.z, config.view_distance + config.cell_size, config)
    visible, _ = _screen_boxes(prims, [pose], height, width, config)
    return {(int(a), int(b)) for a, b in prims.cell[visible]}


# -- pixels --------------------------------------------------------------------------------------------


def _mirror(u: torch.Tensor) -> torch.Tensor:
    """Mirror-repeat ``u`` (period 2) into ``[-1, 1]`` grid coordinates: seamless tiling."""
    return 1.0 - 2.0 * (torch.remainder(u, 2.0) - 1.0).abs()


def _sample(texture: torch.Tensor, gx: torch.Tensor, gy: torch.Tensor) -> torch.Tensor:
    """Bilinear samples ``3 x ...`` of a ``3 x h x w`` texture at grid coordinates in ``[-1, 1]``."""
    shape = gx.shape
    grid = torch.stack((gx.reshape(1, -1, 1), gy.reshape(1, -1, 1)), dim=-1)
    out = F.grid_sample(texture[None], grid, mode="bilinear", padding_mode="border", align_corners=False)
    return out[0, :, :, 0].view(3, *shape)


NOISE_LATTICE = 256  # cells per side of the ground's noise lattice (mirror-repeated beyond)


def noise_lattice(seed: int) -> torch.Tensor:
    """The seed's ``1 x N x N`` lattice of uniform values behind the ground's value noise."""
    return torch.rand(1, NOISE_LATTICE, NOISE_LATTICE, generator=torch.Generator().manual_seed(seed ^ 0x6E015E))


def _value_noise(
    lattice: torch.Tensor, gx: torch.Tensor, gz: torch.Tensor, scale: float, shift: float, mode: str = "bilinear"
) -> torch.Tensor:
    """Noise in ``[0, 1]`` over the ground: the lattice sampled (``bilinear``: smooth; ``nearest``: one
    flat patch per lattice cell), one cell per ``scale`` units (it repeats, mirrored, only every
    ``NOISE_LATTICE * scale`` units)."""
    span = NOISE_LATTICE * scale
    gx_grid, gz_grid = _mirror((gx + shift) / span), _mirror((gz - shift) / span)
    shape = gx.shape
    grid = torch.stack((gx_grid.reshape(1, -1, 1), gz_grid.reshape(1, -1, 1)), dim=-1)
    out = F.grid_sample(lattice[None], grid, mode=mode, padding_mode="border", align_corners=False)
    return out.view(shape)


def _rays(poses: Sequence[Pose], height: int, width: int, config: ToyWorldConfig, device, dtype) -> torch.Tensor:
    """Unit world-space ray directions ``T x H x W x 3``."""
    f = focal_pixels(width, config)
    xs = (torch.arange(width, dtype=torch.float64) + 0.5 - width / 2) / f
    ys = (height / 2 - torch.arange(height, dtype=torch.float64) - 0.5) / f
    cam = torch.stack(torch.broadcast_tensors(xs.view(1, width), ys.view(height, 1), torch.ones(1, 1, dtype=torch.float64)), dim=-1)
    basis = torch.from_numpy(np.stack([camera_basis(p) for p in poses]))  # T x 3 x 3
    rays = torch.einsum("hwc,tcd->thwd", cam, basis)
    return F.normalize(rays, dim=-1).to(device, dtype)


def render_views(
    packed: torch.Tensor, poses: Sequence[Pose], height: int, width: int, config: ToyWorldConfig, lattice: torch.Tensor
) -> torch.Tensor:
    """Frames ``T x 3 x H x W`` in ``[-1, 1]`` of the world with appearance ``packed`` at ``poses``
    (``lattice``: :func:`noise_lattice` of the seed, on ``packed``'s device and dtype)."""
    if not poses:
        raise ValueError("render_views needs at least one pose")
    device, dtype = packed.device, packed.dtype
    look = Appearance.unpack((packed + 1.0) * 0.5, config.texture_size)  # colours in [0, 1] from here
    sun_az, sun_el, fog_scale, light = (float(v) for v in look.params.tolist())
    sun_dir = torch.tensor(
        [math.sin(math.radians(sun_az)) * math.cos(math.radians(sun_el)), math.sin(math.radians(sun_el)),
         math.cos(math.radians(sun_az)) * math.cos(math.radians(sun_el))], device=device, dtype=dtype,
    )
    fog_distance = config.view_distance / 2.0 * fog_scale
    rays = _rays(poses, height, width, config, device, dtype).contiguous()
    count = len(poses)
    origin = torch.tensor([[p.x, config.eye_height, p.z] for p in poses], device=device, dtype=dtype).view(count, 1, 1, 3)
    # Every pixel shows either sky or ground: each is computed only where it shows.
    flat_rays = rays.view(-1, 3)
    down = flat_rays[:, 1] < -1e-4
    sky_at, ground_at = (~down).nonzero().squeeze(1), down.nonzero().squeeze(1)
    colour = torch.empty(3, flat_rays.shape[0], device=device, dtype=dtype)  # painted in place below
    depth = torch.full((flat_rays.shape[0],), math.inf, device=device, dtype=dtype)

    # Sky: depends on the direction only.
    sky_rays = flat_rays.index_select(0, sky_at)
    dx, dy, dz = sky_rays.unbind(-1)
    elevation = torch.asin(dy.clamp(-1, 1))
    azimuth = torch.atan2(dx, dz) / math.pi
    lift = (elevation.clamp(min=0) / (math.pi / 2)) ** 0.6
    gradient = look.horizon.view(3, 1) + (look.sky_top - look.horizon).view(3, 1) * lift
    panorama = _sample(look.sky, _mirror(azimuth + 1.0), 1.0 - 2.0 * (elevation / 1.2).clamp(0, 1))
    glow = torch.exp((torch.einsum("nc,c->n", sky_rays, sun_dir) - 1.0) * 60.0)
    sky = gradient * 0.55 + panorama * 0.45
    sky = sky + (look.sun.view(3, 1) - sky) * glow
    colour[:, sky_at] = sky * (0.35 + 0.65 * light)

    # Ground: the ray-plane hit.
    dx, dy, dz = flat_rays.index_select(0, ground_at).unbind(-1)
    t_flat = config.eye_height / (-dy).clamp(min=1e-4)
    frame_origin = origin.view(count, 3).index_select(0, torch.div(ground_at, height * width, rounding_mode="floor"))
    gx, gz = frame_origin[:, 0] + t_flat * dx, frame_origin[:, 2] + t_flat * dz
    tile = config.ground_tile
    texture = _sample(look.ground, _mirror(gx / tile), _mirror(gz / tile))
    # Patches of one ground unit each (flat, with edges: near detail), over smooth variation.
    patches = _value_noise(lattice, gx, gz, 1.0, 91.0, mode="nearest") - 0.5
    near = torch.exp(-t_flat / (0.25 * config.view_distance))
    noise = 0.45 + 0.7 * _value_noise(lattice, gx, gz, 3.0, 0.0) + 0.3 * _value_noise(lattice, gx, gz, 0.7, 37.0)
    noise = noise * (1.0 + 1.1 * patches * near)
    mean = look.ground.mean(dim=(1, 2)).view(3, 1)
    detail = torch.exp(-t_flat / (0.6 * config.view_distance))
    sunlit = light * (0.75 + 0.35 * math.sin(math.radians(max(sun_el, 0.0))))
    colour[:, ground_at] = (mean + (texture * noise - mean) * detail) * sunlit
    depth[ground_at] = t_flat

    colour, depth = colour.view(3, count, height, width), depth.view(count, height, width)
    _draw_objects(colour, depth, look, rays, origin, poses, height, width, config, sun_dir, light)
    fog = torch.where(torch.isfinite(depth), 1.0 - torch.exp(-depth.clamp(max=1e6) / fog_distance), torch.zeros_like(depth))
    horizon = look.horizon.view(3, 1, 1, 1) * (0.35 + 0.65 * light)
    colour = colour + (horizon - colour) * fog
    return (colour.clamp(0.0, 1.0) * 2.0 - 1.0).transpose(0, 1).contiguous()


def _pixel_indices(boxes: np.ndarray, count: int, height: int, width: int) -> tuple[np.ndarray, np.ndarray]:
    """Flat ``(t, y, x)`` pixel indices of every primitive's box in every frame, and the primitive of each."""
    pixels, owners = [], []
    frame = height * width
    for index, (y0, y1, x0, x1) in enumerate(boxes):
        box = (np.arange(y0, y1)[:, None] * width + np.arange(x0, x1)[None, :]).ravel()
        flat = (np.arange(count)[:, None] * frame + box[None, :]).ravel()
        pixels.append(flat)
        owners.append(np.full(flat.shape, index))
    return np.concatenate(pixels), np.concatenate(owners)


def _draw_objects(colour, depth, look, rays, origin, poses, height, width, config, sun_dir, light) -> None:
    """Intersect the visible primitives with the rays inside their screen boxes, all at once, and paint
    each pixel's nearest hit over the ground and sky (in place; ``colour`` is ``3 x T x H x W``)."""
    xs, zs = [p.x for p in poses], [p.z for p in poses]
    reach = config.view_distance + config.cell_size + max(max(xs) - min(xs), max(zs) - min(zs)) / 2
    prims = objects_near((min(xs) + max(xs)) / 2, (min(zs) + max(zs)) / 2, reach, config)
    if not len(prims):
        return
    visible, boxes = _screen_boxes(prims, poses, height, width, config)
    chosen = np.nonzero(visible)[0]
    if not len(chosen):
        return
    count, device, dtype = len(poses), rays.device, rays.dtype
    flat_np, owner_np = _pixel_indices(boxes[chosen], count, height, width)
    frame_np = flat_np // (height * width)
    # Per (primitive, frame): fade in at the view distance, out when the camera is about to walk through.
    cam_xz = np.array([[p.x, p.z] for p in poses])
    centre, radius = prims.centre[chosen], prims.radius[chosen]
    reach_xz = np.hypot(cam_xz[None, :, 0] - centre[:, None, 0], cam_xz[None, :, 1] - centre[:, None, 2])
    alpha = np.clip((config.view_distance - reach_xz) / (0.15 * config.view_distance), 0, 1) * np.clip(
        (reach_xz - radius[:, None] - 0.5) / 1.5, 0, 1
    )
    table = np.stack([*centre.T, radius, prims.height[chosen], prims.shade[chosen]], axis=1)

    def on_device(array: np.ndarray, kind=None) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(array)).to(device, kind or dtype)

    flat, owner, frame = on_device(flat_np, torch.int64), on_device(owner_np, torch.int64), on_device(frame_np, torch.int64)
    params = on_device(table).index_select(0, owner)  # N x 6
    cx, cy, cz, r, h, shade = params.unbind(-1)
    is_cylinder = on_device(prims.kind[chosen] == CYLINDER, torch.bool).index_select(0, owner)
    d = rays.reshape(-1, 3).index_select(0, flat)
    o = origin.reshape(count, 3).index_select(0, frame)
    dx, dy, dz = d.unbind(-1)
    ox, oy, oz = o[:, 0] - cx, o[:, 1] - cy, o[:, 2] - cz
    # Vertical cylinder standing on the ground (cy = 0): the ray's hit on its side, from outside.
    a = (dx * dx + dz * dz).clamp(min=1e-9)
    b = ox * dx + oz * dz
    disc_c = b * b - a * (ox * ox + oz * oz - r * r)
    t_c = (-b - disc_c.clamp(min=0).sqrt()) / a
    y_c = oy + t_c * dy
    hit_c = (disc_c > 0) & (y_c >= 0) & (y_c <= h)
    # Sphere (unit ray directions).
    b_s = ox * dx + oy * dy + oz * dz
    disc_s = b_s * b_s - (ox * ox + oy * oy + oz * oz - r * r)
    t_s = -b_s - disc_s.clamp(min=0).sqrt()
    t = torch.where(is_cylinder, t_c, t_s)
    weight = on_device(alpha).view(-1).index_select(0, owner * count + frame)
    hit = torch.where(is_cylinder, hit_c, disc_s > 0) & (t > NEAR) & (weight > 0)
    t = torch.where(hit, t, torch.full_like(t, math.inf))
    # The nearest hit per pixel; ties go to the later element (deterministic).
    nearest = torch.full((count * height * width,), math.inf, device=device, dtype=dtype)
    nearest.scatter_reduce_(0, flat, t, reduce="amin")
    wins = hit & (t == nearest.index_select(0, flat)) & (t < depth.view(-1).index_select(0, flat))
    element = torch.arange(len(flat), device=device)
    winner = torch.full_like(nearest, -1, dtype=torch.int64)
    winner.scatter_reduce_(0, flat, torch.where(wins, element, torch.full_like(element, -1)), reduce="amax")
    keep = wins & (winner.index_select(0, flat) == element)
    if not bool(keep.any()):
        return
    sel = keep.nonzero().squeeze(1)
    t, d, ox, oy, oz, r, h, shade = t[sel], d[sel], ox[sel], oy[sel], oz[sel], r[sel], h[sel], shade[sel]
    cylinder = is_cylinder[sel]
    px, py, pz = ox + t * d[:, 0], oy + t * d[:, 1], oz + t * d[:, 2]  # hit point relative to the centre
    nx, nz = px / r, pz / r
    ny = torch.where(cylinder, torch.zeros_like(py), py / r)
    u = torch.atan2(nz, nx) / math.pi
    v = torch.where(cylinder, (oy + t * d[:, 1]) / h, 0.5 - 0.5 * ny)
    texel = _sample(look.surface, _mirror(u * 2.0), _mirror(v * 2.0)).mean(dim=0)
    lambert = 0.45 + 0.55 * (nx * sun_dir[0] + ny * sun_dir[1] + nz * sun_dir[2]).clamp(min=0)
    palette = look.palette[on_device(prims.colour[chosen], torch.int64)[owner[sel]]].T  # 3 x n
    shaded = palette * (shade * (0.7 + 0.9 * (texel - look.surface.mean())) * lambert * light)
    target = flat[sel]
    flat_colour = colour.view(3, -1)
    weight = weight[sel]
    flat_colour[:, target] = flat_colour[:, target] + (shaded - flat_colour[:, target]) * weight
    depth.view(-1)[target] = torch.where(weight > 0.5, t, depth.view(-1)[target])
