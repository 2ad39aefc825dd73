"""FlashInfer's FA3 FP8 prefill (sm90, JIT-compiled off the GPU machine) against the product's cuDNN
FP8 attention, at the tower's shape: 8 images x 16 heads x 4,096 tokens, head dim 72 padded to 128.
Prints ms a call (CUDA events, median of 3 x 20), and errors against float32 attention.

The module (.gpu/fi/*.so, ~1 MB) was built on the CPU machine, which has no GPU, and carried over
with apache-tvm-ffi's cp312 wheel (the GPU machine has no nvcc):
  pip install --no-deps --target SITE flashinfer-python==0.7.2.post1 apache-tvm-ffi ninja \
      nvidia-cuda-nvcc==13.0.* nvidia-cuda-crt==13.0.* nvidia-nvvm==13.0.* \
      nvidia-cuda-runtime==13.0.* nvidia-cuda-cccl==13.0.*   (one target each, then merged)
  plus einops, tabulate, nvidia-ml-py, requests; curand's headers copied into nvidia/cu13/include;
  nvidia/cu13/lib64/libcudart.so -> ../lib/libcudart.so.13 and an empty stub lib64/stubs/libcuda.so
  (soname libcuda.so.1) for the link; then with CUDA_HOME=SITE/nvidia/cu13,
  FLASHINFER_CUDA_ARCH_LIST=9.0a, nvcc and ninja on PATH:
  gen_single_prefill_module("fa3", e4m3, e4m3, bf16, 128, 128, 0, False, False, False).build()
  (flashinfer.jit.attention.modules; 7.6 minutes on 2 cores)."""
import glob, json, os, sys, time
import torch, tvm_ffi

B, H, L, D, P = 8, 16, 4096, 72, 128
dev = torch.device("cuda")
torch.manual_seed(0)
E4M3, FMAX = torch.float8_e4m3fn, 448.0

so = glob.glob(".gpu/fi/*.so")[0]
mod = tvm_ffi.load_module(so)
print("loaded", so, flush=True)

# q, k, v as the tower's: bf16 with some peaked rows (a shared direction in q and k)
base = torch.randn(B, H, L, D, device=dev)
shared = torch.randn(B, H, 1, D, device=dev)
q = (base + 0.8 * shared).bfloat16()
k = (torch.randn(B, H, L, D, device=dev) + 0.8 * shared).bfloat16()
v = torch.randn(B, H, L, D, device=dev).bfloat16()
scale = D ** -0.5

def quant(x):
    amax = x.float().abs().amax()
    s = FMAX / (2 * amax)
    y = torch.zeros(B, H, L, P, dtype=E4M3, device=dev)
    y[..., :D] = (x.float() * s).clamp(-FMAX, FMAX).to(E4M3)
    return y, (1 / s).float()

q8, dq = quant(q); k8, dk = quant(k); v8, dv = quant(v)

# reference: float32 attention on the dequantized inputs (quantization error excluded) and on bf16
def ref(qq, kk, vv):
    out = torch.empty(B, H, L, D, device=dev)
    for b in range(B):
        s = torch.einsum("hld,hmd->hlm", qq[b].float(), kk[b].float()) * scale
        out[b] = torch.einsum("hlm,hmd->hld", s.softmax(-1), vv[b].float())
    return out
r_deq = ref(q8[..., :D].float() * dq, k8[..., :D].float() * dk, v8[..., :D].float() * dv)
r_bf = ref(q, k, v)

# FlashInfer: (B*H) heads of one sequence; q, k, v as [L, B*H, P] views over [B*H, L, P] (NHD)
qh, kh, vh = (t.reshape(B * H, L, P) for t in (q8, k8, v8))
q_view, k_view, v_view = (t.permute(1, 0, 2) for t in (qh, kh, vh))
o_fi = torch.empty(B * H, L, P, dtype=torch.bfloat16, device=dev).permute(1, 0, 2)
tmp = torch.empty(32 << 20, dtype=torch.uint8, device=dev)
sq = dq.expand(B * H).contiguous(); sk = dk.expand(B * H).contiguous(); sv = dv.expand(B * H).contiguous()
NHD, NON_CAUSAL = 0, 0

