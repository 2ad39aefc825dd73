"""Where the images come from, under one worker: the same images captioned from files, from a
Parquet file of image bytes and from WebDataset tar shards, read by `wicore caption`'s own readers
and submitted as it submits to an external Redis (each image's bytes as a blob), each run timed
from the first read to the last result, the sources in turn and again (`--repeats`).

One `wicore worker` serves every run, so the comparison holds the device, the model and the
compiled graphs fixed; its caches are off (`--no-cache`), so no run reuses another's images, and
each run's jobs carry their own `seed` (greedy decoding ignores it), so none is deduplicated
against another's. Every job makes exactly `--new-tokens` tokens.

    python -m bench.caption_sources --preset gemma3-4b --dtype fp8 --images 1024 \\
        --out bench/results/caption-sources-gemma3-4b-fp8-h200.json

(from the repository root; needs the `datasets` extra for Parquet; the plot needs `bench`).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import signal
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from wicore.bench.bench_images import make_images
from wicore.bench.caption_bench import CaptionBench, device_name, wait_for_workers, worker_command
from wicore.cli.dataset_inputs import DatasetOptions
from wicore.cli.input_paths import InputItem, iter_inputs
from wicore.cli.submitting import submit_items

SHARD_IMAGES = 256  # images per WebDataset shard


def write_parquet(paths: list[Path], out: Path) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.table({"key": [p.stem for p in paths], "image": [p.read_bytes() for p in paths]})
    pq.write_table(table, out, row_group_size=64)
    return out


def write_shards(paths: list[Path], folder: Path) -> list[Path]:
    folder.mkdir(parents=True, exist_ok=True)
    shards = []
    for start in range(0, len(paths), SHARD_IMAGES):
        shard = folder / f"shard-{start // SHARD_IMAGES:05d}.tar"
        with tarfile.open(shard, "w") as tar:
            for path in paths[start : start + SHARD_IMAGES]:
                data = path.read_bytes()
                member = tarfile.TarInfo(f"{path.stem}{path.suffix}")
                member.size = len(data)
                tar.addfile(member, io.BytesIO(data))
        shards.append(shard)
    return shards


def sources(paths: list[Path], workdir: Path, wanted: list[str]) -> dict[str, list[str]]:
    """Each source's `wicore caption` arguments: the images as files, as Parquet, as shards."""
    folder = paths[0].parent
    made: dict[str, Callable[[], list[str]]] = {
        "files": lambda: [str(folder)],
        "parquet": lambda: [str(write_parquet(paths, workdir / "images.parquet"))],
        "webdataset": lambda: [str(s) for s in write_shards(paths, workdir / "shards")],
    }
    return {name: made[name]() for name in wanted}


def caption_once(producer, args: list[str], seed: int, new_tokens: int, prompt: str) -> dict:
    """Read `args` as `wicore caption` does, submit every input, wait for every result."""
    from wicore.producer import Submission
    from wicore.schemas import GenerationParams

    params = GenerationParams(max_new_tokens=new_tokens, ignore_eos=True, seed=seed)
    errors: list[str] = []

    def submission(item: InputItem) -> Submission:
        return Submission(image=item.image, prompt=prompt, params=params, name=item.input)

    start = time.perf_counter()
    items = iter_inputs(args, DatasetOptions())
    ids = [job_id for job_id, _ in submit_items(producer, items, submission, lambda i, e: errors.append(e))]
    outcomes = list(producer.wait(ids, timeout=1800))
    seconds = time.perf_counter() - start
    errors += [o.error for o in outcomes if o.error]
    done = sum(1 for o in outcomes if o.result)
    return {"seconds": seconds, "images": done, "images_per_s": done / seconds, "errors": errors[:5]}


