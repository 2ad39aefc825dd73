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


def test_json_answers_name_the_captions_fields_in_the_schemas_order():
    from wicore.bench import guided_bench
    from wicore.models.democap.model import JSON_PROMPTS, answer_text, training_chats

    expected = '{"shape": "star", "color": "orange", "background": "white"}<end_of_turn>'
    assert answer_text("an orange star on a white background", "json") == expected
    assert answer_text("an orange star on a white background") == "an orange star on a white background<end_of_turn>"
    with pytest.raises(ValueError, match="answer form"):
        answer_text("an orange star on a white background", "yaml")
    asked = [chat[0]["content"] for chat, form in training_chats() if form == "json"]
    assert len(asked) == 2 * len(JSON_PROMPTS)  # each wording before and after the image
    assert all(any(part.get("text") in JSON_PROMPTS for part in parts) for parts in asked)
    assert JSON_PROMPTS[0] == guided_bench.JSON_PROMPT


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


def test_the_eight_symmetries_are_distinct_and_undo_each_other():
    image = torch.arange(16.0).reshape(1, 4, 4)  # no symmetry of its own
    variants = []
    for code in range(8):
        flips = torch.tensor([[bool(code & 1)], [bool(code & 2)], [bool(code & 4)]])
        variants.append(synth.symmetric(image, flips))
    assert len({tuple(v.flatten().tolist()) for v in variants}) == 8
    # transpose, flip rows, flip columns: undone by the same flips in reverse order
    once = synth.symmetric(image, torch.tensor([[True], [True], [False]]))
    assert torch.equal(once.flip(1).transpose(1, 2), image)


def test_mask_pool_paints_new_images_from_the_same_masks():
    gen = torch.Generator().manual_seed(0)
    pool = synth.MaskPool(8, 32, gen, chunk=3)
    assert len(pool) == 8 and pool.soft.dtype == torch.uint8
    first, second = synth.paint(pool.sample(64, gen), gen), synth.paint(pool.sample(64, gen), gen)
    assert not torch.equal(first.pixels, second.pixels)
    for batch in (first, second):
        # painted where the mask says: the covered pixels take the shape's colour, the rest the
        # background's (nearest palette colour of their mean; jitter, noise and a small JPEG's
        # chroma bleed move a few, a mask painted in the wrong place or orientation moves most)
        palette, right, total = synth.PALETTE_RGB, 0, 0
        for row in range(len(batch.shape)):
            covered, clear = batch.coverage[row] > 0.95, batch.coverage[row] < 0.05
            if covered.sum() < 4 or clear.sum() < 4:
                continue
            pixels = batch.pixels[row].float()  # [3, S, S]
            nearest = lambda rgb, palette=palette: int((palette - rgb).norm(dim=1).argmin())  # noqa: E731
            right += nearest(pixels[:, covered].mean(1)) == batch.color[row]
            right += nearest(pixels[:, clear].mean(1)) == batch.background[row]
            total += 2
        assert total >= 40 and right / total >= 0.9, (right, total)
        assert set(batch.captions()) <= set(caption_lines())


def test_whitened_patch_embedding_outputs_decorrelated_unit_modes():
    from transformers import SiglipVisionConfig, SiglipVisionModel

    from wicore.models.democap.batches import normalize
    from wicore.models.democap.model import Arch
    from wicore.models.democap.train import Images, TrainConfig, whiten_patches

    arch = Arch(image_size=32, patch_size=8, vision_width=16)
    tower = SiglipVisionModel(SiglipVisionConfig(hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                 num_attention_heads=2, image_size=32, patch_size=8))  # fmt: skip
    images = Images(TrainConfig(out="", pool=64), arch, "cpu")
    whiten_patches(tower, images, 8, count=512, scale=1.0)
    with torch.no_grad():
        out = tower.embeddings.patch_embedding(normalize(images.batch(512).pixels))  # [B, W, 4, 4]
    features = out.permute(0, 2, 3, 1).reshape(-1, 16)
    covariance = torch.cov(features.T)
    assert features.mean(0).abs().max() < 0.2  # centred
    assert torch.allclose(covariance.diagonal(), torch.ones(16), atol=0.35)  # unit variance per mode
    assert (covariance - torch.diag(covariance.diagonal())).abs().max() < 0.3  # decorrelated


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
    probes = Probes(8)
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
    stages = ["--vision-steps", "2", "--vision-batch-size", "4", "--init", "mimetic", "--pool", "16"]
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
    again = tmp_path / "again"
    main(["--out", str(again), "--steps", "3", "--batch-size", "4", "--valid-images", "8", "--eval-every", "3",
          *stages, *small])  # fmt: skip
    same = (out / "model.safetensors").read_bytes() == (again / "model.safetensors").read_bytes()
    assert same, "the same command wrote different weights"
    record = json.loads((out / "training.json").read_text())
    assert record["history"][-1]["step"] == 3 and 0.0 <= record["valid_exact_match"] <= 1.0
    assert set(record["valid_exact_match_by_layout"]) == {"image-first", "text-first", "image-only", "json"}
    caption_only = tmp_path / "caption-only"  # the caption stage alone, on the first run's tower
    main(["--out", str(caption_only), "--tower-from", str(out), "--steps", "3", "--batch-size", "4",
          "--valid-images", "8", "--eval-every", "3", "--pool", "16", *small])  # fmt: skip
    towers = [tower_of(path) for path in (out, caption_only)]
    assert towers[0].keys() == towers[1].keys() and all(torch.equal(towers[0][k], towers[1][k]) for k in towers[0])
    config = json.loads((out / "config.json").read_text())
    assert config["architectures"] == ["Gemma3ForConditionalGeneration"]
    engine = ReferenceEngine(EngineConfig(str(out), max_batch_size=2))
    spec = data.sample_specs(1, seed=5)[0]
    done = engine.generate(
        [EngineRequest("r0", chat(), [data.decode(data.image_bytes(spec))], GenerationParams(max_new_tokens=4))]
    )
    engine.close()
    assert done[0].ok and isinstance(done[0].text, str)


def tower_of(checkpoint) -> dict:
    from safetensors.torch import load_file

    return {k: v for k, v in load_file(checkpoint / "model.safetensors").items() if "vision_tower" in k}


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


@pytest.mark.slow
@pytest.mark.parametrize("engine", ["reference", "fast"])
def test_bundled_captioner_through_wicore_caption(tmp_path, engine):
    """The whole product path (the CLI, embedded redis-server, a worker process, the engine) with
    the default model on fresh images of a seed no training used; measured: see the model card."""
    from wicore.models.democap import evaluate

    truth = evaluate.write_samples(evaluate.main_samples(60, seed=4242), tmp_path / "images")
    out = tmp_path / "captions.jsonl"
    evaluate.caption_folder(tmp_path / "images", out, engine, None, ["--max-new-tokens", "16"])
    report = evaluate.score(truth, out)
    assert report.total == 60
    assert report.accuracy >= 0.9, report.mistakes


def test_readme_examples_are_the_generators_images(tmp_path):
    """examples/images is what examples/make_images.py writes (README command 1 captions them)."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    subprocess.run([sys.executable, str(root / "examples" / "make_images.py"), str(tmp_path)], check=True)
    made = {p.name: p.read_bytes() for p in tmp_path.iterdir()}
    shipped = {p.name: p.read_bytes() for p in (root / "examples" / "images").iterdir()}
    assert made == shipped
