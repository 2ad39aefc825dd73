"""Train the demo captioner on a CPU, deterministically.

    python -m wicore.models.democap.train --out core/models/democap/checkpoint

Two stages. First the SigLIP tower alone learns what is in the picture from linear probes on
its patch tokens (shape, color and background from the max over tokens, plus every patch's own
label: which shape covers it, or none); no decoder in the loop, so a step costs little. Then the
tower is frozen and the projector and decoder learn to write the caption. Images come from a
pool of masks drawn once (`synth.MaskPool`, ~4x cheaper a step than drawing fresh ones) and are
painted, turned and compressed anew every step, so no two steps see the same image. The probes
are dropped and the checkpoint is a plain Gemma-3. The caption stage's steps cycle through
every layout a user sends (`model.training_chats`: each prompt wording before and after the
image, and the image alone; then each prompt asking for JSON before and after the image,
answered with the caption's fields as JSON). A held-out set drawn by the user's path (`data.py`
files through the processor's resize) is checked in each layout (`model.LAYOUTS`, and "json":
the first JSON prompt after the image) every `--eval-every` steps.

`--tower-from CHECKPOINT` takes the tower of a checkpoint this script wrote and runs the caption
stage alone (stage 1 is ~18 minutes, the caption stage ~13): the stages share nothing but the tower, so a new
caption recipe need not retrain it.

Where the CPU has bf16 matrix units, the tower stage runs a bf16 copy of the tower against fp32
master weights (`Bf16Shadow`, `--precision`). Fixed seeds, `torch.use_deterministic_algorithms(True)`
and a fixed thread count: the same command on the same machine writes the same weights.
"""

from __future__ import annotations

import argparse
import copy
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
from wicore.models.democap.model import JSON_PROMPTS, LAYOUTS, Arch, build, chat, training_chats

VALID_SEED = 2  # the held-out set checked during training; evaluation seeds are >= 1000


@dataclass(frozen=True)
class TrainConfig:
    out: str
    vision_steps: int = 4000  # stage 1: the tower alone on the probes
    vision_batch_size: int = 128
    vision_lr: float = 3e-3
    steps: int = 2400  # stage 2: the caption, tower frozen (cycling through `training_chats`' 26 layouts)
    batch_size: int = 96
    lr: float = 2e-3
    min_lr_factor: float = 0.02
    weight_decay: float = 0.05
    warmup_steps: int = 150
    dense_weight: float = 1.0  # weight of the per-patch shape labels
    pool: int = 40_000  # masks drawn once and reused (0: draw every batch afresh)
    subsamples: int = 2  # anti-aliasing samples per pixel side in `synth`
    init: str = "mimetic"  # the tower's attention: "mimetic" (see mimetic_init) or "siglip"
    patch_init: str = "whiten"  # the patch embedding: "whiten" (see whiten_patches) or "siglip"
    whiten_scale: float = 0.5
    min_fraction: float = 0.19  # smallest shape diameter / short side drawn (the task's: 0.2)
    freeze_patches: bool = True  # frozen: exact match 0.951 vs 0.88 trainable, and cheaper
    valid_images: int = 1000
    eval_every: int = 300
    seed: int = 0  # weights and the drawn batches
    threads: int = 2
    device: str = "cpu"
    precision: str = "auto"  # the tower stage's matmuls: "bf16", "fp32", or "auto" (bf16 where the CPU has it)
    tower_from: str = ""  # a checkpoint whose tower to take (stage 1 skipped); "": train the tower


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
                kind = (lambda v: v.lower() in ("1", "true", "yes")) if isinstance(default, bool) else type(default)
                parser.add_argument(f"--{f.name.replace('_', '-')}", type=kind, default=default)
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
    if not config.tower_from:
        siglip_init(model, config.seed)
        if config.init == "mimetic":
            mimetic_init(model.model.vision_tower, config.seed)
    model.to(device)
    layouts = Layouts.build(processor)
    valid_specs = sample_specs(config.valid_images, VALID_SEED)
    valid = (render_all(valid_specs, arch.image_size), [s.caption for s in valid_specs])
    images = Images(config, arch, device)
    print(f"held-out images and a pool of {config.pool} masks drawn: {time.perf_counter() - start:.0f}s", flush=True)
    if config.tower_from:
        history = take_tower(model, Path(config.tower_from))
    else:
        if config.patch_init == "whiten":
            whiten_patches(model.model.vision_tower, images, arch.patch_size, scale=config.whiten_scale)
        model.model.vision_tower.embeddings.patch_embedding.requires_grad_(not config.freeze_patches)
        history = pretrain_tower(model, images, config, arch, device, start)
    history += fit(model, images, layouts, valid, config, device, start)

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
        "tower_stage_precision": "bf16" if use_bf16(config) else "fp32",
        "valid_exact_match": history[-1]["valid_exact_match"],
        "valid_exact_match_by_layout": history[-1]["valid_exact_match_by_layout"],
        "wall_s": round(time.perf_counter() - start, 1),
        "torch": torch.__version__,
        "history": history,
    }
    (out / "training.json").write_text(json.dumps(record, indent=2) + "\n")
    return record


