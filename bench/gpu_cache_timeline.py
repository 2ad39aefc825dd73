"""Where the cached VQA run of `wicore bench cache` spends its time (issue 5, bench/NOTES.md).

    python bench/gpu_cache_timeline.py [--configs off,gpu,off-1stream,gpu-1stream] [--images 256]
    python bench/gpu_cache_timeline.py --configs gpu --profile-nth 5   # one launch of each kind, alone
    python bench/gpu_cache_timeline.py --configs gpu --cprofile        # host time of a whole run
    python bench/gpu_cache_timeline.py --configs gpu --syncs           # PyTorch's synchronizing calls

The benchmark's VQA flow (4B-shaped model, question-major requests, its warm-up) through the fast
engine, step by step: every vision, prefill (sequences, new tokens, how many read a cached
prefix) and decode launch is bracketed by CUDA events on its stream, and every step's host time
is taken, so a run splits into device time per kind of work and host time. `--batch-sizes` gives
each config its sequences in flight. Printed per config, and written to
$OUT/cache_timeline.json when $OUT is set:
- wall, the engine's phase seconds, steps, and the host time of steps that launched nothing;
- prefill launches by kind (first questions vs follow-ups with a cached prefix): count, mean
  sequences and new tokens, device ms (between the events: includes the device waiting for the
  host) and host ms each;
- when the last first question finished (the first 256 requests) and what the rest took;
- with one stream (the "-1stream" configs), the device's idle time between consecutive launches,
  by the kinds of the launches around it (`idle_after`).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
import warnings
from collections import Counter, defaultdict
from contextlib import nullcontext
from pathlib import Path

import torch

from wicore.bench.bench_images import make_images
from wicore.bench.cache_bench import WARM_IMAGES, CacheBench, make_engine, release, vqa_requests
from wicore.engines.fast import engine as engine_module
from wicore.engines.fast.attention_backends import PrefillAttention
from wicore.models.gemma3 import make_gemma3_4b

CONFIGS = {
    "off": dict(cache=False),
    "gpu": dict(cache=True, host_cache_bytes=0, prefix_split_images=True),
}
CONFIGS |= {f"{name}-1stream": dict(config, overlap_vision=False) for name, config in CONFIGS.items()}
CONFIGS["gpu-16threads"] = dict(CONFIGS["gpu"], torch_threads=16)  # torch's default here (run 57)


class SyncLog:
    """Synchronizing CUDA calls PyTorch makes during a run (`torch.cuda.set_sync_debug_mode`),
    counted by the Python stack that made them."""

    def __init__(self):
        self.stacks: Counter = Counter()

    def __enter__(self):
        self.saved = warnings.showwarning
        self.filters = warnings.catch_warnings()
        self.filters.__enter__()
        warnings.simplefilter("always")
        warnings.showwarning = self._record
        torch.cuda.set_sync_debug_mode("warn")
        return self

    def __exit__(self, *exc):
        torch.cuda.set_sync_debug_mode("default")
        warnings.showwarning = self.saved
        self.filters.__exit__(*exc)

    def _record(self, message, category, filename, lineno, file=None, line=None):
        frames = [f for f in traceback.extract_stack()[:-1] if "warnings" not in f.filename]
        where = " <- ".join(f"{Path(f.filename).name}:{f.lineno} {f.name}" for f in reversed(frames[-8:]))
        self.stacks[f"{str(message)[:60]} | {where}"] += 1

    def report(self) -> str:
        return "\n".join(f"{count:6d}  {stack}" for stack, count in self.stacks.most_common(20))


class HostTimers:
    """Host time of chosen functions inside the launches (per function: calls, total, the
    longest, and the calls over 50 ms with their step), to find what holds a launch's host."""

    def __init__(self, trace):
        self.trace = trace
        self.calls: dict[str, list[float]] = defaultdict(list)
        self.slow: list[tuple[str, int, float]] = []
        self.undo: list[tuple] = []  # (owner, name, what `owner` itself held there or None)

    def wrap(self, owner, name: str, label: str) -> None:
        """Time `owner.name` (an instance's method, a module's function, a class's method)."""
        inner = getattr(owner, name)
        self.undo.append((owner, name, vars(owner).get(name)))

        def timed(*args, **kwargs):
            start = time.perf_counter()
            try:
                return inner(*args, **kwargs)
            finally:
                ms = (time.perf_counter() - start) * 1e3
                self.calls[label].append(ms)
                if ms > 50:
                    self.slow.append((label, self.trace.step, round(ms, 1)))

        setattr(owner, name, timed)

    def restore(self) -> None:
        """Unwrap everything, so the next config's timers do not nest inside these."""
        for owner, name, own in reversed(self.undo):
            if own is None:
                delattr(owner, name)
            else:
                setattr(owner, name, own)
        self.undo = []

    def summary(self) -> dict:
        return {
            "functions": {
                k: {"calls": len(v), "total_ms": round(sum(v), 1), "max_ms": round(max(v), 1)}
                for k, v in sorted(self.calls.items(), key=lambda kv: -sum(kv[1]))
            },
            "slow_calls": self.slow[:40],
        }


