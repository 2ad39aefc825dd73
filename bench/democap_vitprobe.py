# Shape-only probe: can a SigLIP tower learn the shape? args: name lr steps S P width layers batch curriculum(0/1)
import sys
import time

import torch
import torch.nn as nn
import torch.nn.functional as F
from transformers import SiglipVisionConfig, SiglipVisionModel

from wicore.models.democap import synth
from wicore.models.democap.batches import normalize

torch.manual_seed(0)
name, lr, steps, S, P, W, L, B, cur = sys.argv[1], float(sys.argv[2]), *map(int, sys.argv[3:10])
dev = "cuda"
cfg = SiglipVisionConfig(
    hidden_size=W,
    intermediate_size=2 * W,
    num_hidden_layers=L,
    num_attention_heads=max(1, W // 32),
    image_size=S,
    patch_size=P,
    vision_use_head=False,
)
v = SiglipVisionModel(cfg).to(dev)
head = nn.Linear(W, 5).to(dev)
params = list(v.parameters()) + list(head.parameters())
opt = torch.optim.AdamW(params, lr=lr, weight_decay=0.01)
sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1, (s + 1) / 200))
g = torch.Generator(dev).manual_seed(0)
t = time.time()
acc = []
for step in range(steps):
    widen = synth.Widen(fraction=(0.45, 0.74)) if cur and step < steps // 4 else synth.Widen()
    b = synth.draw(B, S, g, widen)
    h = v(pixel_values=normalize(b.pixels)).last_hidden_state
    logits = head(h.amax(1) if name.startswith("max") else h.mean(1))
    loss = F.cross_entropy(logits, b.shape)
    loss.backward()
    torch.nn.utils.clip_grad_norm_(params, 1.0)
    opt.step()
    sched.step()
    opt.zero_grad()
    acc.append((logits.argmax(-1) == b.shape).float().mean().item())
    if step % 250 == 249:
        print(name, step + 1, "acc", round(sum(acc[-250:]) / 250, 3), "%.0fs" % (time.time() - t), flush=True)
