"""`wicore bench batch --lines 100000`: an OpenAI batch through `wicore serve` against
`Producer.submit_many` on the same lines, with one `null`-engine worker process draining both
(so the queue, not a model, sets the pace), in the same run and on the same Redis (flushed
between the sides). Each side is timed from the first byte sent to the last result in hand:

- producer: the lines' submissions (built before the clock starts), `submit_many` in chunks,
  then `Producer.wait` until every job has ended;
- gateway: upload the JSONL (streamed), create the batch, poll it until completed, stream the
  output file to disk. Also timed: when the batch's last line had become a job.

The gateway's resident memory is sampled throughout (and its peak, VmHWM, read at the end) at
`--lines` and at a tenth of it, each on a fresh gateway: a batch is streamed, so the peak should
not grow with the line count."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path

import httpx
from redis import Redis

from wicore import keys
from wicore.bench.queue_bench import tiny_png
from wicore.embedded import free_port
from wicore.producer import Producer, ProducerConfig, Submission
from wicore.schemas import ChatMessage, GenerationParams, ImagePart, Lane, TextPart

MODEL_ID = "bench-batch"
CHUNK = 256
PROMPT = "Describe this image in detail."


def batch_lines(count: int, image: Path) -> list[str]:
    """Distinct work per line (its own seed), one small image by path."""
    content = [{"type": "image_url", "image_url": {"url": str(image)}}, {"type": "text", "text": PROMPT}]
    lines = []
    for i in range(count):
        body = {"model": MODEL_ID, "messages": [{"role": "user", "content": content}], "max_tokens": 8, "seed": i}
        line = {"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}
        lines.append(json.dumps(line, separators=(",", ":")))
    return lines


def submissions(count: int, image: Path) -> list[Submission]:
    """The same lines as the producer takes them: the same jobs (ids) as the batch makes."""
    message = ChatMessage(role="user", content=[ImagePart(), TextPart(text=PROMPT)])
    return [
        Submission(image, messages=(message,), params=GenerationParams(max_new_tokens=8, seed=i), priority=Lane.LOW)
        for i in range(count)
    ]


def start(args: list[str], log: Path) -> subprocess.Popen:
    with open(log, "ab") as sink:
        return subprocess.Popen([sys.executable, "-m", "wicore.cli.main", *args], stdout=sink, stderr=subprocess.STDOUT)


def start_worker(redis_url: str, folder: Path) -> subprocess.Popen:
    args = ["worker", "--redis-url", redis_url, "--engine", "null", "--model-id", MODEL_ID, "--batch-size", "256"]
    return start([*args, "--allow-root", str(folder)], folder / "worker.log")


def start_gateway(redis_url: str, folder: Path, port: int) -> subprocess.Popen:
    os.environ["WICORE_FILES_DIR"] = str(folder / "files")
    try:
        args = ["serve", "--redis-url", redis_url, "--port", str(port), "--model-id", MODEL_ID]
        process = start([*args, "--allow-root", str(folder)], folder / "gateway.log")
    finally:
        del os.environ["WICORE_FILES_DIR"]
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"http://127.0.0.1:{port}/health/live", timeout=2).status_code == 200:
                return process
        except httpx.HTTPError:
            time.sleep(0.1)
    process.kill()
    raise RuntimeError("the gateway did not start within 60 s")


def memory_kib(pid: int, field_name: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field_name + ":"):
            return int(line.split()[1])
    return 0


@dataclass
class RssSampler:
    """The process's resident memory every `every_s`, in a thread."""

    pid: int
    every_s: float = 0.2
    samples: list[tuple[float, float]] = field(default_factory=list)  # (s since start, MiB)
    stop: threading.Event = field(default_factory=threading.Event)

    def __enter__(self) -> RssSampler:
        self.start = time.monotonic()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()
        return self

    def _run(self) -> None:
        while not self.stop.wait(self.every_s):
            self.samples.append((time.monotonic() - self.start, memory_kib(self.pid, "VmRSS") / 1024))

    def __exit__(self, *exc) -> None:
        self.stop.set()
        self.thread.join()


def bench_producer(redis_url: str, subs: list[Submission]) -> float:
    producer = Producer(redis_url, model=MODEL_ID, config=ProducerConfig(by_path=True))
    start_at = time.perf_counter()
    ids = producer.submit_many(subs, chunk=CHUNK)
    ended = sum(1 for outcome in producer.wait(set(ids), timeout=3600) if outcome.result is not None)
    seconds = time.perf_counter() - start_at
    if ended != len(set(ids)):
        raise RuntimeError(f"{ended} of {len(set(ids))} producer jobs finished")
    return seconds


@dataclass
class GatewaySide:
    lines: int
    seconds: float
    submitted_s: float  # until every line had become a job
    rss_peak_mib: float
    output_bytes: int
    samples: list[tuple[float, float]]