def time_host_parts(engine, trace) -> HostTimers:
    from wicore.engines.fast import model_runner

    timers = HostTimers(trace)
    runner = engine.runner
    for name in ("_stage", "encode", "pixel_values", "_image_embeds", "prefill_logits", "_sample", "_dense_prefill"):
        timers.wrap(runner, name, f"runner.{name}")
    for name in ("prefill_inputs", "upload", "paged_columns", "gemma3_prefill_masks", "group_batch"):
        if hasattr(model_runner, name):
            timers.wrap(model_runner, name, name)
    fns, decoder = runner.parts.decoder.fns, runner.parts.decoder
    timers.wrap(fns, "inputs", "layer.inputs")
    timers.wrap(fns, "outputs", "layer.outputs")
    timers.wrap(decoder, "logits", "decoder.logits")
    timers.wrap(PrefillAttention, "__call__", "PrefillAttention")
    timers.wrap(engine.images, "_encode", "images._encode")
    timers.wrap(engine.scheduler, "_admit", "scheduler._admit")
    return timers


def dynamo_counters() -> dict[str, int]:
    """torch._dynamo's counters, flattened ("frames.ok", "stats.unique_graphs", ...): a change
    during a run means something compiled (or recompiled) there."""
    from torch._dynamo.utils import counters

    return {f"{group}.{key}": value for group, values in counters.items() for key, value in values.items()}


class Trace:
    """Wraps an engine's runner so each launch records (kind, sizes, start event, end event)."""

    def __init__(self, engine, profile_nth: int = 0):
        self.launches: list[dict] = []
        self.step = 0
        self.origin = time.perf_counter()  # the timed run's start (`at_s` of each launch)
        self.seen: Counter = Counter()  # prefill launches so far, by kind
        self.profiles: dict[str, str] = {}  # kind -> op table of its `profile_nth` launch
        runner = engine.runner
        prefill, decode = runner.prefill, runner.decode

        def traced_prefill(seqs):
            cached = sum(1 for s in seqs if s.prefix_len)
            kind = "prefill follow-up" if cached else "prefill first"
            new = sum(s.prompt_len - s.prefix_len for s in seqs)
            self.seen[kind] += 1
            if self.seen[kind] == profile_nth:
                return self._profiled(f"{kind}: {len(seqs)} sequences, {new} new tokens", prefill, seqs)
            start, host = self._open()
            with torch.profiler.record_function(kind):
                out = prefill(seqs)
            self._close(start, host, kind, seqs=len(seqs), new=new, cached=cached)
            return out

        def traced_decode(seqs):
            start, host = self._open()
            with torch.profiler.record_function("decode"):
                out = decode(seqs)
            self._close(start, host, "decode", seqs=len(seqs))
            return out

        encode_images = runner.encode_images

        def traced_vision(images):
            start, host = self._open(runner.side_stream)
            out = encode_images(images)
            self._close(start, host, "vision", runner.side_stream, seqs=len(images))
            return out

        runner.prefill, runner.decode, runner.encode_images = traced_prefill, traced_decode, traced_vision

    def _profiled(self, title: str, prefill, seqs):
        """One launch alone under the profiler (the device drained before and after); not timed."""
        from torch.profiler import ProfilerActivity, profile

        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
            out = prefill(seqs)
            torch.cuda.synchronize()
        averages = prof.key_averages()
        by_device = averages.table(sort_by="device_time_total", row_limit=20, max_name_column_width=60)
        by_host = averages.table(sort_by="self_cpu_time_total", row_limit=30, max_name_column_width=60)
        self.profiles[title] = f"{title}\n{by_device}\n{title}, by host time\n{by_host}"
        return out

    @staticmethod
    def _open(stream=None):
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        return start, time.perf_counter()

    def _close(self, start, host: float, kind: str, stream=None, **sizes) -> None:
        host_ms = (time.perf_counter() - host) * 1e3  # the launch's host time (enqueueing)
        end = torch.cuda.Event(enable_timing=True)
        end.record(stream)
        at_s = host - self.origin  # when the launch began, on the host
        self.launches.append(
            {"kind": kind, "step": self.step, "at_s": at_s, "start": start, "end": end, "host_ms": host_ms, **sizes}
        )

    def device_ms(self, one_stream: bool) -> list[dict]:
        """Each launch's device ms; with `one_stream` (vision on the main stream too) also the
        idle ms between it and the next launch (`gap_ms`: nothing of ours queued)."""
        torch.cuda.synchronize()
        out = []
        for i, launch in enumerate(self.launches):
            row = {k: v for k, v in launch.items() if k not in ("start", "end")}
            row["ms"] = launch["start"].elapsed_time(launch["end"])
            if one_stream and i + 1 < len(self.launches):
                row["gap_ms"] = launch["end"].elapsed_time(self.launches[i + 1]["start"])
            out.append(row)
        return out


