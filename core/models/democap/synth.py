"""Training images drawn straight at the model's input resolution, a batch at a time, in torch.

`data.py` draws each image as a user would send it (up to 1024 px, PNG or JPEG), and the
processor then squashes it to S x S. Drawing that way costs ~10 ms an image on a laptop core,
which would starve training. This module draws the same distribution of *model inputs*
directly: every output pixel is mapped back to the original image's coordinates (the squash
of a W x H image to S x S), the shape is tested at n x n sub-pixel points there, and coverage
is their mean. Then the softening the real path adds (the resize filter, blur, JPEG at small
sizes, noise) is applied at random. Everything is drawn from one `torch.Generator`, so a seed
gives the same batch on every run.

The shapes match `data.unit_outline`: circumradius 1, squares and crosses' arm tips on the
unit circle, stars with 5 outer points at radius 1.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from wicore.models.corpus import COLORS, SHAPES
from wicore.models.democap.data import JITTER, MAX_SIDE, MIN_SIDE, PALETTE

PALETTE_RGB = torch.tensor([PALETTE[c] for c in COLORS], dtype=torch.float32)  # [8, 3]


@dataclass(frozen=True)
class Widen:
    """How much wider than the task the training distribution is drawn (robustness margin)."""

    fraction: tuple[float, float] = (0.17, 0.74)  # shape diameter / short side
    aspect: float = 2.1  # width / height within [1/aspect, aspect]
    jitter: int = JITTER + 6
    star_inner: tuple[float, float] = (0.33, 0.55)
    cross_arm: tuple[float, float] = (0.22, 0.45)


@dataclass
class Batch:
    pixels: torch.Tensor  # uint8 [B, 3, S, S]
    shape: torch.Tensor  # long [B], index into SHAPES
    color: torch.Tensor  # long [B], index into COLORS
    background: torch.Tensor  # long [B], index into COLORS
    coverage: torch.Tensor  # float [B, S, S]: share of each pixel the shape covers (before blur)

    def captions(self) -> list[str]:
        from wicore.models.democap.data import caption

        return [
            caption(COLORS[c], SHAPES[s], COLORS[b])
            for s, c, b in zip(self.shape.tolist(), self.color.tolist(), self.background.tolist())
        ]


@dataclass
class Masks:
    """Colorless images: where the shape is, before (coverage) and after (soft) the blur. Blur is
    linear and the two colors are constant per image, so painting `soft` equals blurring the
    painted image; the colors can be drawn later, and again, for the same masks."""

    shape: torch.Tensor  # long [B]
    coverage: torch.Tensor  # float [B, S, S]
    soft: torch.Tensor  # float [B, S, S], coverage after the resize filter and the image's blur
    short: torch.Tensor  # float [B], the original's short side (JPEG survives only when small)
    noise: torch.Tensor | None = None  # [B, 3, S, S] unit-std noise fields to use; None: draw new


def draw(batch: int, size: int, gen: torch.Generator, widen: Widen = Widen(), subsamples: int = 3) -> Batch:
    """`batch` random images as the processor would hand them to the model: uint8 [B, 3, S, S]."""
    return paint(draw_masks(batch, size, gen, widen, subsamples), gen, widen)


def draw_masks(batch: int, size: int, gen: torch.Generator, widen: Widen = Widen(), subsamples: int = 3) -> Masks:
    dev = gen.device  # drawn where the generator lives (CPU for reproducible training)
    u = lambda *shape: torch.rand(*shape, generator=gen, device=dev)  # noqa: E731
    shape = torch.randint(0, len(SHAPES), (batch,), generator=gen, device=dev)

    # the original image: log-uniform size and aspect, both sides in [64, 1024]
    log_side = math.log(MIN_SIDE) + u(batch) * math.log(MAX_SIDE / MIN_SIDE)
    log_aspect = (u(batch) * 2 - 1) * math.log(widen.aspect)
    width = torch.exp(log_side + log_aspect / 2).clamp(MIN_SIDE, MAX_SIDE)
    height = torch.exp(log_side - log_aspect / 2).clamp(MIN_SIDE, MAX_SIDE)
    short = torch.minimum(width, height)
    lo, hi = widen.fraction
    radius = (lo + u(batch) * (hi - lo)) * short / 2
    cx = radius + u(batch) * (width - 2 * radius)
    cy = radius + u(batch) * (height - 2 * radius)
    angle = u(batch) * 2 * math.pi
    star_inner = widen.star_inner[0] + u(batch) * (widen.star_inner[1] - widen.star_inner[0])
    cross_arm = widen.cross_arm[0] + u(batch) * (widen.cross_arm[1] - widen.cross_arm[0])

    alpha = coverage(shape, width, height, cx, cy, radius, angle, star_inner, cross_arm, size, subsamples)
    return Masks(shape, alpha, blur(alpha, short, gen), short)


def paint(masks: Masks, gen: torch.Generator, widen: Widen = Widen()) -> Batch:
    """Two palette colors per mask, jittered, then noise and JPEG: uint8 pixels."""
    batch, dev = len(masks.shape), gen.device
    color = torch.randint(0, len(COLORS), (batch,), generator=gen, device=dev)
    background = (color + torch.randint(1, len(COLORS), (batch,), generator=gen, device=dev)) % len(COLORS)
    palette = PALETTE_RGB.to(dev)
    fg = jittered(palette[color], widen.jitter, gen)  # [B, 3]
    bg = jittered(palette[background], widen.jitter, gen)
    # bg + (fg - bg) * soft in one pass over the [B, 3, S, S] output (the step's largest tensor)
    rgb = torch.addcmul(bg[:, :, None, None], (fg - bg)[:, :, None, None], masks.soft[:, None])
    return Batch(finish(rgb, masks.short, gen, masks.noise), masks.shape, color, background, masks.coverage)


class MaskPool:
    """Masks drawn once and reused: each use picks one of the square's 8 symmetries (the squash
    of a W x H original turned by 90 degrees is the squash of its H x W turn, so every variant
    is still a valid input) and new colors, noise and JPEG. Drawing a mask costs most of a
    fresh image; this makes a training step cost little more than the model."""

    def __init__(
        self, count: int, size: int, gen: torch.Generator, chunk: int = 256, noise_fields: int = 256, **kwargs
    ):
        byte = lambda x: x.mul(255).round().to(torch.uint8)  # noqa: E731  (1 byte a pixel)
        parts = [draw_masks(min(chunk, count - i), size, gen, **kwargs) for i in range(0, count, chunk)]
        parts = [Masks(m.shape, byte(m.coverage), byte(m.soft), m.short) for m in parts]
        self.shape = torch.cat([m.shape for m in parts])
        self.soft = torch.cat([m.soft for m in parts])
        self.coverage = torch.cat([m.coverage for m in parts])
        self.short = torch.cat([m.short for m in parts])
        # noise fields drawn once too: drawing 6M random numbers a batch was a tenth of a CPU step
        self.noise = (torch.rand(noise_fields, 3, size, size, generator=gen, device=gen.device) - 0.5) * math.sqrt(12)

    def __len__(self) -> int:
        return len(self.shape)

    def sample(self, batch: int, gen: torch.Generator) -> Masks:
        dev = gen.device  # the pool lives there too
        rows = torch.randint(0, len(self), (batch,), generator=gen, device=dev)
        flips = torch.randint(0, 2, (3, batch), generator=gen, device=dev).bool()
        soft = symmetric(self.soft[rows], flips).float() / 255  # turned while still 1 byte a pixel
        cover = symmetric(self.coverage[rows], flips).float() / 255
        if batch <= len(self.noise):  # consecutive fields: a view, not a [B, 3, S, S] copy
            start = int(torch.randint(0, len(self.noise) - batch + 1, (), generator=gen, device=dev))
            noise = self.noise[start : start + batch]
        else:
            noise = self.noise[torch.randint(0, len(self.noise), (batch,), generator=gen, device=dev)]
        return Masks(self.shape[rows], cover, soft, self.short[rows], noise)


def symmetric(images: torch.Tensor, flips: torch.Tensor) -> torch.Tensor:
    """[B, S, S] under per-image flips [3, B]: transpose, then flip rows, then flip columns.
    Applied per group of images that share all three (at most 8 groups), so each pixel is
    copied once instead of passing the whole batch through three selects."""
    codes = flips[0].long() + 2 * flips[1].long() + 4 * flips[2].long()  # [B], 0..7
    out = torch.empty_like(images)
    for code in codes.unique().tolist():
        at = (codes == code).nonzero().flatten()
        group = images[at]
        if code & 1:
            group = group.transpose(1, 2)
        if code & 2:
            group = group.flip(1)
        if code & 4:
            group = group.flip(2)
        out[at] = group
    return out


def coverage(shape, width, height, cx, cy, radius, angle, star_inner, cross_arm, size: int, n: int) -> torch.Tensor:
    """float [B, S, S]: the share of each output pixel the shape covers, from n x n sub-pixel
    points mapped back into the original W x H image (the processor's squash to S x S). Every
    argument but size and n is per image, [B]."""
    batch, dev = len(shape), shape.device
    grid = (torch.arange(size * n, dtype=torch.float32, device=dev) + 0.5) / n  # output pixels, n per pixel
    gx, gy = grid[None, None, :], grid[None, :, None]  # [1, 1, Sn], [1, Sn, 1]
    x = gx * (width / size)[:, None, None] - cx[:, None, None]  # [B, 1, Sn], original pixels
    y = gy * (height / size)[:, None, None] - cy[:, None, None]  # [B, Sn, 1]
    # the shape's frame (circumradius 1), per shape so every [B, Sn, Sn] tensor is made once
    cos_r, sin_r = (torch.cos(angle) / radius)[:, None, None], (torch.sin(angle) / radius)[:, None, None]
    inside = torch.zeros(batch, size * n, size * n, dtype=torch.bool, device=dev)
    for k, name in enumerate(SHAPES):
        rows = (shape == k).nonzero().flatten()
        if len(rows):
            xs, ys, c, s = x[rows], y[rows], cos_r[rows], sin_r[rows]
            lx, ly = xs * c + ys * s, ys * c - xs * s  # [b, Sn, Sn]
            inside[rows] = INSIDE[name](lx, ly, star_inner[rows], cross_arm[rows])
    # the mean of each pixel's n x n points: n^2 strided sums (avg_pool2d was ~3x slower here)
    return sum(inside[:, i::n, j::n].float() for i in range(n) for j in range(n)) / (n * n)


def blur(alpha: torch.Tensor, short: torch.Tensor, gen: torch.Generator) -> torch.Tensor:
    """The resize filter (always) plus, for 30%, the image's own blur, in output pixels, applied to
    float [B, S, S] masks. `short` [B] is each original's short side."""
    batch, size, dev = len(alpha), alpha.shape[-1], alpha.device
    u = lambda *shape: torch.rand(*shape, generator=gen, device=dev)  # noqa: E731
    scale = (size / short).clamp(max=1.5)
    sigma = 0.25 + u(batch) * 0.5
    blurred = u(batch) < 0.3
    sigma = torch.where(
        blurred, torch.hypot(sigma, (0.4 + u(batch) * 1.2) * torch.clamp(short / 256, min=1.0) * scale), sigma
    )
    return gaussian_blur(alpha[:, None], sigma)[:, 0]


def finish(rgb: torch.Tensor, short: torch.Tensor, gen: torch.Generator, noise: torch.Tensor | None = None):
    """Sensor-like noise and, for some, a JPEG round trip of float [B, 3, S, S] (overwritten);
    uint8 out.
    `noise`: unit-std fields [B, 3, S, S] to scale, else drawn here."""
    batch, size, dev = len(rgb), rgb.shape[-1], rgb.device
    u = lambda *shape: torch.rand(*shape, generator=gen, device=dev)  # noqa: E731
    if noise is None:  # uniform, unit std (a Gaussian's costs ~3x more to draw on a CPU, and looks alike here)
        noise = (torch.rand(rgb.shape, generator=gen, device=dev) - 0.5) * math.sqrt(12)
    rgb = rgb.addcmul_(noise, (u(batch) * 2.0)[:, None, None, None])  # in place: rgb is ours
    pixels = rgb.clamp_(0, 255).add_(0.5).to(torch.uint8)  # the cast truncates: round half up

    # JPEG blocks and chroma subsampling survive the resize only when the original is small
    jpeg = u(batch) < torch.where(short < 2 * size, 0.5, 0.15)
    quality = (60 + u(batch) * 36).long()
    for row in jpeg.nonzero().flatten().tolist():
        pixels[row] = jpeg_round_trip(pixels[row].cpu(), int(quality[row])).to(dev)
    return pixels


def jittered(rgb: torch.Tensor, jitter: int, gen: torch.Generator) -> torch.Tensor:
    noise = torch.randint(-jitter, jitter + 1, rgb.shape, generator=gen, device=rgb.device).float()
    return (rgb + noise).clamp(0, 255)


def gaussian_blur(images: torch.Tensor, sigma: torch.Tensor) -> torch.Tensor:
    """Separable Gaussian of a per-image sigma (pixels) over float [B, C, H, W], edges replicated."""
    b, c, h, w = images.shape
    radius = max(1, math.ceil(3 * float(sigma.max())))
    taps = torch.arange(-radius, radius + 1, dtype=torch.float32, device=images.device)
    kernel = torch.exp(-0.5 * (taps[None] / sigma[:, None]) ** 2)
    kernel = (kernel / kernel.sum(1, keepdim=True)).repeat_interleave(c, 0)  # [B*C, K]
    flat = images.reshape(1, b * c, h, w)
    flat = F.conv2d(F.pad(flat, (radius, radius, 0, 0), mode="replicate"), kernel[:, None, None, :], groups=b * c)
    flat = F.conv2d(F.pad(flat, (0, 0, radius, radius), mode="replicate"), kernel[:, None, :, None], groups=b * c)
    return flat.reshape(b, c, h, w)


def jpeg_round_trip(pixels: torch.Tensor, quality: int) -> torch.Tensor:
    out = io.BytesIO()
    Image.fromarray(pixels.permute(1, 2, 0).numpy()).save(out, format="JPEG", quality=quality)
    back = np.array(Image.open(out))  # [S, S, 3]: baseline JPEG of RGB decodes as RGB
    return torch.from_numpy(back).permute(2, 0, 1)


# Inside tests in the shape's own frame (circumradius 1); arguments [N, H, W] and per-item [N].
def _circle(x, y, inner, arm):
    return x * x + y * y < 1.0


def _square(x, y, inner, arm):
    half = math.sqrt(0.5)  # corners on the unit circle
    return (x.abs() < half) & (y.abs() < half)


def _triangle(x, y, inner, arm):
    # corners at 90, 210 and 330 degrees; edges at distance 0.5 with outward normals 270, 30, 150
    inside = -y < 0.5
    for degrees in (30.0, 150.0):
        t = math.radians(degrees)
        inside &= x * math.cos(t) + y * math.sin(t) < 0.5
    return inside


def _star(x, y, inner, arm):
    # fold the angle into one half point: phi in [0, 36] degrees from an outer corner
    step = 2 * math.pi / 5
    theta = torch.remainder(torch.atan2(y, x) - math.pi / 2, step)
    phi = torch.minimum(theta, step - theta)
    rho = torch.hypot(x, y)
    qx, qy = rho * torch.cos(phi), rho * torch.sin(phi)
    # the edge from the outer corner (1, 0) to the inner one inner * (cos 36, sin 36)
    ri = inner[:, None, None]
    bx, by = ri * math.cos(step / 2) - 1.0, ri * math.sin(step / 2)
    return bx * qy - by * (qx - 1.0) > 0  # on the centre's side of the edge


def _cross(x, y, inner, arm):
    a = arm[:, None, None]
    reach = 1.0 / torch.sqrt(1.0 + a * a)  # arm tip corners on the unit circle
    w = a * reach
    ax, ay = x.abs(), y.abs()
    return ((ax < reach) & (ay < w)) | ((ay < reach) & (ax < w))


INSIDE = {"circle": _circle, "square": _square, "triangle": _triangle, "star": _star, "cross": _cross}