def bench_gateway(redis_url: str, source: Path, lines: int, folder: Path) -> GatewaySide:
    port = free_port()
    process = start_gateway(redis_url, folder, port)
    try:
        with (
            RssSampler(process.pid) as sampler,
            httpx.Client(base_url=f"http://127.0.0.1:{port}/v1", timeout=600) as client,
        ):
            start_at = time.perf_counter()
            batch, submitted_s = run_batch(client, redis_url, source, start_at)
            output_bytes = download(client, batch["output_file_id"], folder / "output.jsonl")
            seconds = time.perf_counter() - start_at
        peak = memory_kib(process.pid, "VmHWM") / 1024
    finally:
        process.terminate()
        process.wait(timeout=30)
    if batch["request_counts"]["completed"] != lines:
        raise RuntimeError(f"the batch answered {batch['request_counts']} of {lines} lines")
    return GatewaySide(lines, seconds, submitted_s, peak, output_bytes, sampler.samples)


def run_batch(client: httpx.Client, redis_url: str, source: Path, start_at: float) -> tuple[dict, float]:
    with source.open("rb") as data:
        uploaded = client.post("/files", files={"file": (source.name, data)}, data={"purpose": "batch"}).json()
    body = {"input_file_id": uploaded["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    batch = client.post("/batches", json=body).json()
    connection, submitted_s = Redis.from_url(redis_url), None
    while batch["status"] not in ("completed", "failed", "expired", "cancelled"):
        time.sleep(0.05)
        if (
            submitted_s is None
            and read_int(connection, batch["id"], "lines") >= read_int(connection, batch["id"], "total") > 0
        ):
            submitted_s = time.perf_counter() - start_at
        batch = client.get(f"/batches/{batch['id']}").json()
    return batch, submitted_s or time.perf_counter() - start_at


def read_int(connection: Redis, batch_id: str, name: str) -> int:
    return int(connection.hget(keys.batch(batch_id), name) or 0)


def download(client: httpx.Client, file_id: str, path: Path) -> int:
    size = 0
    with client.stream("GET", f"/files/{file_id}/content") as reply, path.open("wb") as sink:
        for piece in reply.iter_bytes():
            size += sink.write(piece)
    return size


def run_bench(redis_url: str, lines: int) -> dict:
    connection = Redis.from_url(redis_url)
    with tempfile.TemporaryDirectory(prefix="wicore-bench-batch-") as tmp:
        folder = Path(tmp)
        image = folder / "tiny.png"
        image.write_bytes(tiny_png())
        worker = start_worker(redis_url, folder)
        try:
            sides = {}
            for count in (max(1, lines // 10), lines):
                source = folder / f"batch-{count}.jsonl"
                source.write_text("\n".join(batch_lines(count, image)) + "\n")
                connection.flushdb()
                sides[count] = bench_gateway(redis_url, source, count, folder)
                source.unlink()
            connection.flushdb()
            producer_s = bench_producer(redis_url, submissions(lines, image))
        finally:
            worker.terminate()
            worker.wait(timeout=30)
            connection.flushdb()
    return report_of(lines, producer_s, sides)


def report_of(lines: int, producer_s: float, sides: dict[int, GatewaySide]) -> dict:
    big, small = sides[lines], sides[min(sides)]
    return {
        "command": f"wicore bench batch --lines {lines}",
        "cpus": os.cpu_count(),
        "lines": lines,
        "engine": "null (one worker process, batch size 256)",
        "producer_lines_per_s": round(lines / producer_s, 1),
        "batch_lines_per_s": round(lines / big.seconds, 1),
        "batch_submit_lines_per_s": round(lines / big.submitted_s, 1),
        "throughput_ratio": round((lines / producer_s) / (lines / big.seconds), 2),  # the producer's over the batch's
        "gateway_rss_peak_mib": round(big.rss_peak_mib, 1),
        "gateway_rss_peak_mib_at_tenth": round(small.rss_peak_mib, 1),
        "tenth_lines": small.lines,
        "output_bytes": big.output_bytes,
        "rss_samples_mib": {str(side.lines): side.samples for side in sides.values()},
    }


def write_results(report: dict, folder: Path) -> list[Path]:
    """batch-<n>cpu.json and .png: throughput bars beside the gateway's RSS over time."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    folder.mkdir(parents=True, exist_ok=True)
    stem = folder / f"batch-{os.cpu_count()}cpu"
    stem.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    fig, (bars, rss) = plt.subplots(1, 2, figsize=(11, 3.8), dpi=120)
    labels = ["Producer\nsubmit_many", "OpenAI batch\n(gateway)"]
    values = [report["producer_lines_per_s"], report["batch_lines_per_s"]]
    bars.bar(labels, values, color="#2a7ab9")
    bars.set_ylabel("lines / s, end to end")
    bars.set_title(f"{report['lines']:,} lines, null engine: producer / batch {report['throughput_ratio']:.2f}x")
    for lines, samples in report["rss_samples_mib"].items():
        rss.plot([t for t, _ in samples], [m for _, m in samples], label=f"{int(lines):,} lines")
    rss.set_xlabel("s")
    rss.set_ylabel("gateway RSS (MiB)")
    rss.set_title("gateway memory: flat in the line count")
    rss.legend()
    fig.tight_layout()
    fig.savefig(stem.with_suffix(".png"))
    plt.close(fig)
    return [stem.with_suffix(".json"), stem.with_suffix(".png")]
