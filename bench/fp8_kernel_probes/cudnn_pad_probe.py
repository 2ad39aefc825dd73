"""cuDNN's FP8 SDPA forward at the tower's shape (8 images x 16 heads x 4,096 tokens, head dim 72
zero-padded to P) for P in 80, 96, 112, 128: every execution plan the heuristics (A, B, fallback)
offer, each timed with CUDA events (median of 3 x 20 calls), and its output error against float32
attention on the dequantized inputs."""
import json, os
import cudnn, torch

B, H, L, D = 8, 16, 4096, 72
dev = torch.device("cuda")
torch.manual_seed(0)
E4M3, FMAX = torch.float8_e4m3fn, 448.0
handle = cudnn.create_handle()
cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)

shared = torch.randn(B, 1, H, D, device=dev)
src = [torch.randn(B, L, H, D, device=dev) + 0.8 * shared, torch.randn(B, L, H, D, device=dev) + 0.8 * shared,
       torch.randn(B, L, H, D, device=dev)]
descale = [(2 * t.abs().amax() / FMAX).item() for t in src]
codes = [(t / s).clamp(-FMAX, FMAX).to(E4M3) for t, s in zip(src, descale)]
deq = [c.float() * s for c, s in zip(codes, descale)]
ref = torch.empty(B, L, H, D, device=dev)
for b in range(B):
    s = torch.einsum("lhd,mhd->hlm", deq[0][b], deq[1][b]) * D**-0.5
    ref[b] = torch.einsum("hlm,mhd->lhd", s.softmax(-1), deq[2][b])

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

res = {"gpu": torch.cuda.get_device_name(), "cudnn_backend": cudnn.backend_version(), "pads": {}}
for P in (128, 96, 112, 80, 128):
    dims, strides = [B, H, L, P], [L * H * P, P, H * P, 1]
    fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    g = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32, handle=handle)
    qkv = [g.tensor(name=n, dim=dims, stride=strides, data_type=fp8) for n in "qkv"]
    names = ("descale_q", "descale_k", "descale_v", "descale_s", "scale_s", "scale_o")
    sc = [g.tensor(name=n, dim=[1, 1, 1, 1], stride=[1, 1, 1, 1], data_type=f32) for n in names]
    o, _st, a1, a2 = g.sdpa_fp8(name="a", q=qkv[0], k=qkv[1], v=qkv[2], generate_stats=False, attn_scale=D**-0.5,
                                use_causal_mask=False, **dict(zip(names, sc)))
    o.set_output(True).set_dim(dims).set_stride(strides).set_data_type(fp8)
    for a in (a1, a2):
        a.set_output(True).set_dim([1, 1, 1, 1]).set_stride([1, 1, 1, 1]).set_data_type(f32)
    entry = {}
    try:
        g.validate(); g.build_operation_graph()
        g.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK])
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL)
    except Exception as e:
        res["pads"][str(P)] = {"error": str(e)[:300]}; print(P, e, flush=True); continue
    bufs = []
    for c in codes:
        x = torch.zeros(B, L, H, P, dtype=E4M3, device=dev); x[..., :D] = c; bufs.append(x)
    ob = torch.empty(B, L, H, P, dtype=E4M3, device=dev)
    scal = torch.tensor(descale + [1 / FMAX, FMAX, 1 / descale[2]], device=dev)
    un = torch.zeros(2, device=dev)
    pack = {qkv[i]: bufs[i] for i in range(3)}
    pack.update({t: scal[i:i + 1] for i, t in enumerate(sc)}); pack.update({o: ob, a1: un[0:1], a2: un[1:2]})
    n_plans = g.get_execution_plan_count()
    for i in range(n_plans):
        try:
            ws = torch.empty(max(1, g.get_workspace_size_plan_at_index(i)), dtype=torch.uint8, device=dev)
            fn = lambda: g.execute_plan_at_index(pack, ws, i, handle=handle)
            fn(); torch.cuda.synchronize()
            out = ob[..., :D].float() * descale[2]
            err = ((out - ref).abs().mean() / ref.abs().mean()).item()
            entry[f"plan{i}"] = {"ms": timeit(fn), "err": err}
        except Exception as e:
            entry[f"plan{i}"] = {"error": str(e)[:200]}
        print(P, i, entry[f"plan{i}"], flush=True)
    key = str(P) if str(P) not in res["pads"] else f"{P}_again"
    res["pads"][key] = entry
print(json.dumps(res, indent=1))
json.dump(res, open(os.path.join(os.environ.get("OUT", "/tmp"), "cudnn_pad_probe.json"), "w"), indent=1)
