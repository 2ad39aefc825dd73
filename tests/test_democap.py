"""The demo captioner's parts: its data generators, its grammar, its training batches and script."""

from __future__ import annotations

import hashlib
import io
import json
import math

import numpy as np
import pytest
import torch
from PIL import Image

from wicore.models.corpus import COLORS, SHAPES, caption_lines
from wicore.models.democap import alt_render, data, synth


def digest(items: list[bytes]) -> str:
    return hashlib.sha256(b"".join(items)).hexdigest()


def test_same_seed_same_bytes():
    first = [data.image_bytes(s) for s in data.sample_specs(12, seed=7)]
    again = [data.image_bytes(s) for s in data.sample_specs(12, seed=7)]
    other = [data.image_bytes(s) for s in data.sample_specs(12, seed=8)]
    assert digest(first) == digest(again)
    assert digest(first) != digest(other)


def test_alt_renderer_is_deterministic_too():
    assert digest([b for b, _ in alt_render.sample(6, 3)]) == digest([b for b, _ in alt_render.sample(6, 3)])


@pytest.mark.parametrize(
    ("color", "shape", "background", "expected"),
    [
        ("red", "circle", "blue", "a red circle on a blue background"),
        ("orange", "star", "white", "an orange star on a white background"),
        ("white", "cross", "orange", "a white cross on an orange background"),
        ("yellow", "triangle", "black", "a yellow triangle on a black background"),
    ],
)
def test_caption_articles(color, shape, background, expected):
    assert data.caption(color, shape, background) == expected


def test_every_caption_is_in_the_tokenizer_corpus():
    captions = {s.caption for s in data.sample_specs(2000, seed=11)}
    assert captions <= set(caption_lines())
    assert len(caption_lines()) == len(COLORS) * (len(COLORS) - 1) * len(SHAPES)


def test_specs_stay_inside_the_task():
    for spec in data.sample_specs(500, seed=5):
        assert min(spec.width, spec.height) >= 64 and max(spec.width, spec.height) <= 1024
        assert 0.5 <= spec.width / spec.height <= 2.0
        assert 0.2 <= spec.diameter / min(spec.width, spec.height) <= 0.7
        assert spec.color != spec.background and spec.fmt in ("PNG", "JPEG")
        assert all(abs(c - n) <= data.JITTER for c, n in zip(spec.fg, data.PALETTE[spec.color]))


def test_files_decode_as_user_images():
    for spec in data.sample_specs(6, seed=9):
        image = Image.open(io.BytesIO(data.image_bytes(spec)))
        assert image.format == spec.fmt and image.size == (spec.width, spec.height)
        # the shape's centre pixel has the shape's colour, a far corner the background's
        rgb = image.convert("RGB")
        centre = rgb.getpixel((int(spec.cx), int(spec.cy)))
        assert sum(abs(a - b) for a, b in zip(centre, spec.fg)) < 60


def test_synth_batches_repeat_under_a_seed_and_differ_across_seeds():
    a = synth.draw(8, 64, torch.Generator().manual_seed(3))
    b = synth.draw(8, 64, torch.Generator().manual_seed(3))
    c = synth.draw(8, 64, torch.Generator().manual_seed(4))
    assert torch.equal(a.pixels, b.pixels) and torch.equal(a.shape, b.shape)
    assert not torch.equal(a.pixels, c.pixels)
    assert a.pixels.dtype == torch.uint8 and a.pixels.shape == (8, 3, 64, 64)
    assert (a.color != a.background).all()
    assert set(a.captions()) <= set(caption_lines())


