"""wicore.ops.image_decode: decoding, limits and errors. Images are made here with Pillow, in memory."""

from __future__ import annotations

import io
import os
import struct
import subprocess
import sys
import time
import zlib

import numpy as np
import pytest
from PIL import Image
from transformers.image_transforms import convert_to_rgb

from wicore.errors import ConfigError, ImageError, ImageTooLarge
from wicore.ops.image_decode import (
    REDUCING_GAP,
    ImageLimits,
    decode_image,
    read_image_file,
    shrink_factors,
    working_bytes,
)

RNG = np.random.default_rng(0)
RGBA = Image.fromarray(RNG.integers(0, 256, (30, 40, 4), dtype=np.uint8))  # 40 x 30, random alpha


def encode(image: Image.Image, fmt: str, **options) -> bytes:
    buffer = io.BytesIO()
    image.save(buffer, fmt, **options)
    return buffer.getvalue()


def png_chunk(kind: bytes, body: bytes) -> bytes:
    return struct.pack(">I", len(body)) + kind + body + struct.pack(">I", zlib.crc32(kind + body))


def png_header_only(width: int, height: int) -> bytes:
    """A PNG with only IHDR and IEND: decoding any pixel would fail as truncated, not as too large."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB
    return b"\x89PNG\r\n\x1a\n" + png_chunk(b"IHDR", ihdr) + png_chunk(b"IEND", b"")


def jpeg_claiming(width: int, height: int) -> bytes:
    """A real 16x16 JPEG whose SOF0 header is rewritten to claim width x height."""
    data = bytearray(encode(Image.new("RGB", (16, 16)), "JPEG"))
    sof = data.index(b"\xff\xc0")
    data[sof + 5 : sof + 9] = struct.pack(">HH", height, width)
    return bytes(data)


def gif_claiming(width: int, height: int) -> bytes:
    data = bytearray(encode(Image.new("P", (4, 4)), "GIF"))
    data[6:10] = struct.pack("<HH", width, height)  # logical screen size
    return bytes(data)


# --- EXIF orientation -----------------------------------------------------------------------------

TRANSPOSE_FOR_ORIENTATION = {
    2: Image.Transpose.FLIP_LEFT_RIGHT,
    3: Image.Transpose.ROTATE_180,
    4: Image.Transpose.FLIP_TOP_BOTTOM,
    5: Image.Transpose.TRANSPOSE,
    6: Image.Transpose.ROTATE_270,
    7: Image.Transpose.TRANSVERSE,
    8: Image.Transpose.ROTATE_90,
}


@pytest.mark.parametrize("orientation", sorted(TRANSPOSE_FOR_ORIENTATION))
def test_exif_orientation_is_applied_exactly_to_png(orientation):
    stored = RGBA.convert("RGB")
    exif = Image.Exif()
    exif[0x0112] = orientation
    decoded = decode_image(encode(stored, "PNG", exif=exif))
    expected = stored.transpose(TRANSPOSE_FOR_ORIENTATION[orientation])
    assert decoded.size == expected.size
    assert np.array_equal(np.asarray(decoded), np.asarray(expected))


def test_exif_orientation_6_turns_a_landscape_jpeg_upright():
    stored = Image.new("RGB", (40, 20), (255, 0, 0))  # top half red
    stored.paste((0, 0, 255), (0, 10, 40, 20))  # bottom half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display"
    decoded = decode_image(encode(stored, "JPEG", exif=exif, quality=95))
    pixels = np.asarray(decoded).astype(int)
    assert decoded.size == (20, 40)  # portrait now
    assert np.abs(pixels[20, 15] - (255, 0, 0)).max() < 8  # the top went to the right
    assert np.abs(pixels[20, 4] - (0, 0, 255)).max() < 8
    assert decoded.getexif().get(0x0112) is None


# --- modes ----------------------------------------------------------------------------------------

MODE_CASES = {
    "RGB jpeg": lambda: encode(RGBA.convert("RGB"), "JPEG"),
    "L png": lambda: encode(RGBA.convert("L"), "PNG"),
    "LA png": lambda: encode(RGBA.convert("LA"), "PNG"),
    "RGBA png": lambda: encode(RGBA, "PNG"),
    "RGBA webp": lambda: encode(RGBA, "WEBP", lossless=True),
    "LA tiff": lambda: encode(RGBA.convert("LA"), "TIFF"),
    "P png": lambda: encode(RGBA.convert("RGB").convert("P"), "PNG"),
    "P png with transparency": lambda: encode(RGBA.convert("RGB").convert("P"), "PNG", transparency=3),
    "L png with transparency": lambda: encode(RGBA.convert("L"), "PNG", transparency=100),
    "RGB png with transparency": lambda: encode(
        RGBA.convert("RGB").point(lambda v: v // 64 * 64), "PNG", transparency=(64, 128, 0)
    ),
    "P gif with transparency": lambda: encode(RGBA.convert("RGB").convert("P"), "GIF", transparency=0),
    "CMYK jpeg": lambda: encode(RGBA.convert("RGB").convert("CMYK"), "JPEG"),
    "1-bit png": lambda: encode(RGBA.convert("1"), "PNG"),
}


@pytest.mark.parametrize("case", sorted(MODE_CASES))
def test_every_mode_decodes_to_what_transformers_would_see(case):
    data = MODE_CASES[case]()
    decoded = decode_image(data)
    original = Image.open(io.BytesIO(data))
    assert decoded.mode == "RGB" and decoded.size == original.size
    assert type(decoded) is Image.Image  # detached from the file, pixels loaded
    # Our RGB image is what HF makes of the original, and HF makes nothing else of ours.
    assert np.array_equal(np.asarray(decoded), convert_to_rgb(original, return_numpy=True))
    assert np.array_equal(convert_to_rgb(decoded, return_numpy=True), np.asarray(decoded))


def test_alpha_is_composited_onto_white():
    rgba = Image.new("RGBA", (3, 1))
    rgba.putdata([(255, 0, 0, 0), (255, 0, 0, 255), (0, 0, 0, 128)])  # clear, opaque, half
    pixels = np.asarray(decode_image(encode(rgba, "PNG")))
    assert pixels[0].tolist() == [[255, 255, 255], [255, 0, 0], [127, 127, 127]]


def test_palette_transparency_is_composited_onto_white():
    palette = Image.new("P", (2, 1))
    palette.putpalette([0, 0, 0, 255, 0, 0] + [0] * 762)
    palette.putdata([0, 1])
    pixels = np.asarray(decode_image(encode(palette, "PNG", transparency=1)))
    assert pixels[0].tolist() == [[0, 0, 0], [255, 255, 255]]


RAMP_16 = np.array([[0, 257, 32896, 65535]], dtype=np.uint16)


@pytest.mark.parametrize(
    ("array", "fmt", "mode", "expected"),
    [
        (RAMP_16, "PNG", "I;16", [0, 1, 128, 255]),  # Pillow's own convert would give [0, 255, 255, 255]
        (RAMP_16, "TIFF", "I;16", [0, 1, 128, 255]),
        (RAMP_16.astype(np.int32), "TIFF", "I", [0, 1, 128, 255]),
        (np.array([[0, 7, 200, 255]], dtype=np.int32), "TIFF", "I", [0, 7, 200, 255]),
        (np.array([[-100, 0, 100, 155]], dtype=np.int32), "TIFF", "I", [0, 100, 200, 255]),
        (np.array([[0.0, 0.25, 0.5, 1.0]], dtype=np.float32), "TIFF", "F", [0, 64, 128, 255]),
        (np.array([[0.0, 10.0, 200.4, 255.0]], dtype=np.float32), "TIFF", "F", [0, 10, 200, 255]),
    ],
)
def test_deep_grayscale_is_scaled_not_clipped(array, fmt, mode, expected):
    data = encode(Image.fromarray(array), fmt)
    assert Image.open(io.BytesIO(data)).mode == mode
    pixels = np.asarray(decode_image(data))
    assert pixels.shape == (1, 4, 3)
    assert pixels[0, :, 0].tolist() == expected
    assert np.array_equal(pixels[..., 0], pixels[..., 2])  # gray


@pytest.mark.parametrize("fmt", ["GIF", "WEBP", "PNG"])
def test_animation_gives_its_first_frame(fmt):
    red, blue = Image.new("RGB", (8, 8), (255, 0, 0)), Image.new("RGB", (8, 8), (0, 0, 255))
    options = {"lossless": True} if fmt == "WEBP" else {}
    data = encode(red, fmt, save_all=True, append_images=[blue], **options)
    assert Image.open(io.BytesIO(data)).n_frames == 2
    assert np.asarray(decode_image(data))[4, 4].tolist() == [255, 0, 0]


# --- broken input ---------------------------------------------------------------------------------

PNG = encode(RGBA.convert("RGB"), "PNG")
JPEG = encode(RGBA.convert("RGB"), "JPEG")


@pytest.mark.parametrize(
    ("data", "words"),
    [
        (PNG[: len(PNG) // 2], "truncated"),
        (PNG[:60], "truncated"),
        (JPEG[: len(JPEG) // 2], "truncated"),
        (JPEG[:200], "truncated"),
        (RNG.bytes(4096), "not an image"),
        (b"<!DOCTYPE html><html>404</html>", "not an image"),
        (PNG[:8], "not an image"),
        (b"", "empty"),
    ],
    ids=["png half", "png 60 bytes", "jpeg half", "jpeg 200 bytes", "random", "html", "png signature", "empty"],
)
def test_broken_bytes_give_a_one_line_image_error(data, words):
    with pytest.raises(ImageError, match=words) as caught:
        decode_image(data)
    assert type(caught.value) is ImageError
    assert "\n" not in str(caught.value)


def test_corrupt_pixel_data_is_an_image_error():
    start = PNG.index(b"IDAT") + 4
    broken = PNG[:start] + bytes(b ^ 0x5A for b in PNG[start : start + 64]) + PNG[start + 64 :]
    with pytest.raises(ImageError):
        decode_image(broken)


def test_no_pillow_exception_escapes_from_mutated_files():
    rng = np.random.default_rng(1)
    for original in (PNG, JPEG, MODE_CASES["RGBA webp"](), MODE_CASES["P gif with transparency"]()):
        for _ in range(25):
            data = bytearray(original)
            for spot in rng.integers(0, len(data), size=4):
                data[spot] = int(rng.integers(0, 256))
            try:
                image = decode_image(bytes(data))
            except ImageError:
                continue  # the one allowed failure; any other exception type fails the test
            assert image.mode == "RGB"


# --- limits ---------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "data",
    [png_header_only(100_000, 100_000), png_header_only(10_000, 6_000), jpeg_claiming(10_000, 6_000)]
    + [gif_claiming(60_000, 60_000)],
    ids=["png 100k x 100k", "png 60 Mpx", "jpeg 60 Mpx", "gif 3.6 Gpx"],
)
def test_decompression_bombs_are_refused_from_the_header(data):
    started = time.process_time()  # CPU time: a descheduled test is not a slow refusal
    with pytest.raises(ImageTooLarge, match="50,000,000 pixels"):
        decode_image(data)  # a truncated-data ImageError instead would mean decoding had begun
    assert time.process_time() - started < 1.0
    assert len(data) < 1000


def test_our_message_names_the_size_and_the_limit():
    with pytest.raises(ImageTooLarge, match=r"10000x6000 = 60,000,000 pixels, over the limit of 50,000,000"):
        decode_image(png_header_only(10_000, 6_000))


@pytest.mark.parametrize("size", [(100_000, 100_000), (10_000, 6_000)], ids=["past Pillow's own limit", "past ours"])
def test_a_too_large_image_message_names_one_limit(size):
    with pytest.raises(ImageTooLarge) as refused:
        decode_image(png_header_only(*size))
    message = str(refused.value)
    assert f"{size[0] * size[1]:,} pixels" in message and message.count("limit") == 1, message
    assert message.endswith("over the limit of 50,000,000 pixels; raise the setting max_image_pixels to allow it")


def test_pixel_limit():
    image = encode(Image.new("RGB", (20, 20)), "PNG")
    with pytest.raises(ImageTooLarge, match="20x20 = 400 pixels, over the limit of 399"):
        decode_image(image, ImageLimits(max_pixels=399))
    assert decode_image(image, ImageLimits(max_pixels=400)).size == (20, 20)


def test_byte_limit_is_checked_before_parsing():
    with pytest.raises(ImageTooLarge, match="1,001 bytes, over the limit of 1,000 bytes"):
        decode_image(RNG.bytes(1001), ImageLimits(max_bytes=1000))  # not even an image


def test_pillow_limit_caps_ours_and_its_warning_becomes_our_error(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300)
    with pytest.warns(Image.DecompressionBombWarning), pytest.raises(ImageTooLarge, match="limit of 300"):
        decode_image(encode(Image.new("RGB", (20, 20)), "PNG"))  # 400 px: Pillow warns, we refuse
    with pytest.raises(ImageTooLarge, match="limit of 300"):
        decode_image(encode(Image.new("RGB", (30, 30)), "PNG"))  # 900 px: Pillow's own error, mapped


@pytest.mark.filterwarnings("error::PIL.Image.DecompressionBombWarning")
def test_pillow_warning_raised_as_error_is_mapped(monkeypatch):
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 300)
    with pytest.raises(ImageTooLarge):
        decode_image(encode(Image.new("RGB", (20, 20)), "PNG"))


@pytest.mark.parametrize("limits", [{"max_bytes": 0}, {"max_pixels": -1}])
def test_limits_must_be_positive(limits):
    with pytest.raises(ConfigError):
        ImageLimits(**limits)


# --- files ----------------------------------------------------------------------------------------


def test_read_image_file(tmp_path):
    path = tmp_path / "a.png"
    path.write_bytes(PNG)
    assert read_image_file(path) == PNG
    assert read_image_file(str(path), ImageLimits(max_bytes=len(PNG))) == PNG


def test_file_over_the_byte_limit_is_refused_before_reading(tmp_path):
    path = tmp_path / "huge.png"
    with path.open("wb") as file:
        file.truncate(2**40)  # sparse: 1 TiB that costs no disk and must never be read
    with pytest.raises(ImageTooLarge, match="1,099,511,627,776 bytes, over the limit"):
        read_image_file(path)


def test_missing_file(tmp_path):
    with pytest.raises(ImageError, match="image file not found"):
        read_image_file(tmp_path / "nope.png")


def test_directory(tmp_path):
    with pytest.raises(ImageError, match="is a directory"):
        read_image_file(tmp_path)


def test_empty_file(tmp_path):
    (tmp_path / "empty.png").write_bytes(b"")
    with pytest.raises(ImageError, match="empty"):
        read_image_file(tmp_path / "empty.png")


def test_fifo_is_refused_without_blocking(tmp_path):
    os.mkfifo(tmp_path / "pipe")
    with pytest.raises(ImageError, match="not a regular file"):
        read_image_file(tmp_path / "pipe")


@pytest.mark.skipif(os.geteuid() == 0, reason="root reads any file")
def test_unreadable_file(tmp_path):
    path = tmp_path / "secret.png"
    path.write_bytes(PNG)
    path.chmod(0)
    with pytest.raises(ImageError, match="no permission"):
        read_image_file(path)


def test_permission_error_is_mapped(tmp_path, monkeypatch):
    """The same mapping, for test runs as root (which may read any file)."""
    path = tmp_path / "secret.png"
    path.write_bytes(PNG)

    def refuse(*args, **kwargs):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(type(path), "open", refuse)
    with pytest.raises(ImageError, match="no permission to read image file"):
        read_image_file(path)


def test_ops_imports_no_queue_or_model_libraries():
    """ops/ never imports Redis or RQ; torch and transformers stay lazy, so importing ops is cheap."""
    code = (
        "import sys, wicore.ops.image_decode, wicore.ops.image_preprocess, wicore.ops.rgb\n"
        "print(sorted({m.split('.')[0] for m in sys.modules} & {'redis', 'rq', 'torch', 'transformers'}))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert result.stdout.strip() == "[]"


# --- shrinking on load ----------------------------------------------------------------------------


def resized(image: Image.Image, fit: tuple[int, int]) -> np.ndarray:
    """What the engines make of a decoded image: a BILINEAR resize to `fit` (height, width)."""
    return np.asarray(image.resize((fit[1], fit[0]), Image.Resampling.BILINEAR)).astype(int)


def upscaled(case: str, size: tuple[int, int] = (480, 360)) -> bytes:
    """MODE_CASES' image, 12 times larger, in the same mode and format."""
    original = Image.open(io.BytesIO(MODE_CASES[case]()))
    options = {"transparency": original.info["transparency"]} if "transparency" in original.info else {}
    return encode(original.resize(size, Image.Resampling.NEAREST), original.format, **options)


