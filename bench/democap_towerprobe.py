# Shape-only probe of a SigLIP tower for the demo captioner (bench/NOTES.md, session 3).
# The tower alone, a max-pooled shape head + per-patch labels (train.Probes), fresh synth batches;
# at the end, shape accuracy on held-out data.py images through the user's path (render_all).
# usage: python bench/democap_towerprobe.py --size 128 --patch 16 --width 64 --init siglip ...
import argparse
import json
import time

import torch
import torch.nn.functional as F
from transformers import SiglipVisionConfig, SiglipVisionModel

from wicore.models.corpus import SHAPES
from wicore.models.democap import synth
from wicore.models.democap.batches import normalize, render_all
from wicore.models.democap.data import sample_specs
from wicore.models.democap.train import Probes, mimetic_init

p = argparse.ArgumentParser()
for name, default in [
    ("size", 96),
    ("patch", 8),
    ("width", 64),
    ("layers", 4),
    ("heads", 2),
    ("mlp", 0),
    ("steps", 1400),
    ("batch", 64),
    ("seed", 0),
    ("threads", 2),
    ("valid", 500),
]:
    p.add_argument(f"--{name}", type=int, default=default)
p.add_argument("--lr", type=float, default=2e-3)
p.add_argument("--init", default="siglip")  # siglip | gemma (std 0.02 everywhere) | +mim
p.add_argument("--dense", type=float, default=1.0)
p.add_argument("--device", default="cpu")
p.add_argument("--name", default="probe")
args = p.parse_args()
torch.set_num_threads(args.threads)
torch.manual_seed(args.seed)
dev = torch.device(args.device)
cfg = SiglipVisionConfig(
    hidden_size=args.width,
    intermediate_size=args.mlp or 2 * args.width,
    num_hidden_layers=args.layers,
    num_attention_heads=args.heads,
    image_size=args.size,
    patch_size=args.patch,
    vision_use_head=False,
)
tower = SiglipVisionModel(cfg)
if "gemma" in args.init:
    for m in tower.modules():
        if isinstance(m, (torch.nn.Linear, torch.nn.Conv2d, torch.nn.Embedding)):
            torch.nn.init.normal_(m.weight, 0.0, 0.02)
if "mim" in args.init:
    mimetic_init(tower, seed=args.seed)
tower.to(dev)
probes = Probes(args.width, args.width).to(dev)
params = [*tower.parameters(), *probes.shape.parameters(), *probes.patch.parameters()]
opt = torch.optim.AdamW(params, lr=args.lr, weight_decay=0.05, betas=(0.9, 0.98))
warm = 150
sched = torch.optim.lr_scheduler.LambdaLR(
    opt,
    lambda s: (
        min(1, (s + 1) / warm) * (0.02 + 0.98 * 0.5 * (1 + torch.cos(torch.tensor(3.14159 * s / args.steps)).item()))
    ),
)
gen = torch.Generator(dev).manual_seed(args.seed)
specs = sample_specs(args.valid, 2)
valid = render_all(specs, args.size)
valid_shape = torch.tensor([SHAPES.index(s.shape) for s in specs])


@torch.no_grad()
def held_out():
    tower.eval()
    guess = []
    for i in range(0, len(valid), 250):
        h = tower(pixel_values=normalize(valid[i : i + 250]).to(dev)).last_hidden_state
        guess.append(probes.shape(h.amax(1)).argmax(-1).cpu())
    tower.train()
    return round((torch.cat(guess) == valid_shape).float().mean().item(), 3)


t0, acc, rows = time.time(), [], []
for step in range(1, args.steps + 1):
    b = synth.draw(args.batch, args.size, gen)
    h = tower(pixel_values=normalize(b.pixels)).last_hidden_state
    logits = probes.shape(h.amax(1))
    loss = F.cross_entropy(logits, b.shape) + probes.dense_loss(h, b) * args.dense
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    opt.zero_grad(set_to_none=True)
    acc.append((logits.argmax(-1) == b.shape).float().mean().item())
    if step % 200 == 0 or step == args.steps:
        row = {
            "name": args.name,
            "step": step,
            "train_acc": round(sum(acc[-200:]) / len(acc[-200:]), 3),
            "s": round(time.time() - t0, 1),
        }
        if step % 1000 == 0 or step == args.steps:
            row["valid_acc"] = held_out()
        rows.append(row)
        print(json.dumps(row), flush=True)
