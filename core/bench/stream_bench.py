"""`wicore bench stream`: time to the first streamed token beside the whole non-streamed answer,
in one run, on one `wicore serve` and one fast-engine worker.

Each side sends the same number of chat completions (an image and a prompt, `ignore_eos` so every
answer is `new_tokens` long), `concurrency` at a time, through the gateway:

- streamed (`stream: true`): the time to the first content chunk (TTFT) and to `[DONE]`;
- whole (`stream: false`): the time to the answer.

Each side has images of its own (no cache serves one side from the other's work); both sides are
warmed up first. p50/p99 of each, in one JSON and one plot."""

from __future__ import annotations

import asyncio
import base64
import json
import os
import time
from contextlib import ExitStack
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import httpx

from wicore.bench.bench_images import make_images
from wicore.bench.caption_bench import CaptionBench, device_name, percentile, worker_command
from wicore.bench.crowd_bench import start, stop, wait_ready
from wicore.embedded import free_port
from wicore.schemas import DEFAULT_PROMPT

MODEL_ID = "bench-stream"


@dataclass(frozen=True)
class StreamBench:
    workdir: Path
    preset: str = "gemma3-4b"
    requests: int = 256  # per side
    concurrency: int = 64
    new_tokens: int = 128
    batch_size: int = 256
    warmup: int = 32
    device: str = "cuda"
    engine_options: dict = field(default_factory=dict)

    @property
    def command(self) -> str:
        return (
            f"wicore bench stream --preset {self.preset} --requests {self.requests} "
            f"--concurrency {self.concurrency} --new-tokens {self.new_tokens}"
        )


# tiny: the mechanism on CPU (its numbers are not the GPU's); one torch thread, as two OpenMP
# threads on a busy 2-core machine slow each step.
PRESETS: dict[str, dict[str, Any]] = {
    "gemma3-4b": {},
    "tiny": {"device": "cpu", "requests": 48, "concurrency": 8, "new_tokens": 32, "batch_size": 16, "warmup": 8,
             "engine_options": {"torch_threads": 1}},
}  # fmt: skip


@dataclass
class Timed:
    total_s: float
    first_s: float | None = None  # streamed only: to the first content chunk
    chunks: int = 0


def chat_body(image: Path, bench: StreamBench, stream: bool) -> dict:
    url = "data:image/png;base64," + base64.b64encode(image.read_bytes()).decode()
    content = [{"type": "image_url", "image_url": {"url": url}}, {"type": "text", "text": DEFAULT_PROMPT}]
    return {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "stream": stream,
            "max_tokens": bench.new_tokens, "ignore_eos": True}  # fmt: skip


async def streamed(client: httpx.AsyncClient, body: dict) -> Timed:
    start_s, first, chunks = time.perf_counter(), None, 0
    async with client.stream("POST", "/v1/chat/completions", json=body) as reply:
        reply.raise_for_status()
        async for line in reply.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line.removeprefix("data: "))
            if "error" in chunk:
                raise RuntimeError(f"streamed request failed: {chunk['error']}")
            if chunk["choices"] and chunk["choices"][0]["delta"].get("content"):
                first = first if first is not None else time.perf_counter() - start_s
                chunks += 1
    return Timed(time.perf_counter() - start_s, first, chunks)


async def whole(client: httpx.AsyncClient, body: dict) -> Timed:
    start_s = time.perf_counter()
    reply = await client.post("/v1/chat/completions", json=body)
    reply.raise_for_status()
    return Timed(time.perf_counter() - start_s)


async def run_side(url: str, images: list[Path], bench: StreamBench, stream: bool) -> list[Timed]:
    """Every image once, `concurrency` requests in flight."""
    gate = asyncio.Semaphore(bench.concurrency)
    limits = httpx.Limits(max_connections=bench.concurrency)
    async with httpx.AsyncClient(base_url=url, timeout=900, limits=limits) as client:

        async def one(image: Path) -> Timed:
            async with gate:
                call = streamed if stream else whole
                return await call(client, chat_body(image, bench, stream))

        return list(await asyncio.gather(*(one(image) for image in images)))


def summary(timed: list[Timed], prefix: str) -> dict:
    totals = [t.total_s for t in timed]
    report = {f"{prefix}_total_p50_s": percentile(totals, 50), f"{prefix}_total_p99_s": percentile(totals, 99)}
    firsts = [t.first_s for t in timed if t.first_s is not None]
    if firsts:
        report |= {f"{prefix}_ttft_p50_s": percentile(firsts, 50), f"{prefix}_ttft_p99_s": percentile(firsts, 99)}
        report[f"{prefix}_chunks_mean"] = sum(t.chunks for t in timed) / len(timed)
    return {key: round(value, 4) for key, value in report.items()}


def run_stream_bench(bench: StreamBench) -> dict:
    from wicore.bench.mixed_bench import MixedBench, make_model
    from wicore.embedded import EmbeddedRedis

    bench.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = make_model(MixedBench(workdir=bench.workdir, preset=bench.preset))
    images = make_images(bench.workdir / "images", 2 * (bench.warmup + bench.requests))
    warm, timed = images[: 2 * bench.warmup], images[2 * bench.warmup :]
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    plain = CaptionBench(workdir=bench.workdir, batch_size=bench.batch_size, engine_options=bench.engine_options,
                         device=bench.device, preset=MODEL_ID)  # fmt: skip
    with EmbeddedRedis() as server, ExitStack() as stack:
        command = worker_command(plain, server.url, model_dir, images[0].parent, 0)
        worker = start("worker", *command[4:], log=bench.workdir / "worker.log")
        stack.callback(stop, worker)
        gateway = start("serve", "--redis-url", server.url, "--port", str(port), "--model-id", MODEL_ID,
                        log=bench.workdir / "gateway.log")  # fmt: skip
        stack.callback(stop, gateway)
        wait_ready(url, gateway, timeout=900)
        for stream, part in ((True, warm[: bench.warmup]), (False, warm[bench.warmup :])):
            asyncio.run(run_side(url, part, bench, stream))
        streamed_side = asyncio.run(run_side(url, timed[: bench.requests], bench, True))
        whole_side = asyncio.run(run_side(url, timed[bench.requests :], bench, False))
    return {
        "command": bench.command,
        "device": device_name(bench.device),
        "cpus": os.cpu_count(),
        **{k: v for k, v in asdict(bench).items() if k != "workdir"},
        **summary(streamed_side, "streamed"),
        **summary(whole_side, "whole"),
    }


def write_stream_report(report: dict, folder: Path) -> list[Path]:
    from wicore.bench.plots import write_report
    from wicore.bench.report import gpu_slug

    bars = {
        "first token\np50": report["streamed_ttft_p50_s"],
        "first token\np99": report["streamed_ttft_p99_s"],
        "stream end\np50": report["streamed_total_p50_s"],
        "whole answer\np50": report["whole_total_p50_s"],
        "whole answer\np99": report["whole_total_p99_s"],
    }
    title = (
        f"{report['requests']} chats of {report['new_tokens']} tokens, {report['concurrency']} at a time:\n"
        "the first streamed token vs the whole answer"
    )
    name = f"stream-{report['preset']}-{gpu_slug(report['device'])}"
    return write_report(report, folder / name, title, bars, "seconds")