@dataclass(frozen=True)
class Layouts:
    """The caption stage's token layouts: `train`, the conversations its steps cycle through;
    `valid`, the default prompt in each of `LAYOUTS` and the first JSON prompt before the image
    ("json"), checked on the held-out set."""

    train: list[Layout]
    valid: dict[str, Layout]

    @classmethod
    def build(cls, processor) -> Layouts:
        captions = caption_lines()
        train = [Layout.from_processor(processor, captions, c, form) for c, form in training_chats()]
        valid = {name: Layout.from_processor(processor, captions, chat(layout=name)) for name in LAYOUTS}
        valid["json"] = Layout.from_processor(processor, captions, chat(JSON_PROMPTS[0]), "json")
        return cls(train, valid)

    def at(self, step: int) -> Layout:
        """The layout of 1-based `step`: one conversation a step (a batch shares its prompt length)."""
        return self.train[(step - 1) % len(self.train)]


def take_tower(model, checkpoint: Path) -> list[dict]:
    """The tower of a checkpoint this script wrote, frozen in `model` (stage 1 skipped)."""
    from transformers import Gemma3ForConditionalGeneration

    source = Gemma3ForConditionalGeneration.from_pretrained(checkpoint, dtype=torch.float32)
    tower = model.model.vision_tower
    tower.load_state_dict(source.model.vision_tower.state_dict())
    tower.requires_grad_(False)
    return [{"tower_from": str(checkpoint)}]


class Images:
    """Training batches: painted from the mask pool, or drawn afresh when the pool is 0."""

    def __init__(self, config: TrainConfig, arch: Arch, device):
        self.gen = torch.Generator(device).manual_seed(config.seed)
        self.size, self.subsamples = arch.image_size, config.subsamples
        self.widen = synth.Widen(fraction=(config.min_fraction, synth.Widen.fraction[1]))
        self.pool = None
        if config.pool:
            self.pool = synth.MaskPool(config.pool, self.size, self.gen, widen=self.widen, subsamples=self.subsamples)

    def batch(self, size: int) -> synth.Batch:
        if self.pool is None:
            return synth.draw(size, self.size, self.gen, self.widen, subsamples=self.subsamples)
        return synth.paint(self.pool.sample(size, self.gen), self.gen)