@pytest.mark.parametrize("case", sorted(MODE_CASES))
def test_an_image_not_far_larger_than_fit_decodes_as_without_it(case):
    data = MODE_CASES[case]()  # 40 x 30: under REDUCING_GAP times (10, 14)
    assert np.array_equal(np.asarray(decode_image(data, fit=(10, 14))), np.asarray(decode_image(data)))


@pytest.mark.parametrize("case", sorted(MODE_CASES))
def test_a_far_larger_image_shrinks_on_load_to_what_the_engines_would_see_anyway(case):
    data, fit = upscaled(case), (20, 30)
    shrunk, whole = decode_image(data, fit=fit), decode_image(data)
    # JPEG: decoded at 1/4 scale (120 x 90 >= 3 x 30 on both axes); others reduced by (5, 6)
    assert shrunk.mode == "RGB" and shrunk.size == ((120, 90) if "jpeg" in case else (96, 60))
    # Random pixels: the hardest case for averaging in two steps, and still a few levels apart.
    difference = np.abs(resized(shrunk, fit) - resized(whole, fit))
    assert difference.mean() < 2.5 and difference.max() <= 8, (difference.mean(), difference.max())


def test_shrink_factors_stop_at_the_reducing_gap():
    assert REDUCING_GAP == 3.0
    assert shrink_factors((7000, 7000), (896, 896)) == (2, 2)
    assert shrink_factors((7000, 7000), (128, 128)) == (18, 18)
    assert shrink_factors((2687, 5376), (896, 896)) == (1, 2)
    assert shrink_factors((100, 100), (896, 896)) == (1, 1)


