"""Host time of the calls a prefill launch is made of (issue 5, bench/NOTES.md run 47): one
bf16 GEMM per cuBLAS backend, and one decoder layer half eager, compiled, and compiled with
inductor's C++ wrapper. Prints microseconds of host time per call at 32 tokens, where each
call's device work (~60 us, mostly reading the weights) is shorter than its launch, so the
launch queue never fills and the time is the host's own.

    python bench/gpu_host_overhead.py
"""

from __future__ import annotations

import time

import torch

from wicore.engines.fast.model.text_decoder import attention_outputs, compile_dynamic


def host_us(fn, calls: int = 200) -> float:
    for _ in range(20):
        fn()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    seconds = time.perf_counter() - start
    torch.cuda.synchronize()
    return seconds / calls * 1e6


def main() -> None:
    torch.manual_seed(0)
    dev, bf16 = "cuda", torch.bfloat16
    tokens = 32
    x = torch.randn(tokens, 2560, device=dev, dtype=bf16)
    w = torch.randn(4096, 2560, device=dev, dtype=bf16)
    rows = {"default BLAS library": str(torch.backends.cuda.preferred_blas_library())}
    for library in ("cublas", "cublaslt"):
        torch.backends.cuda.preferred_blas_library(library)
        rows[f"F.linear [{tokens}, 2560] x [2560, 4096], {library}"] = host_us(lambda: torch.nn.functional.linear(x, w))
    torch.backends.cuda.preferred_blas_library("cublas")
    hidden, heads, dim, inter = 2560, 8, 256, 10240
    args = (
        torch.randn(tokens, hidden, device=dev, dtype=bf16),
        torch.randn(tokens, heads, dim, device=dev, dtype=bf16),
        torch.randn(hidden, heads * dim, device=dev, dtype=bf16),
        torch.randn(hidden, device=dev, dtype=bf16),
        torch.randn(hidden, device=dev, dtype=bf16),
        torch.randn(2 * inter, hidden, device=dev, dtype=bf16),
        torch.randn(hidden, inter, device=dev, dtype=bf16),
        torch.randn(hidden, device=dev, dtype=bf16),
        1e-6,
        "tanh",
    )
    compiled = compile_dynamic(attention_outputs)
    with torch.inference_mode():
        rows["attention_outputs eager"] = host_us(lambda: attention_outputs(*args))
        compiled(*args)
        rows["attention_outputs compiled"] = host_us(lambda: compiled(*args))
        for library in ("cublaslt",):
            torch.backends.cuda.preferred_blas_library(library)
            rows[f"attention_outputs compiled, {library}"] = host_us(lambda: compiled(*args))
        torch.backends.cuda.preferred_blas_library("cublas")
        start = time.perf_counter()
        wrapped = torch.compile(attention_outputs, dynamic=True, fullgraph=True, options={"cpp_wrapper": True})
        wrapped(*args)
        rows["cpp_wrapper compile seconds"] = f"{time.perf_counter() - start:.1f}"
        rows["attention_outputs compiled, cpp_wrapper"] = host_us(lambda: wrapped(*args))
        differ = (wrapped(*args) != compiled(*args)).float().mean().item()
        rows["cpp_wrapper output"] = f"{differ:.2%} of elements differ from the Python wrapper's"
    for name, value in rows.items():
        print(f"{name:60s} {value if isinstance(value, str) else f'{value:8.1f} us'}")


if __name__ == "__main__":
    main()