@torch.no_grad()
def whiten_patches(tower, images: Images, patch: int, count: int = 256, scale: float = 0.5) -> None:
    """Patch embedding = the top principal directions of real patches, each scaled to unit
    variance (times `scale`), centred: the tower starts from the patches' main modes of
    variation (colors, then edges at every orientation) instead of random directions, the
    whitened first layer of fast CIFAR-10 training recipes."""
    conv = tower.embeddings.patch_embedding
    pixels = normalize(images.batch(count).pixels)  # [B, 3, S, S]
    patches = F.unfold(pixels, kernel_size=patch, stride=patch).transpose(1, 2).flatten(0, 1)  # [B*N, 3*p*p]
    mean = patches.mean(0)
    centred = (patches - mean).double()
    values, vectors = torch.linalg.eigh(centred.T @ centred / len(centred))  # ascending
    width = conv.weight.shape[0]
    top, top_values = vectors[:, -width:].flip(1).float(), values[-width:].flip(0).float()  # [3*p*p, W], [W]
    weight = (top / (top_values.clamp(min=1e-6).sqrt() / scale)).T  # [W, 3*p*p]
    conv.weight.copy_(weight.reshape(conv.weight.shape))
    conv.bias.copy_(-(weight @ mean))


def siglip_init(model, seed: int) -> None:
    """The tower's weights as SigLIP initialises them (lecun-normal patches, position embeddings
    of std 1/sqrt(width)), not Gemma-3's std 0.02 everywhere, which starts the positions ~6x
    weaker than the patches at width 64 and learned shapes slower (0.732 vs 0.836 probe accuracy at
    3k steps; docs/benchmarks.md)."""
    from transformers import SiglipVisionModel

    torch.manual_seed(seed)
    fresh = SiglipVisionModel(model.config.vision_config)
    model.model.vision_tower.load_state_dict(fresh.state_dict())


class Probes(torch.nn.Module):
    """Training-only linear heads on the tower's patch tokens. `loss`: shape, color and background
    from the max over tokens (a shape covers a few tokens among many of background, and a mean
    would dilute it: a mean-pooled probe stayed near chance for thousands of steps where the
    max-pooled one learned; docs/benchmarks.md). `dense_loss`: every patch token says which shape
    covers it, or background: many labels an image instead of one, and a patch on an edge must
    look at its neighbours to answer (token labelling)."""

    BACKGROUND = len(SHAPES)  # the dense head's extra class

    def __init__(self, vision_width: int):
        super().__init__()
        self.shape = torch.nn.Linear(vision_width, len(SHAPES))
        self.color = torch.nn.Linear(vision_width, len(COLORS))
        self.background = torch.nn.Linear(vision_width, len(COLORS))
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

    def loss(self, patch_tokens: torch.Tensor, batch: synth.Batch) -> tuple[torch.Tensor, torch.Tensor]:
        """The pooled heads' summed loss, and the shape logits [B, shapes] (for the accuracy)."""
        pooled = patch_tokens.amax(dim=1)  # [B, N, Dv] -> [B, Dv]
        shape_logits = self.shape(pooled)
        loss = (
            F.cross_entropy(shape_logits, batch.shape)
            + F.cross_entropy(self.color(pooled), batch.color)
            + F.cross_entropy(self.background(pooled), batch.background)
        )
        return loss, shape_logits


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


def pretrain_tower(model, images: Images, config: TrainConfig, arch: Arch, device, start: float) -> list[dict]:
    """Stage 1: the tower alone on the probes. Without the decoder a step costs a fraction of a
    full one, so the tower, which has the hard part (shapes), gets most of the budget."""
    tower = model.model.vision_tower
    probes = Probes(arch.vision_width).to(device)
    params = [*tower.parameters(), *probes.parameters()]
    optimizer = torch.optim.AdamW(params, lr=config.vision_lr, weight_decay=config.weight_decay, betas=(0.9, 0.98))
    total = config.vision_steps
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config, total))
    runner = Bf16Shadow(tower) if use_bf16(config) else None
    history, right = [], []
    tower.train()
    for step in range(1, total + 1):
        batch = images.batch(config.vision_batch_size)
        pixels = normalize(batch.pixels)
        patch_tokens = tower(pixel_values=pixels).last_hidden_state if runner is None else runner(pixels)  # [B, N, Dv]
        pooled_loss, shape_logits = probes.loss(patch_tokens, batch)
        loss = pooled_loss + probes.dense_loss(patch_tokens, batch) * config.dense_weight
        loss.backward()
        if runner is not None:
            runner.grads_to_master()
        optimizer_step(params, optimizer, schedule)
        right.append((shape_logits.argmax(-1) == batch.shape).float().mean().item())
        if step % 200 == 0 or step == total:
            accuracy = round(sum(right[-200:]) / len(right[-200:]), 3)
            history.append(
                {"vision_step": step, "probe_shape_accuracy": accuracy, "s": round(time.perf_counter() - start)}
            )
            print(history[-1], flush=True)
    tower.requires_grad_(False)  # stage 2 reads it frozen: no backward through the tower
    return history