def test_a_far_larger_jpeg_is_scaled_in_its_decoder():
    data = encode(Image.new("RGB", (4096, 4096), (200, 30, 30)), "JPEG")
    # DCT scaling to 1/8 (512 >= 3 x 128); a reduce alone would give 4096 / 10 = 410
    assert decode_image(data, fit=(128, 128)).size == (512, 512)


@pytest.mark.parametrize("fmt", ["PNG", "JPEG"])
def test_a_turned_image_shrinks_along_its_upright_axes(fmt):
    stored = Image.new("RGB", (1200, 600), (255, 0, 0))  # top half red
    stored.paste((0, 0, 255), (0, 300, 1200, 600))  # bottom half blue
    exif = Image.Exif()
    exif[0x0112] = 6  # "rotate 90 degrees clockwise to display": 600 x 1200 upright
    decoded = decode_image(encode(stored, fmt, exif=exif), fit=(100, 50))  # upright (height, width)
    assert decoded.size == (150, 300)  # factors 4 and 4, not 8 and 2 of the stored axes
    pixels = np.asarray(decoded).astype(int)
    assert np.abs(pixels[150, 100] - (255, 0, 0)).max() < 8  # the top went to the right
    assert np.abs(pixels[150, 40] - (0, 0, 255)).max() < 8


