"""Diagnostic: one FP8 decoder layer's dense halves at decode row counts under inductor variants
(the engine's default, coordinate-descent tuning, max-autotune with ATen GEMMs), device time."""
import json, os, sys, time
import torch
import torch._dynamo
sys.path.insert(0, os.path.dirname(__file__))
from torch.profiler import profile, ProfilerActivity
import wicore.engines.fast.model.text_decoder as td
from wicore.ops.fp8 import quantize_weight, load_cuda_kernels

load_cuda_kernels()
torch.manual_seed(0)
dev = "cuda"
H, KV, D, HID, INTER, EPS = 8, 4, 256, 2560, 10240, 1e-6
w = lambda *s: (torch.randn(*s, device=dev) * 0.02).bfloat16()
qkv_w = quantize_weight(w((H + 2 * KV) * D, HID)); o_w = quantize_weight(w(HID, H * D))
gate_up_w = quantize_weight(w(2 * INTER, HID)); down_w = quantize_weight(w(HID, INTER))
norms = [(torch.randn(HID, device=dev) * 0.1).bfloat16() for _ in range(4)]
qn, kn = (torch.randn(D, device=dev) * 0.1).bfloat16(), (torch.randn(D, device=dev) * 0.1).bfloat16()
inv = 1.0 / (10000 ** (torch.arange(0, D, 2, device=dev).float() / D))
variants = {
    "default (engine)": {},
    "coordinate_descent_tuning": {"coordinate_descent_tuning": True},
    "max_autotune ATen GEMMs": {"max_autotune": True, "max_autotune_gemm_backends": "ATEN", "coordinate_descent_tuning": True},
}
out = {}
td.compile_dynamic(td.attention_inputs)  # sets the engine's dynamo/inductor config
for name, options in variants.items():
    torch._dynamo.reset()
    f_in = torch.compile(td.attention_inputs, dynamic=True, fullgraph=True, options=options or None)
    f_out = torch.compile(td.attention_outputs, dynamic=True, fullgraph=True, options=options or None)
    out[name] = {}
    t0 = time.time()
    for N in (169, 384):
        x = torch.randn(N, HID, device=dev).bfloat16(); attn = torch.randn(N, H, D, device=dev).bfloat16()
        cos, sin = td.rope(torch.arange(N, device=dev) + 300, inv, torch.bfloat16)
        run = lambda: (f_in(x, cos, sin, norms[0], qkv_w, qn, kn, H, KV, EPS),
                       f_out(x, attn, o_w, norms[1], norms[2], gate_up_w, down_w, norms[3], EPS, "tanh"))
        ref = run()
        for _ in range(3): run()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(20): run()
            torch.cuda.synchronize()
        ks = sorted(((e.key[:70], round(e.device_time_total / 20, 2)) for e in prof.key_averages() if e.device_time_total > 0), key=lambda t: -t[1])
        gemm = round(sum(u for k, u in ks if "nvjet" in k or "gemm" in k.lower() or "cutlass" in k), 1)
        out[name][N] = {"total_us": round(sum(u for _, u in ks), 1), "gemm_us": gemm, "kernels": ks}
        print(f"{name:28s} N={N}: {out[name][N]['total_us']} us a layer (GEMMs {gemm}) compile+run {time.time() - t0:.0f}s", flush=True)
        for k, u in ks[:12]:
            print(f"      {u:7.2f}  {k}")
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(out, open(os.path.join(os.environ.get("OUT", "/tmp"), "decoder_compile.json"), "w"), indent=1)