def fit(model, images: Images, layouts: Layouts, valid, config: TrainConfig, device, start: float) -> list[dict]:
    """Stage 2: projector and decoder learn the caption from the frozen tower's tokens, in every layout."""
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=config.lr, weight_decay=config.weight_decay, betas=(0.9, 0.98))
    schedule = torch.optim.lr_scheduler.LambdaLR(optimizer, lambda step: lr_factor(step, config))
    history, losses = [], []
    for step in range(1, config.steps + 1):
        model.train()
        model.model.vision_tower.eval()
        batch = images.batch(config.batch_size)
        loss = caption_loss(model, layouts.at(step), batch.pixels, batch.captions(), device)
        update(loss, params, optimizer, schedule)
        losses.append(loss.item())
        recent = sum(losses[-50:]) / len(losses[-50:])  # mean caption loss of the last 50 steps
        if step % 50 == 0:
            print(f"step {step} loss {recent:.4f} {time.perf_counter() - start:.0f}s", flush=True)
        if step % config.eval_every == 0 or step == config.steps:
            by_layout = {name: exact_match(model, layout, *valid, device) for name, layout in layouts.valid.items()}
            history.append(
                {
                    "step": step,
                    "loss": round(recent, 5),
                    "valid_exact_match": min(by_layout.values()),  # the worst layout's
                    "valid_exact_match_by_layout": by_layout,
                    "s": round(time.perf_counter() - start),
                }
            )
            print(history[-1], flush=True)
    return history


def use_bf16(config: TrainConfig) -> bool:
    if config.precision == "auto":
        return config.device == "cpu" and torch.ops.mkldnn._is_mkldnn_bf16_supported()
    return config.precision == "bf16"


class Bf16Shadow:
    """Mixed precision by hand for the tower stage: a bf16 copy of the tower runs forward and
    backward (AMX matmuls: ~4x fp32's rate at these shapes on a Sapphire Rapids core), the fp32
    tower keeps the weights the optimizer updates. CPU autocast was slower than fp32 here: it
    re-casts every weight at every op, and its SDPA backward in bf16 is slow, so the copy uses
    plain matmul attention."""

    def __init__(self, tower: torch.nn.Module):
        self.master = list(tower.parameters())
        self.copy = copy.deepcopy(tower).to(torch.bfloat16)
        self.copy.set_attn_implementation("eager")
        self.copy.train()
        self.shadow = list(self.copy.parameters())

    def __call__(self, pixels: torch.Tensor) -> torch.Tensor:
        """float [B, 3, S, S] -> fp32 patch tokens [B, N, Dv] from this step's master weights."""
        with torch.no_grad():
            for master, shadow in zip(self.master, self.shadow):
                shadow.copy_(master)
        return self.copy(pixel_values=pixels.to(torch.bfloat16)).last_hidden_state.float()

    def grads_to_master(self) -> None:
        for master, shadow in zip(self.master, self.shadow):
            if shadow.grad is not None:
                master.grad = shadow.grad.float()
                shadow.grad = None


def update(loss: torch.Tensor, params: list, optimizer, schedule) -> None:
    """One optimizer step on `loss`."""
    loss.backward()
    optimizer_step(params, optimizer, schedule)


def optimizer_step(params: list, optimizer, schedule) -> None:
    """Apply the gradients in place, clipped to norm 1, and advance the schedule."""
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