@pytest.mark.parametrize(
    ("mode", "per_pixel"),
    [("RGB", 5), ("L", 2), ("RGBA", 9), ("LA", 9), ("P", 6), ("1", 6), ("I;16", 29)],
)
def test_working_bytes_count_the_buffer_and_its_full_size_copies(mode, per_pixel):
    image = Image.open(io.BytesIO(encode(Image.new(mode, (30, 20)), "PNG" if mode != "1" else "BMP")))
    assert working_bytes(image) == 600 * per_pixel


def test_a_palette_with_transparency_counts_its_rgba_copies():
    image = Image.open(io.BytesIO(MODE_CASES["P png with transparency"]()))
    assert working_bytes(image) == 40 * 30 * (1 + 4 + 4 + 1)


def heic_bytes(size: tuple[int, int] = (64, 48)) -> bytes:
    import pillow_heif

    image = Image.new("RGB", size, (200, 10, 10))
    out = io.BytesIO()
    pillow_heif.from_pillow(image).save(out, format="HEIF")
    return out.getvalue()


def test_heic_decodes_through_pillow_heif():
    image = decode_image(heic_bytes())
    assert image.size == (64, 48) and image.mode == "RGB"
    red, green, _ = image.getpixel((32, 24))
    assert red > 150 and green < 60


def test_without_pillow_heif_a_heic_image_is_named_as_such(tmp_path):
    """In a process where pillow_heif cannot be imported."""
    sample = tmp_path / "photo.heic"
    sample.write_bytes(heic_bytes())
    code = (
        "import sys; sys.modules['pillow_heif'] = None\n"
        "from wicore.ops.image_decode import decode_image\n"
        "from wicore.errors import ImageError\n"
        f"data = open({str(sample)!r}, 'rb').read()\n"
        "try:\n    decode_image(data)\nexcept ImageError as exc:\n    print(exc)\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == (
        "a HEIC/HEIF image: the worker needs pillow-heif to read it (pip install 'wicore[heif]')"
    )
