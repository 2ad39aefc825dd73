"""Train the demo captioner on a CPU, deterministically.

    python -m wicore.models.democap.train --out core/models/democap/checkpoint

Every step draws a fresh batch with `synth` (images at the model's input size, the task's
distribution widened a little), so the model never sees an image twice and cannot memorise.
The loss is the caption's next-token loss plus, while the vision tower is young, three linear
probes on the pooled image tokens (shape, color, background) that speed its start; the probes
are dropped and the checkpoint is a plain Gemma-3. A held-out set drawn by the user's path
(`data.py` files through the processor's resize) is checked every `--eval-every` steps.

Fixed seeds, `torch.use_deterministic_algorithms(True)` and a fixed thread count: the same
command on the same machine writes the same weights.
"""

from __future__ import annotations

import argparse
import json
import math
import time
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import torch
import torch.nn.functional as F

from wicore.models.corpus import COLORS, SHAPES, caption_lines
from wicore.models.democap import synth
from wicore.models.democap.batches import Layout, normalize, render_all
from wicore.models.democap.data import sample_specs
from wicore.models.democap.model import Arch, build

VALID_SEED = 2  # the held-out set checked during training; evaluation seeds are >= 1000


@dataclass(frozen=True)
class TrainConfig:
    out: str
    steps: int = 3000
    batch_size: int = 96
    lr: float = 2e-3
    min_lr_factor: float = 0.02
    weight_decay: float = 0.05
    warmup_steps: int = 150
    aux_weight: float = 0.5  # weight of the pooled probe losses, decayed to 0 by the end
    dense_weight: float = 1.0  # weight of the per-patch shape labels, decayed to 0 by the end
    subsamples: int = 3  # anti-aliasing samples per pixel side in `synth`
    vision_steps: int = 0  # steps training the tower + projector alone on the probes, first
    vision_batch_size: int = 64
    init: str = "hf"  # "hf" or "mimetic" (attention weights of the tower, see mimetic_init)
    valid_images: int = 1000
    eval_every: int = 500
    seed: int = 0  # weights and the drawn batches
    threads: int = 2
    device: str = "cpu"


def main(argv: list[str] | None = None) -> None:
    config, arch = parse_args(argv)
    record = train(config, arch)
    print(json.dumps({k: v for k, v in record.items() if k != "history"}))


def parse_args(argv: list[str] | None) -> tuple[TrainConfig, Arch]:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", required=True, help="checkpoint folder to write")
    for dc in (TrainConfig(out=""), Arch()):
        for f in fields(dc):
            if f.name != "out":
                default = getattr(dc, f.name)
                parser.add_argument(f"--{f.name.replace('_', '-')}", type=type(default), default=default)
    args = vars(parser.parse_args(argv))
    arch_names = {f.name for f in fields(Arch)}
    return (
        TrainConfig(**{k: v for k, v in args.items() if k not in arch_names}),
        Arch(**{k: v for k, v in args.items() if k in arch_names}),
    )