@pytest.mark.parametrize("shape", SHAPES)
def test_synth_shapes_cover_the_same_area_as_the_user_renderer(shape):
    """A shape's area / its circumscribed circle's area is what tells the shapes apart at low
    resolution: the batch renderer and data.py must agree on it (star and cross at mid proportions)."""
    inner, arm = 0.44, 0.33
    k = SHAPES.index(shape)
    cover = synth.INSIDE[shape]
    n = 801  # sample points on [-1, 1]^2
    axis = torch.linspace(-1, 1, n)
    y, x = torch.meshgrid(axis, axis, indexing="ij")
    inside = cover(x[None], y[None], torch.tensor([inner]), torch.tensor([arm]))[0]
    synth_ratio = inside.float().mean().item() * 4 / math.pi
    spec = data.Spec(
        shape,
        "red",
        "blue",
        512,
        512,
        400.0,
        256.0,
        256.0,
        17.0,
        (220, 30, 30),
        (30, 60, 220),
        inner,
        arm,
        0.0,
        "PNG",
        90,
    )
    mask, _ = data.shape_mask(spec)
    pil_ratio = np.asarray(mask, dtype=np.float64).sum() / 255 / (math.pi * 200.0**2)
    assert synth_ratio == pytest.approx(pil_ratio, abs=0.02), k


def test_dense_labels_mark_covered_patches_with_the_shape_and_empty_ones_background():
    from wicore.models.democap.train import Probes

    batch = synth.draw(4, 64, torch.Generator().manual_seed(0))
    probes = Probes(16, 8)
    with torch.no_grad():
        probes.patch.weight.zero_()
        probes.patch.bias.zero_()
    # a uniform head gives cross-entropy ln(6) on every labelled patch
    loss = probes.dense_loss(torch.randn(4, 64, 8), batch)
    assert loss.item() == pytest.approx(math.log(len(SHAPES) + 1), rel=1e-5)


@pytest.mark.slow
def test_training_writes_a_gemma3_checkpoint_the_reference_engine_runs(tmp_path):
    from wicore.engines.base import EngineConfig, EngineRequest
    from wicore.engines.reference import ReferenceEngine
    from wicore.models.democap.model import chat
    from wicore.models.democap.train import main
    from wicore.schemas import GenerationParams

    out = tmp_path / "ckpt"
    small = ["--image-size", "32", "--patch-size", "8", "--vision-width", "32", "--vision-heads", "2", "--vision-mlp", "64",
             "--image-tokens", "16", "--text-width", "32", "--text-heads", "2", "--text-mlp", "64", "--text-layers", "1"]  # fmt: skip
    stages = ["--vision-steps", "2", "--vision-batch-size", "4", "--init", "mimetic"]
    main(
        [
            "--out",
            str(out),
            "--steps",
            "3",
            "--batch-size",
            "4",
            "--valid-images",
            "8",
            "--eval-every",
            "3",
            *stages,
            *small,
        ]
    )
    record = json.loads((out / "training.json").read_text())
    assert record["history"][-1]["step"] == 3 and 0.0 <= record["valid_exact_match"] <= 1.0
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    engine = ReferenceEngine(EngineConfig(str(out), max_batch_size=2))
    spec = data.sample_specs(1, seed=5)[0]
    done = engine.generate(
        [EngineRequest("r0", chat(), [data.decode(data.image_bytes(spec))], GenerationParams(max_new_tokens=4))]
    )
    engine.close()
    assert done[0].ok and isinstance(done[0].text, str)


def test_mimetic_init_sets_the_attention_products():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from wicore.models.democap.train import mimetic_init

    tower = SiglipVisionModel(SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=2,
                                                 num_attention_heads=2, image_size=16, patch_size=8))  # fmt: skip
    mimetic_init(tower, seed=0)
    eye = torch.eye(16)
    for layer in tower.encoder.layers:
        attn = layer.self_attn
        qk = attn.q_proj.weight.T @ attn.k_proj.weight  # x Wq^T Wk x^T
        ov = attn.out_proj.weight @ attn.v_proj.weight
        # both are 0.x (Z Z^T +- I): symmetric, with the identity's sign on the diagonal's mean
        assert torch.allclose(qk, qk.T, atol=1e-4) and torch.allclose(ov, ov.T, atol=1e-4)
        assert (qk * eye).sum() / 16 > 0.5 and (ov * eye).sum() / 16 < 0.1
