"""wicore.ops.image_preprocess against transformers' own PIL image processor, bit for bit."""

from __future__ import annotations

import io
import json
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest
import torch
from PIL import Image
from transformers import AutoImageProcessor
from transformers.models.gemma3.image_processing_pil_gemma3 import Gemma3ImageProcessorPil

from wicore.errors import ConfigError
from wicore.ops.image_decode import decode_image
from wicore.ops.image_preprocess import PreprocessSpec, apply_lut, pixel_values, resized_images

RNG = np.random.default_rng(0)
SIZES = [(1, 1), (7, 300), (300, 7), (64, 64), (1000, 700), (896, 896)]  # (width, height)


def gemma3_processor(size: int, **settings) -> Gemma3ImageProcessorPil:
    """As wicore.models.gemma3.make_processor builds it."""
    settings = {"image_mean": [0.5, 0.5, 0.5], "image_std": [0.5, 0.5, 0.5], **settings}
    return Gemma3ImageProcessorPil(size={"height": size, "width": size}, **settings)


def random_image(width: int, height: int, mode: str = "RGB") -> Image.Image:
    channels = {"RGB": 3, "RGBA": 4, "L": 1}[mode]
    array = RNG.integers(0, 256, (height, width, channels), dtype=np.uint8)
    return Image.fromarray(array.squeeze(-1) if channels == 1 else array)


def hf_pixel_values(processor, images: list[Image.Image]) -> np.ndarray:
    return processor(images, return_tensors="np")["pixel_values"]


def assert_same_bits(ours: np.ndarray, theirs: np.ndarray) -> None:
    assert ours.dtype == theirs.dtype == np.float32
    assert ours.shape == theirs.shape
    assert np.array_equal(ours.view(np.uint32), theirs.view(np.uint32)), np.abs(ours - theirs).max()


@pytest.mark.parametrize("target", [64, 896])
def test_bit_exact_with_gemma3_processor_for_many_sizes(target):
    processor = gemma3_processor(target)
    images = [random_image(w, h) for w, h in SIZES]
    ours = pixel_values(images, PreprocessSpec.from_hf(processor))
    assert ours.shape == (len(SIZES), 3, target, target)
    assert_same_bits(ours, hf_pixel_values(processor, images))


def test_non_rgb_images_are_converted_as_transformers_does():
    processor = gemma3_processor(64)
    palette = random_image(30, 20).convert("P")
    palette.info["transparency"] = 7
    images = [random_image(50, 40, "RGBA"), random_image(33, 90, "L"), palette, random_image(9, 9).convert("1")]
    assert_same_bits(pixel_values(images, PreprocessSpec.from_hf(processor)), hf_pixel_values(processor, images))


def test_decoded_file_gives_what_the_original_gives_hf():
    processor = gemma3_processor(64)
    buffer = io.BytesIO()
    random_image(120, 80, "RGBA").save(buffer, "PNG")
    original = Image.open(io.BytesIO(buffer.getvalue()))
    ours = pixel_values([decode_image(buffer.getvalue())], PreprocessSpec.from_hf(processor))
    assert_same_bits(ours, hf_pixel_values(processor, [original]))


@pytest.mark.parametrize(
    "settings",
    [
        {"image_mean": [0.48145466, 0.4578275, 0.40821073], "image_std": [0.26862954, 0.26130258, 0.27577711]},
        {"image_mean": 0.5, "image_std": 0.25},
        {"resample": Image.Resampling.BICUBIC},
        {"resample": Image.Resampling.NEAREST},
        {"do_normalize": False},
        {"do_rescale": False},
        {"rescale_factor": 1 / 127.5},
    ],
    ids=["clip mean/std", "scalar mean/std", "bicubic", "nearest", "no normalize", "no rescale", "rescale 1/127.5"],
)
def test_bit_exact_for_other_settings(settings):
    processor = gemma3_processor(48, **settings)
    images = [random_image(w, h) for w, h in [(100, 70), (5, 60), (48, 48)]]
    ours = pixel_values(images, PreprocessSpec.from_hf(processor))
    assert_same_bits(ours, hf_pixel_values(processor, images).astype(np.float32))