def fi():
    mod.run(q_view, k_view, v_view, tmp, o_fi, None, NON_CAUSAL, NHD, -1, sq, sk, sv, scale, 1.0, 1.0, 1.0)

fi(); torch.cuda.synchronize()
o1 = o_fi.permute(1, 0, 2).reshape(B, H, L, P)[..., :D].float()
def err(a, r):
    return ((a - r).abs().mean() / r.abs().mean()).item()
res = {"fi_err_vs_deq_f32": err(o1, r_deq), "fi_err_vs_bf16_f32": err(o1, r_bf), "fi_pad_max": o_fi.permute(1,0,2)[..., D:].abs().max().item()}
print(res, flush=True)

# the product's chain (cuDNN) on the same bf16 qkv rows [B*L, 3*H*D]
sys.path.insert(0, ".")
from wicore.ops import fp8_attention as fa
fa.load_cuda_kernels()
qkv = torch.cat([t.permute(0, 2, 1, 3).reshape(B * L, H * D) for t in (q, k, v)], dim=1).contiguous()
seen = torch.zeros(3, fa.SEEN_SLOTS, device=dev)
fa.prepare(dev, [B], H, L, D)
prod = lambda: torch.ops.wicore.fp8_attention(qkv, B, H, D, seen)
o8, os_ = prod(); torch.cuda.synchronize()
o2 = (o8.float() * os_).reshape(B, L, H, D).permute(0, 2, 1, 3)
res["product_err_vs_bf16_f32"] = err(o2, r_bf)

# cuDNN's SDPA alone: its plan on the padded buffer
from wicore.ops import fp8_attention_cuda as fc
handle, plan = fc._plan(dev, B, H, L, D)
qkv8 = torch.empty((3, B * L, H, P), dtype=E4M3, device=dev)
for i, t in enumerate((q8, k8, v8)):
    qkv8[i] = t.permute(0, 2, 1, 3).reshape(B * L, H, P)
o8c = torch.empty((B * L, H, P), dtype=E4M3, device=dev)
scal = torch.tensor([dq, dk, dv, 1 / FMAX, FMAX, 1 / dv], device=dev)
un = torch.zeros(2, device=dev)
pack = {plan.qkv[i]: qkv8[i] for i in range(3)}
pack.update({t: scal[i:i+1] for i, t in enumerate(plan.scalars)})
pack.update({plan.o: o8c, plan.amaxes[0]: un[0:1], plan.amaxes[1]: un[1:2]})
ws = torch.empty(plan.workspace, dtype=torch.uint8, device=dev)
import cudnn
def cud():
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    plan.graph.execute(pack, ws, handle=handle)
cud(); torch.cuda.synchronize()
o3 = (o8c.float() * dv).reshape(B, L, H, P)[..., :D].permute(0, 2, 1, 3)
res["cudnn_err_vs_deq_f32"] = err(o3, r_deq)

def timeit(fn, n=20):
    out = []
    for _ in range(3):
        fn(); torch.cuda.synchronize()
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        for _ in range(n):
            fn()
        b.record(); torch.cuda.synchronize()
        out.append(a.elapsed_time(b) / n)
    return sorted(out)[1]

for rnd in range(2):
    res[f"ms_fi_{rnd}"] = timeit(fi)
    res[f"ms_cudnn_{rnd}"] = timeit(cud)
    res[f"ms_product_chain_{rnd}"] = timeit(prod)
flops = 4 * B * H * L * L * D
res["useful_tflops_fi"] = flops / res["ms_fi_1"] / 1e9
res["useful_tflops_cudnn"] = flops / res["ms_cudnn_1"] / 1e9
res["gpu"] = torch.cuda.get_device_name()
print(json.dumps(res, indent=1))
os.makedirs(os.environ.get("OUT", "/tmp"), exist_ok=True)
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "fi_probe.json"), "w"), indent=1)