def run(
    name: str,
    model_dir: Path,
    bench: CacheBench,
    requests,
    warm,
    measured=None,
    profile_nth: int = 0,
    syncs=False,
    host_parts=False,
) -> dict:
    """One config's timed run; `measured`: a profiler (torch or cProfile) around the timed part."""
    options = dict(CONFIGS[name])
    engine = make_engine(model_dir, bench, options.pop("cache"), **options)
    engine.generate(warm)
    trace = Trace(engine, profile_nth)
    timers = time_host_parts(engine, trace) if host_parts else None
    firsts = {r.id for r in requests[: bench.images]}  # first questions not yet finished
    torch.cuda.synchronize()
    memory_before = torch.cuda.memory_stats()
    dynamo_before = dynamo_counters()
    step_s, idle_s, first_done = [], 0.0, None
    sync_log = SyncLog() if syncs else None
    with measured or nullcontext(), sync_log or nullcontext():
        start = trace.origin = time.perf_counter()
        engine.add(requests)
        add_s = time.perf_counter() - start
        while engine.num_unfinished():
            trace.step += 1
            t = time.perf_counter()
            launches = len(trace.launches)
            done = engine.step()
            step_s.append(time.perf_counter() - t)
            if len(trace.launches) == launches:
                idle_s += step_s[-1]
            firsts -= {c.id for c in done}
            if first_done is None and not firsts:
                first_done = time.perf_counter() - start
        torch.cuda.synchronize()
        wall = time.perf_counter() - start
    memory_after = torch.cuda.memory_stats()
    dynamo_after = dynamo_counters()
    if timers is not None:
        timers.restore()
    stats = engine.stats()
    launches = trace.device_ms(one_stream=options.get("overlap_vision") is False)
    release(engine)
    for table in trace.profiles.values():
        print(table, flush=True)
    if sync_log is not None:
        print(f"synchronizing calls in {name}:\n{sync_log.report()}", flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], f"syncs-{name}.txt").write_text(sync_log.report() + "\n")
    summary = {
        "name": name,
        "wall_s": round(wall, 3),
        "first_questions_done_s": round(first_done or wall, 3),
        "add_s": round(add_s, 3),  # engine.add of every request (prompts, keys, pixel jobs)
        "first_launch_s": round(launches[0]["at_s"], 3) if launches else None,
        "steps": len(step_s),
        "host_s_of_idle_steps": round(idle_s, 3),
        "host_s_all_steps": round(sum(step_s), 3),
        "phases": {k: round(stats.get(k, 0.0), 3) for k in ("vision_s", "prefill_s", "decode_s")},
        "images_encoded": stats.get("images_encoded"),
        "cached_prompt_tokens": stats.get("cached_prompt_tokens"),
        # The caching allocator during the run: cudaMalloc / cudaFree calls, and retries after a
        # failed cudaMalloc (each frees the cached blocks first: a device-wide synchronization).
        "allocator": {
            key: memory_after.get(key, 0) - memory_before.get(key, 0)
            for key in ("num_device_alloc", "num_device_free", "num_alloc_retries", "num_sync_all_streams")
        },
        "reserved_gib": round(memory_after.get("reserved_bytes.all.current", 0) / 2**30, 2),
        "dynamo": {k: v - dynamo_before.get(k, 0) for k, v in dynamo_after.items() if v != dynamo_before.get(k, 0)},
        "by_kind": by_kind(launches),
        "host_parts": timers.summary() if timers is not None else None,
        "idle_after": idle_after(launches),
    }
    print(json.dumps(summary, indent=1), flush=True)
    return {**summary, "launches": launches}


def by_kind(launches: list[dict]) -> dict:
    """Per kind of launch: count, device seconds, mean sequences / new tokens / device ms / host ms."""
    groups = defaultdict(list)
    for row in launches:
        groups[row["kind"]].append(row)
    mean = lambda rows, key: sum(r.get(key, 0) for r in rows) / len(rows)  # noqa: E731
    return {
        kind: {
            "launches": len(rows),
            "device_s": round(sum(r["ms"] for r in rows) / 1e3, 3),
            "mean_seqs": round(mean(rows, "seqs"), 1),
            "mean_new_tokens": round(mean(rows, "new"), 1),
            "mean_ms": round(mean(rows, "ms"), 2),
            "mean_host_ms": round(mean(rows, "host_ms"), 2),
        }
        for kind, rows in groups.items()
    }