def test_from_hf_reads_gemma3_checkpoint_config(tmp_path):
    """The preprocessor_config.json that Gemma-3 checkpoints ship (nulls included)."""
    config = {
        "do_convert_rgb": None,
        "do_normalize": True,
        "do_pan_and_scan": None,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": [0.5, 0.5, 0.5],
        "image_processor_type": "Gemma3ImageProcessor",
        "image_seq_length": 256,
        "image_std": [0.5, 0.5, 0.5],
        "pan_and_scan_max_num_crops": None,
        "pan_and_scan_min_crop_size": None,
        "pan_and_scan_min_ratio_to_activate": None,
        "processor_class": "Gemma3Processor",
        "resample": 2,
        "rescale_factor": 0.00392156862745098,
        "size": {"height": 896, "width": 896},
    }
    (tmp_path / "preprocessor_config.json").write_text(json.dumps(config))
    processor = AutoImageProcessor.from_pretrained(tmp_path)
    spec = PreprocessSpec.from_hf(processor)
    assert spec == PreprocessSpec(size=(896, 896), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    images = [random_image(300, 200)]
    assert_same_bits(pixel_values(images, spec), hf_pixel_values(processor, images))


@pytest.mark.parametrize(
    ("settings", "words"),
    [
        ({"do_pan_and_scan": True}, "do_pan_and_scan"),
        ({"do_center_crop": True, "crop_size": {"height": 8, "width": 8}}, "do_center_crop"),
        ({"do_pad": True}, "do_pad"),
        ({"do_resize": False}, "do_resize"),
    ],
)
def test_from_hf_refuses_steps_we_do_not_reproduce(settings, words):
    with pytest.raises(ConfigError, match=words):
        PreprocessSpec.from_hf(gemma3_processor(64, **settings))


def test_from_hf_refuses_aspect_preserving_sizes():
    processor = Gemma3ImageProcessorPil(size={"shortest_edge": 224})
    with pytest.raises(ConfigError, match="height and width"):
        PreprocessSpec.from_hf(processor)


@pytest.mark.parametrize(
    "fields",
    [
        {"size": (0, 64)},
        {"size": (64,)},
        {"mean": (0.5, 0.5)},
        {"std": (0.5, 0.0, 0.5)},
        {"resample": 99},
    ],
)
def test_spec_validates_its_fields(fields):
    good = {"size": (64, 64), "mean": (0.5, 0.5, 0.5), "std": (0.5, 0.5, 0.5)}
    with pytest.raises(ConfigError):
        PreprocessSpec(**{**good, **fields})


def test_non_square_target_is_height_then_width():
    spec = PreprocessSpec(size=(32, 48), mean=(0.0, 0.0, 0.0), std=(1.0, 1.0, 1.0), rescale=1.0)
    image = Image.new("RGB", (10, 10), (1, 2, 3))
    values = pixel_values([image], spec)
    assert values.shape == (1, 3, 32, 48)
    assert values[0, :, 5, 5].tolist() == [1.0, 2.0, 3.0]


def test_empty_batch():
    spec = PreprocessSpec(size=(16, 16), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    assert pixel_values([], spec).shape == (0, 3, 16, 16)


def lut_on_resized(images: list[Image.Image], spec: PreprocessSpec, dtype=torch.float32) -> torch.Tensor:
    """The engine's split path: uint8 on the host, the lookup table applied by torch."""
    return apply_lut(torch.from_numpy(resized_images(images, spec)), torch.from_numpy(spec.lut).to(dtype))


def test_resized_images_are_uint8_height_width_channels():
    spec = PreprocessSpec(size=(32, 48), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    resized = resized_images([Image.new("RGB", (10, 10), (1, 2, 3)), random_image(70, 20, "L")], spec)
    assert resized.dtype == np.uint8 and resized.shape == (2, 32, 48, 3)
    assert resized[0, 5, 5].tolist() == [1, 2, 3]
    assert resized_images([], spec).shape == (0, 32, 48, 3)


@pytest.mark.parametrize("target", [48, 896])
def test_lut_on_resized_images_has_the_same_bits(target):
    """Larger and smaller than the target, non-RGB modes, a non-square target: as pixel_values."""
    spec = PreprocessSpec.from_hf(gemma3_processor(target))
    palette = random_image(30, 20).convert("P")
    images = [random_image(1000, 700), random_image(7, 300), random_image(50, 40, "RGBA"), random_image(9, 33, "L")]
    images.append(palette)
    assert_same_bits(lut_on_resized(images, spec).numpy(), pixel_values(images, spec))
    wide = replace(spec, size=(24, 40))
    assert_same_bits(lut_on_resized(images, wide).numpy(), pixel_values(images, wide))


def test_lut_cast_first_equals_values_cast_after():
    """The engine casts the table once instead of every batch's pixels: the same bits."""
    spec = PreprocessSpec.from_hf(gemma3_processor(40))
    images = [random_image(64, 50), random_image(20, 80, "RGBA")]
    got = lut_on_resized(images, spec, torch.bfloat16)
    assert got.dtype == torch.bfloat16 and got.is_contiguous()
    assert torch.equal(got, torch.from_numpy(pixel_values(images, spec)).to(torch.bfloat16))


def test_lut_of_an_empty_batch():
    spec = PreprocessSpec(size=(16, 8), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    assert lut_on_resized([], spec).shape == (0, 3, 16, 8)


def test_thread_pool_gives_the_serial_result():
    spec = PreprocessSpec.from_hf(gemma3_processor(96))
    batches = [[random_image(int(w), int(h)) for w, h in RNG.integers(1, 300, (3, 2))] for _ in range(8)]
    serial = [pixel_values(batch, spec) for batch in batches]
    fresh_spec = PreprocessSpec.from_hf(gemma3_processor(96))  # its lookup table is built under contention
    with ThreadPoolExecutor(max_workers=4) as pool:
        threaded = list(pool.map(lambda batch: pixel_values(batch, fresh_spec), batches))
    for one, other in zip(serial, threaded, strict=True):
        assert np.array_equal(one, other)


def test_images_resized_elsewhere_are_taken_as_they_are_if_they_fit_the_spec():
    from wicore.ops.image_preprocess import is_resized, stack_resized

    spec = PreprocessSpec(size=(4, 6), mean=(0.5, 0.5, 0.5), std=(0.5, 0.5, 0.5))
    rows = [np.full((4, 6, 3), v, dtype=np.uint8) for v in (1, 2)]
    assert is_resized(rows) and not is_resized([]) and not is_resized([Image.new("RGB", (6, 4)), rows[0]])
    one = stack_resized(rows[:1], spec)
    assert one.shape == (1, 4, 6, 3) and np.shares_memory(one, rows[0]), "one image: a view"
    assert stack_resized(rows, spec)[:, 0, 0, 0].tolist() == [1, 2]
    for bad in (np.zeros((6, 4, 3), np.uint8), np.zeros((4, 6, 3), np.float32)):
        with pytest.raises(ConfigError, match="a resized image must be uint8"):
            stack_resized([bad], spec)
