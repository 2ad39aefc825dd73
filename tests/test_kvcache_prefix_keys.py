"""The model id that salts prefix keys, and the image digests inside them."""

from __future__ import annotations

import shutil
from types import SimpleNamespace

import pytest
from PIL import Image

from wicore.engines.kvcache.kv_layout import KVLayout
from wicore.engines.kvcache.prefix_keys import image_digests, model_fingerprint
from wicore.errors import JobInputError


def layout(block_size=16):
    config = SimpleNamespace(layer_types=["sliding_attention", "full_attention"], sliding_window=64)
    return KVLayout.build(config, block_size=block_size, max_model_len=256)


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    out = tmp_path / "model"
    shutil.copytree(tiny_model_dir, out)
    return out


def test_model_id_changes_whenever_the_kv_would(model_copy, tmp_path):
    base = model_fingerprint(model_copy, "float32", layout())
    moved = tmp_path / "elsewhere"
    shutil.copytree(model_copy, moved)
    assert model_fingerprint(moved, "float32", layout()) == base  # no paths, no times
    assert model_fingerprint(model_copy, "bfloat16", layout()) != base
    assert model_fingerprint(model_copy, "float32", layout(8)) != base
    weights = next(model_copy.glob("*.safetensors"))
    data = bytearray(weights.read_bytes())
    data[-1] ^= 1  # one bit of the last weight
    weights.write_bytes(bytes(data))
    assert model_fingerprint(model_copy, "float32", layout()) != base


def test_image_digests_prefer_the_callers_hashes():
    red, blue = Image.new("RGB", (4, 4), "red"), Image.new("RGB", (4, 4), "blue")
    assert image_digests(["AB" * 32], [red]) == ["ab" * 32]
    with pytest.raises(JobInputError):
        image_digests(["ab" * 32], [red, blue])
    pixels = image_digests([], [red, blue, Image.new("RGB", (4, 4), "red")])
    assert pixels[0] == pixels[2] != pixels[1] and len(pixels[0]) == 64
    with pytest.raises(JobInputError):
        image_digests([], [object()])