def idle_after(launches: list[dict]) -> dict:
    """Device idle seconds between consecutive launches, by (kind -> next kind), largest first."""
    gaps = Counter()
    for row, following in zip(launches, launches[1:], strict=False):
        if "gap_ms" in row:
            gaps[f"{row['kind']} -> {following['kind']}"] += row["gap_ms"] / 1e3
    return {pair: round(seconds, 3) for pair, seconds in gaps.most_common()}


def per_config(text: str, cast, count: int) -> list:
    """One comma-separated value per config, the last repeated for the rest ([] when empty)."""
    values = [cast(v) for v in text.split(",")] if text else []
    return values + values[-1:] * (count - len(values))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--configs", default="off,gpu")
    parser.add_argument("--profile", action="store_true", help="also run the last config under torch.profiler")
    parser.add_argument("--cprofile", action="store_true", help="also run the last config under cProfile (host time)")
    parser.add_argument("--profile-nth", type=int, default=0, help="profile the n-th prefill of each kind alone")
    parser.add_argument("--syncs", action="store_true", help="log PyTorch's synchronizing calls (sync debug mode)")
    parser.add_argument("--switch-intervals", default="", help="sys.setswitchinterval per config (the GIL's)")
    parser.add_argument("--host-parts", action="store_true", help="time chosen functions' host time")
    parser.add_argument("--vision-in-flight", default="", help="vision batches queued at once, per config")
    parser.add_argument("--images", type=int, default=256)
    parser.add_argument("--batch-sizes", default="384", help="engine max_batch_size per config, comma-separated")
    parser.add_argument("--workdir", default="/tmp/wicore-cache-timeline")
    args = parser.parse_args()
    bench = CacheBench(workdir=Path(args.workdir), images=args.images)
    bench.workdir.mkdir(parents=True, exist_ok=True)
    model_dir = make_gemma3_4b(bench.workdir / "gemma3-4b")
    paths = make_images(bench.workdir / "images", bench.images + WARM_IMAGES, processes=16)
    warm = vqa_requests(paths[-WARM_IMAGES:], 1, 4)
    requests = vqa_requests(paths[: bench.images], bench.questions, bench.new_tokens)
    names = args.configs.split(",")
    sizes = per_config(args.batch_sizes, int, len(names))
    intervals = per_config(args.switch_intervals, float, len(names))
    in_flight = per_config(args.vision_in_flight, int, len(names))
    results = []
    for i, (name, size) in enumerate(zip(names, sizes, strict=True)):
        bench.batch_size = size
        if intervals:
            sys.setswitchinterval(intervals[i])
        if in_flight:
            engine_module.VISION_IN_FLIGHT = in_flight[i]
        results.append(
            {
                **run(
                    name,
                    model_dir,
                    bench,
                    requests,
                    warm,
                    profile_nth=args.profile_nth,
                    syncs=args.syncs,
                    host_parts=args.host_parts,
                ),
                "batch_size": size,
                "switch_interval_s": sys.getswitchinterval(),
                "torch_threads": torch.get_num_threads(),  # as the engine set them
                "vision_in_flight": engine_module.VISION_IN_FLIGHT,
            }
        )
        if os.environ.get("OUT"):  # after each config: a run cut short by its time limit keeps the rest
            Path(os.environ["OUT"], "cache_timeline.json").write_text(json.dumps(results) + "\n")
    if args.cprofile:
        import cProfile
        import io
        import pstats

        host = cProfile.Profile()
        run(names[-1], model_dir, bench, requests, warm, measured=host)
        text = io.StringIO()
        stats = pstats.Stats(host, stream=text)
        stats.sort_stats("tottime").print_stats(45)
        stats.sort_stats("cumulative").print_stats(60)
        print(text.getvalue()[:12000], flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "cprofile.txt").write_text(text.getvalue())
    if args.profile:
        from torch.profiler import ProfilerActivity, profile

        prof = profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA])
        run(names[-1], model_dir, bench, requests, warm, measured=prof)
        table = prof.key_averages().table(sort_by="device_time_total", row_limit=40, max_name_column_width=70)
        print(table, flush=True)
        if os.environ.get("OUT"):
            Path(os.environ["OUT"], "profile.txt").write_text(table)


if __name__ == "__main__":
    main()
