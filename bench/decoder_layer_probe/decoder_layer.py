"""Diagnostic: one FP8 decoder layer's dense halves (compiled as the engine compiles them) at decode
batch sizes, each kernel's device time (torch.profiler), Gemma-3-4B's shape."""
import json, os
import torch
from torch.profiler import profile, ProfilerActivity
from wicore.engines.fast.model.text_decoder import LayerFunctions, rope
from wicore.ops.fp8 import quantize_weight, load_cuda_kernels

load_cuda_kernels()
torch.manual_seed(0)
dev = "cuda"
H, KV, D, HID, INTER, EPS = 8, 4, 256, 2560, 10240, 1e-6
w = lambda *s: (torch.randn(*s, device=dev) * 0.02).bfloat16()
qkv_w = quantize_weight(w((H + 2 * KV) * D, HID))
o_w = quantize_weight(w(HID, H * D))
gate_up_w = quantize_weight(w(2 * INTER, HID))
down_w = quantize_weight(w(HID, INTER))
norms = [(torch.randn(HID, device=dev) * 0.1).bfloat16() for _ in range(4)]
qn, kn = (torch.randn(D, device=dev) * 0.1).bfloat16(), (torch.randn(D, device=dev) * 0.1).bfloat16()
inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=dev).float() / D))
fns = LayerFunctions()
fns.compile()
out = {}
for N in (169, 384, 2250):
    x = torch.randn(N, HID, device=dev).bfloat16()
    attn = torch.randn(N, H, D, device=dev).bfloat16()
    cos, sin = rope(torch.arange(N, device=dev) + 300, inv, torch.bfloat16)
    f_in = lambda: fns.inputs(x, cos, sin, norms[0], qkv_w, qn, kn, H, KV, EPS)
    f_out = lambda: fns.outputs(x, attn, o_w, norms[1], norms[2], gate_up_w, down_w, norms[3], EPS, "tanh")
    for _ in range(3):
        f_in(); f_out()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(20):
            f_in(); f_out()
        torch.cuda.synchronize()
    kernels = sorted(((e.key[:90], round(e.device_time_total / 20, 2), e.count // 20) for e in prof.key_averages() if e.device_time_total > 0), key=lambda t: -t[1])
    total = round(sum(k[1] for k in kernels), 1)
    out[N] = {"total_us_per_layer": total, "kernels": kernels}
    print(f"N={N}: {total} us a layer (both halves)")
    for name, us, count in kernels:
        print(f"   {us:8.2f} us  x{count}  {name}")
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "decoder_layer.json"), "w"), indent=1)