def run(options: argparse.Namespace) -> dict:
    from redis import Redis

    from wicore.embedded import EmbeddedRedis
    from wicore.models.gemma3 import make_seeded
    from wicore.producer import Producer, ProducerConfig

    workdir = options.workdir
    workdir.mkdir(parents=True, exist_ok=True)
    model_dir = options.model or make_seeded(workdir / options.preset, options.preset)
    paths = make_images(workdir / "images", options.images, processes=os.cpu_count() or 4)
    warm = make_images(workdir / "warm", 64, seed=10**6, processes=os.cpu_count() or 4)
    made = sources(paths, workdir, options.sources)
    engine_options = {"gemm_dtype": "fp8"} if options.dtype == "fp8" else {}
    bench = CaptionBench(
        workdir,
        preset=options.preset,
        batch_size=options.batch_size,
        engine_options=engine_options,
        device=options.device,
    )
    runs: dict[str, list[dict]] = {name: [] for name in made}
    log = workdir / "worker.log"
    with EmbeddedRedis() as server:
        command = [*worker_command(bench, server.url, model_dir, workdir, 0), "--no-cache"]
        with open(log, "wb") as sink:
            worker = subprocess.Popen(command, stdout=sink, stderr=subprocess.STDOUT)
        try:
            started = time.perf_counter()
            wait_for_workers(Redis.from_url(server.url), worker, log, 1)
            ready_s = time.perf_counter() - started
            producer = Producer(server.url, model=options.preset, config=ProducerConfig(by_path=False))
            caption_once(producer, [str(warm[0].parent)], 0, options.new_tokens, options.prompt)
            for repeat in range(options.repeats):
                for index, (name, args) in enumerate(made.items()):
                    seed = 1 + repeat * len(made) + index
                    runs[name].append(caption_once(producer, args, seed, options.new_tokens, options.prompt))
                    print(f"{name} #{repeat + 1}: {runs[name][-1]['images_per_s']:.2f} images/s", flush=True)
        finally:
            worker.send_signal(signal.SIGTERM)
            worker.wait(timeout=120)
    return report(options, runs, ready_s)


def report(options: argparse.Namespace, runs: dict[str, list[dict]], ready_s: float) -> dict:
    median = {name: statistics.median(r["images_per_s"] for r in done) for name, done in runs.items()}
    base = median.get("files")
    return {
        "gpu": device_name(options.device),
        "command": "python -m bench.caption_sources " + " ".join(options.argv),
        "preset": options.preset,
        "dtype": options.dtype,
        "images": options.images,
        "new_tokens": options.new_tokens,
        "repeats": options.repeats,
        "worker_ready_s": round(ready_s, 1),
        "images_per_s": {name: round(value, 2) for name, value in median.items()},
        "vs_files": {name: round(value / base, 4) for name, value in median.items()} if base else None,
        "runs": runs,
    }


def plot(result: dict, out: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(result["images_per_s"])
    figure, axis = plt.subplots(figsize=(6, 3.5))
    for position, name in enumerate(names):
        values = [r["images_per_s"] for r in result["runs"][name]]
        axis.bar(position, result["images_per_s"][name], color="#4c72b0")
        axis.plot([position] * len(values), values, "o", color="black", markersize=3)
    axis.set_xticks(range(len(names)), names)
    axis.set_ylabel("images/s (median; dots: each run)")
    axis.set_title(f"{result['preset']} {result['dtype']}, {result['images']} images, {result['gpu']}", fontsize=9)
    figure.tight_layout()
    figure.savefig(out, dpi=120)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gemma3-4b")
    parser.add_argument("--dtype", default="fp8", choices=["bfloat16", "fp8"])
    parser.add_argument("--images", type=int, default=1024)
    parser.add_argument("--new-tokens", type=int, default=64)
    parser.add_argument("--batch-size", type=int, default=384)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--model", type=Path, default=None, help="A checkpoint (default: make-model PRESET).")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--sources", default="files,parquet,webdataset")
    parser.add_argument("--prompt", default="Describe this image in detail.")
    parser.add_argument("--workdir", type=Path, default=Path(tempfile.gettempdir()) / "wicore-caption-sources")
    parser.add_argument("--out", type=Path, default=None, help="Write the JSON here (and the plot beside it).")
    parser.add_argument("--plot-only", type=Path, default=None, help="Plot an earlier JSON result and exit.")
    options = parser.parse_args()
    if options.plot_only:
        plot(json.loads(options.plot_only.read_text()), options.plot_only.with_suffix(".png"))
        return
    options.argv = sys.argv[1:]
    options.sources = options.sources.split(",")
    result = run(options)
    text = json.dumps(result, indent=2)
    print(json.dumps({k: v for k, v in result.items() if k != "runs"}))
    if options.out:
        options.out.parent.mkdir(parents=True, exist_ok=True)
        options.out.write_text(text + "\n")
        try:
            plot(result, options.out.with_suffix(".png"))
        except ImportError:
            print("no matplotlib: plot later with --plot-only")


if __name__ == "__main__":
    main()