def train(config: TrainConfig, arch: Arch) -> dict:
    torch.set_num_threads(config.threads)
    # on CUDA (recipe sweeps only) some kernels have no deterministic variant: warn, go on
    torch.use_deterministic_algorithms(True, warn_only=config.device != "cpu")
    start = time.perf_counter()
    device = torch.device(config.device)
    model, processor = build(arch, config.seed)
    model.to(device)
    layout = Layout.from_processor(processor, caption_lines())
    valid_specs = sample_specs(config.valid_images, VALID_SEED)
    valid = (render_all(valid_specs, arch.image_size), [s.caption for s in valid_specs])
    probes = Probes(arch.text_width, arch.vision_width).to(device)
    if config.init == "mimetic":
        mimetic_init(model.model.vision_tower, config.seed)
    history = pretrain_tower(model, probes, config, arch, device, start) if config.vision_steps else []
    history += fit(model, probes, layout, valid, config, arch, device, start)

    out = Path(config.out)
    out.mkdir(parents=True, exist_ok=True)
    model.to("cpu").save_pretrained(out)
    processor.save_pretrained(out)
    record = {
        "command": "python -m wicore.models.democap.train "
        + " ".join(f"--{k.replace('_', '-')} {v}" for k, v in asdict(config).items()),
        "config": asdict(config),
        "arch": asdict(arch),
        "parameters": sum(p.numel() for p in model.parameters()),
        "valid_exact_match": history[-1]["valid_exact_match"],
        "wall_s": round(time.perf_counter() - start, 1),
        "torch": torch.__version__,
        "history": history,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


class Probes(torch.nn.Module):
    """Training-only linear heads. `loss`: shape, color and background from the projected image
    tokens, max-pooled (a shape covers a few tokens among many of background, and a mean would
    dilute it: a mean-pooled probe stayed near chance for thousands of steps where the
    max-pooled one learned; bench/NOTES.md). `dense_loss`: every patch token of the vision tower
    says which shape covers it, or background: 64 labels an image instead of one, and a patch
    on an edge must look at its neighbours to answer (token labelling)."""

    BACKGROUND = len(SHAPES)  # the dense head's extra class

    def __init__(self, width: int, vision_width: int):
        super().__init__()
        self.shape = torch.nn.Linear(width, len(SHAPES))
        self.color = torch.nn.Linear(width, len(COLORS))
        self.background = torch.nn.Linear(width, len(COLORS))
        self.patch = torch.nn.Linear(vision_width, len(SHAPES) + 1)

    def dense_loss(self, patch_tokens: torch.Tensor, batch: synth.Batch) -> torch.Tensor:
        """patch_tokens [B, N, Dv] of an image whose patch grid is sqrt(N) on a side."""
        b, n, _ = patch_tokens.shape
        side = math.isqrt(n)
        cover = F.adaptive_avg_pool2d(batch.coverage[:, None], side).reshape(b, n)  # [B, N]
        target = torch.full_like(cover, -100, dtype=torch.long)  # partly covered: no label
        target = torch.where(cover >= 0.25, batch.shape[:, None].expand(b, n), target)
        target = torch.where(cover < 0.01, torch.full_like(target, self.BACKGROUND), target)
        return F.cross_entropy(self.patch(patch_tokens).flatten(0, 1), target.flatten(), ignore_index=-100)

    def loss(self, image_tokens: torch.Tensor, batch: synth.Batch) -> torch.Tensor:
        pooled = image_tokens.amax(dim=1)  # [B, T_img, D] -> [B, D]
        return (
            F.cross_entropy(self.shape(pooled), batch.shape)
            + F.cross_entropy(self.color(pooled), batch.color)
            + F.cross_entropy(self.background(pooled), batch.background)
        )


def mimetic_init(tower: torch.nn.Module, seed: int, qk: float = 0.7, vo: float = 0.4) -> None:
    """Attention that starts out attending like a local filter (Trockman & Kolter, 2023): per
    layer W_q^T W_k ~ qk (Z Z^T + I) and W_o W_v ~ vo (Z Z^T - I), Z ~ N(0, 1/d)."""
    gen = torch.Generator().manual_seed(seed)
    for name, module in tower.named_modules():
        if not name.endswith("self_attn"):
            continue
        d = module.q_proj.weight.shape[0]
        pairs = ((module.q_proj, module.k_proj, qk, 1.0), (module.out_proj, module.v_proj, vo, -1.0))
        for first, second, scale, sign in pairs:
            z = torch.randn(d, d, generator=gen) / math.sqrt(d)
            u, s, vh = torch.linalg.svd(scale * (z @ z.T + sign * torch.eye(d)))
            with torch.no_grad():  # q/k: x Wq^T Wk x^T, so Wq^T Wk = M; o/v: Wo Wv = M
                first.weight.copy_((u * s.sqrt()).T if first is module.q_proj else u * s.sqrt())
                second.weight.copy_(s.sqrt()[:, None] * vh)


def pretrain_tower(model, probes: Probes, config: TrainConfig, arch: Arch, device, start: float) -> list[dict]:
    """The tower and projector alone on the probes: no decoder in the loop, so a step costs a
    fraction of a full one and the tower gets most of the budget."""
    inner = model.model
    gen = torch.Generator(device).manual_seed(config.seed + 1)
    params = [*inner.vision_tower.parameters(), *inner.multi_modal_projector.parameters(), *probes.parameters()]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98))
    total = config.vision_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config, total))
    history, right = [], []
    inner.train()
    for step in range(1, total + 1):
        batch = synth.draw(config.vision_batch_size, arch.image_size, gen, subsamples=config.subsamples)
        patch_tokens = inner.vision_tower(pixel_values=normalize(batch.pixels)).last_hidden_state  # [B, N, Dv]
        image_tokens = inner.multi_modal_projector(patch_tokens)  # [B, T_img, D]
        loss = probes.loss(image_tokens, batch) + probes.dense_loss(patch_tokens, batch) * config.dense_weight
        update(loss, params, optimizer, schedule)
        with torch.no_grad():
            guess = probes.shape(image_tokens.amax(dim=1)).argmax(-1)
            right.append((guess == batch.shape).float().mean().item())
        if step % 100 == 0:
            accuracy = round(sum(right[-100:]) / 100, 3)
            history.append(
                {"vision_step": step, "probe_shape_accuracy": accuracy, "s": round(time.perf_counter() - start)}
            )
            print(history[-1], flush=True)
    return history


