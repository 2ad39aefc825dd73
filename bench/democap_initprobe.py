# CPU shape probe (bench/NOTES.md, after run 14): SigLIP w64 L4 64px p8, max-pooled head + per-patch labels.
# usage: python bench/democap_initprobe.py base|mim|mimsin STEPS LR [INPUT_SIZE]
import math
import sys
import time

import torch
import torch.nn.functional as F
from transformers import SiglipVisionConfig, SiglipVisionModel

from wicore.models.democap import synth
from wicore.models.democap.batches import normalize
from wicore.models.democap.train import Probes, mimetic_init

torch.set_num_threads(2)
torch.manual_seed(0)
variant, steps, lr = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
W, S, P = 64, int(sys.argv[4]) if len(sys.argv) > 4 else 64, 8  # width, input size, patch
G = S // P
cfg = SiglipVisionConfig(
    hidden_size=W,
    intermediate_size=2 * W,
    num_hidden_layers=4,
    num_attention_heads=2,
    image_size=S,
    patch_size=P,
    vision_use_head=False,
)
v = SiglipVisionModel(cfg)


def sincos():
    pe = v.embeddings.position_embedding.weight
    ys, xs = torch.meshgrid(torch.arange(G).float(), torch.arange(G).float(), indexing="ij")
    q = W // 4
    freq = 1.0 / (G ** (torch.arange(q).float() / q)) * math.pi / 2
    emb = torch.cat(
        [
            torch.sin(xs.flatten()[:, None] * freq),
            torch.cos(xs.flatten()[:, None] * freq),
            torch.sin(ys.flatten()[:, None] * freq),
            torch.cos(ys.flatten()[:, None] * freq),
        ],
        1,
    )
    with torch.no_grad():
        pe.copy_(emb * 0.5)


if "mim" in variant:
    mimetic_init(v, seed=0)
if "sin" in variant:
    sincos()
probes = Probes(W, W)  # its shape head on the max-pooled tokens, its per-patch head on every token
params = list(v.parameters()) + list(probes.shape.parameters()) + list(probes.patch.parameters())
opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.05, betas=(0.9, 0.98))
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / 150))
g = torch.Generator().manual_seed(0)
t = time.time()
acc = []
for step in range(steps):
    b = synth.draw(64, S, g)
    h = v(pixel_values=normalize(b.pixels)).last_hidden_state
    logits = probes.shape(h.amax(1))
    loss = F.cross_entropy(logits, b.shape) + probes.dense_loss(h, b)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    acc.append((logits.argmax(-1) == b.shape).float().mean().item())
    if step % 200 == 199:
        print(variant, step + 1, "acc", round(sum(acc[-200:]) / 200, 3), "%.0fs" % (time.time() - t), flush=True)