def fit(
    model, probes: Probes, layout: Layout, valid, config: TrainConfig, arch: Arch, device, start: float
) -> list[dict]:
    gen = torch.Generator(device).manual_seed(config.seed)
    params = list(model.parameters()) + list(probes.parameters())
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    captured: list[torch.Tensor] = []  # [projected image tokens, vision tower patch tokens]
    hooks = [
        model.model.multi_modal_projector.register_forward_hook(lambda m, i, out: captured.insert(0, out)),
        model.model.vision_tower.register_forward_hook(lambda m, i, out: captured.append(out.last_hidden_state)),
    ]
    history, losses = [], []
    for step in range(1, config.steps + 1):
        model.train()
        batch = synth.draw(config.batch_size, arch.image_size, gen, subsamples=config.subsamples)
        captured.clear()
        lm = caption_loss(model, layout, batch.pixels, batch.captions(), device)
        fading = 1 - step / config.steps
        aux = probes.loss(captured[0], batch) * config.aux_weight * fading
        aux = aux + probes.dense_loss(captured[1], batch) * config.dense_weight * fading
        update(lm + aux, params, optimizer, schedule)
        losses.append(lm.item())
        recent = sum(losses[-50:]) / len(losses[-50:])  # mean caption loss of the last 50 steps
        if step % 50 == 0:
            print(f"step {step} loss {recent:.4f} {time.perf_counter() - start:.0f}s", flush=True)
        if step % config.eval_every == 0 or step == config.steps:
            captured.clear()
            accuracy = exact_match(model, layout, *valid, device)
            history.append(
                {
                    "step": step,
                    "loss": round(recent, 5),
                    "valid_exact_match": accuracy,
                    "s": round(time.perf_counter() - start),
                }
            )
            print(history[-1], flush=True)
    for hook in hooks:
        hook.remove()
    return history


def update(loss: torch.Tensor, params: list, optimizer, schedule) -> None:
    """One optimizer step on `loss`, gradients clipped to norm 1."""
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    optimizer.step()
    schedule.step()
    optimizer.zero_grad(set_to_none=True)


def lr_factor(step: int, config: TrainConfig, total: int | None = None) -> float:
    """Linear warmup, then cosine decay to min_lr_factor over `total` steps (default: config.steps)."""
    total = config.steps if total is None else total
    if step < config.warmup_steps:
        return (step + 1) / config.warmup_steps
    progress = (step - config.warmup_steps) / max(1, total - config.warmup_steps)
    return config.min_lr_factor + (1 - config.min_lr_factor) * 0.5 * (1 + math.cos(math.pi * progress))


def caption_loss(model, layout: Layout, pixels: torch.Tensor, captions: list[str], device) -> torch.Tensor:
    logits, labels = answer_logits(model, layout, pixels, captions, device)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)


def answer_logits(
    model, layout: Layout, pixels: torch.Tensor, captions: list[str], device
) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [B, A, V] that predict the A answer positions, and their labels [B, A] (-100 on
    padding). Only the last A + 1 positions go through the lm_head."""
    batch = {k: v.to(device) for k, v in layout.batch(captions).items()}
    labels = batch.pop("labels")[:, len(layout.prompt_ids) :]  # [B, A]
    keep = labels.shape[1] + 1
    logits = model(**batch, pixel_values=normalize(pixels), logits_to_keep=keep).logits  # [B, A + 1, V]
    return logits[:, :-1], labels  # position t predicts token t + 1


@torch.no_grad()
def exact_match(
    model, layout: Layout, images: torch.Tensor, captions: list[str], device, batch_size: int = 200
) -> float:
    """Share of examples whose every answer token is the argmax given the true prefix: exactly
    the examples greedy decoding gets right, at the cost of one forward pass."""
    model.eval()
    hits = 0
    for start in range(0, len(captions), batch_size):
        pixels = images[start : start + batch_size].to(device)
        logits, labels = answer_logits(model, layout, pixels, captions[start : start + batch_size], device)
        right = (logits.argmax(-1) == labels) | (labels == -100)
        hits += int(right.all(dim=1).sum())
    return hits / len(captions)


if __name__ == "__main__":
    main()
