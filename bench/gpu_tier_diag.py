"""Why the prefix cache's GPU tier missed in the cache benchmark's VQA runs (issue 5, bench/NOTES.md
run 8): the VQA flow of `wicore bench cache` on a small model, traced.

    python bench/gpu_tier_diag.py                  # CUDA, bf16, compile + graphs as on CUDA by default
    python bench/gpu_tier_diag.py --device cpu     # the same flow on CPU (fewer images)
    python bench/gpu_tier_diag.py --sizing-4b      # only: the pools the real 4B-shaped engines get

The engines are built and run in the benchmark's order with its options (core/bench/cache.py):
caching off; GPU tiers only (`host_cache_bytes=0`, `prefix_split_images=True`, the pool sized
from memory as the benchmark does); GPU + CPU + disk with a small GPU pool; and, beyond the
benchmark, the GPU tier alone with that small pool. Requests are the
benchmark's: question-major, 4 questions per image, 32 new tokens, the caller's image hashes,
after the same 8-image warm-up. The default model ("mid") has Gemma-3-4B's KV layout (34
layers, 4 KV heads of 256, a 1024-token window: 7 page groups, pages of the 4B's size) and 256
image tokens per image, with narrow layers, so the pool holds as many pages as the 4B's would.

Printed for every engine: its pool (pages, pages a request reserves, device memory before and
after, the pool planner's log line), the per-tier counters, and for the first follow-up
questions: their keys against the keys their image's first question registered, what the GPU
pool and the host tier held at their admission, and why each key missed (evicted when and
while admitting whom, cut from the match, never cached). Then the tokens of the cached runs
against the run with caching off, and whether `release` really gave each pool back.
With $OUT set, the printout also goes to $OUT/gpu_tier_diag.log (and a JSON summary beside it).

Reading it: follow-ups whose shared keys are "evicted" (GPU hits 0) mean the pool could not keep
every image's blocks for the ~`images` requests between an image's questions: compare the
pool's pages with the working set printed beside them. On CPU the "gpu" run's pool is set to
hold everything (the CPU default would be 384 x 902 pages), as in the CPU flows that hit.
"""

from __future__ import annotations

import argparse
import gc
import json
import logging
import os
import shutil
import sys
import time
import weakref
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch

from wicore.bench.bench_images import make_images
from wicore.bench.cache_bench import CacheBench, release, vqa_requests
from wicore.engines.base import EngineConfig
from wicore.engines.checkpoint import SEED_FILE
from wicore.engines.fast import FastEngine
from wicore.models.corpus import tokenizer_corpus
from wicore.models.gemma3 import gemma3_4b_config, make_gemma3_4b, make_processor, tiny_config
from wicore.models.tokenizer import train_tokenizer

BENCH = CacheBench(workdir=Path("."))  # the benchmark's defaults: batch 384, 16k small pool, 16 GiB host


# -- output ------------------------------------------------------------------------------------


class Printer:
    """print() to stdout and, with $OUT set, to $OUT/gpu_tier_diag.log."""

    def __init__(self) -> None:
        out = os.environ.get("OUT")
        self.dir = Path(out) if out else None
        self.file = None
        if self.dir is not None:
            self.dir.mkdir(parents=True, exist_ok=True)
            self.file = (self.dir / "gpu_tier_diag.log").open("w")

    def __call__(self, *parts) -> None:
        line = " ".join(str(p) for p in parts)
        print(line, flush=True)
        if self.file is not None:
            self.file.write(line + "\n")
            self.file.flush()

    def write_json(self, data: dict) -> None:
        if self.dir is not None:
            (self.dir / "gpu_tier_diag.json").write_text(json.dumps(data, indent=1, default=str))


say = Printer()


class SayHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        say(f"  [log {record.name}] {record.getMessage()}")


# -- the model ---------------------------------------------------------------------------------


def make_model(folder: Path, shape: str) -> Path:
    """A config-only Gemma-3 checkpoint (weights seeded at load time), 256 image tokens per
    image (128 px, patch 8, no pooling). "mid": Gemma-3-4B's text attention shape (so its KV
    pages and page groups) with 256-wide layers; "tiny": 2 layers."""
    out = folder / f"{shape}-256"
    if (out / "config.json").is_file():
        return out
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = train_tokenizer(tokenizer_corpus(), vocab_size=1024)
    config = tiny_config(tokenizer, sliding_window=1024, image_size=128)
    config.mm_tokens_per_image = 256
    text = config.text_config
    text.max_position_embeddings = 131_072  # max_model_len 8192, as the 4B's
    if shape == "mid":
        four_b = gemma3_4b_config().text_config
        for name in ("num_hidden_layers", "layer_types", "num_attention_heads", "num_key_value_heads", "head_dim",
                     "query_pre_attn_scalar", "sliding_window"):  # fmt: skip
            setattr(text, name, getattr(four_b, name))
        text.hidden_size, text.intermediate_size = 256, 512
    config.save_pretrained(out)
    make_processor(tokenizer, config).save_pretrained(out)
    (out / SEED_FILE).write_text(json.dumps({"seed": 0}))
    return out


# -- tracing one engine's GPU tier --------------------------------------------------------------


@dataclass
class Lookup:
    """What one sequence found at its admission."""

    seq_id: str
    step: int
    keys: list[bytes]
    in_pool: list[bool]
    in_host: list[bool]
    gpu_hits: int  # blocks taken from the GPU pool
    lower_hits: int  # blocks restored from the host tier or disk
    prefix_len: int
    prompt_len: int
    image_end: int  # end of the first image's soft tokens
    pool_blocks: int
    free_pages: int
    mark: int  # events before this admission (those during it are its own)
    siblings_running: list[str] = field(default_factory=list)  # same image, admitted, not finished


class Tracer:
    """Watches one engine: who registered each key and when, when it was evicted (and while
    admitting whom), and what each sequence found at admission. Instance attributes wrap the
    scheduler's and the block manager's methods; nothing else changes."""

    def __init__(self, engine: FastEngine):
        self.engine = engine
        self.placing: str | None = None
        self.events: dict[bytes, list[tuple[int, int, str, str]]] = {}  # key -> (serial, step, what, seq id)
        self.serial = 0
        self.lookups: dict[str, Lookup] = {}
        self.running: set[str] = set()
        blocks, scheduler = engine.blocks, engine.scheduler
        if blocks.cache is None:
            return
        place, register, evict, finish = scheduler._place, blocks.register, blocks.cache.evict, scheduler.finish

        def traced_place(seq):
            return self._place(place, seq)

        def traced_register(key, pages, cost):
            block = register(key, pages, cost)
            if block is not None:
                self._event(key, "registered")
            return block

        def traced_evict():
            block = evict()
            if block is not None:
                self._event(block.key, "evicted")
            return block

        def traced_finish(seq):
            self.running.discard(seq.id)
            return finish(seq)

        scheduler._place, blocks.register, blocks.cache.evict = traced_place, traced_register, traced_evict
        scheduler.finish = traced_finish

    @property
    def step(self) -> int:
        return self.engine.counters.steps

    def _event(self, key: bytes, what: str) -> None:
        self.events.setdefault(key, []).append((self.serial, self.step, what, self.placing or "?"))
        self.serial += 1

    def _place(self, place, seq) -> bool:
        keys = seq.keys()
        if keys is None:
            return place(seq)
        engine = self.engine
        cache, host = engine.blocks.cache, engine.tiers.host
        in_pool = [k in cache for k in keys.keys]
        in_host = [host is not None and k in host for k in keys.keys]
        pool_blocks, free, mark = len(cache), engine.blocks.num_free, self.serial
        self.placing = seq.id
        try:
            placed = place(seq)
        finally:
            self.placing = None
        if placed:
            image = seq.id.split("-")[0]
            siblings = sorted(s for s in self.running if s.split("-")[0] == image)
            image_end = keys.image_spans[0][1] if keys.image_spans else 0
            self.lookups[seq.id] = Lookup(
                seq.id, self.step, list(keys.keys), in_pool, in_host, len(seq.reads), len(seq.restores),
                seq.prefix_len, seq.prompt_len, image_end, pool_blocks, free, mark, siblings,
            )  # fmt: skip
            self.running.add(seq.id)
        return placed

    # -- reading the trace ------------------------------------------------------------------

    def reason(self, lookup: Lookup, index: int) -> str:
        """Why key `index` of a lookup was or was not a GPU hit."""
        if index < lookup.gpu_hits:
            return "GPU hit"
        if lookup.in_pool[index]:
            return "in the pool, not used (match stopped earlier or was cut)"
        if index < lookup.gpu_hits + lookup.lower_hits:
            where = "host tier" if lookup.in_host[index] else "disk"
            prior = self._last_event(lookup.keys[index], lookup.mark)
            return f"restored from the {where}" + (f" (evicted from the pool at step {prior[1]})" if prior else "")
        prior = self._last_event(lookup.keys[index], lookup.mark)
        if prior is None:
            return "never in the pool before (new key)"
        _, step, what, by = prior
        if what == "evicted":
            return f"evicted at step {step} while admitting {by}"
        return f"registered at step {step} by {by} but gone (bookkeeping?)"

    def _last_event(self, key: bytes, mark: int):
        past = [e for e in self.events.get(key, []) if e[0] < mark]
        return past[-1] if past else None


def runs(reasons: list[str]) -> str:
    """Run-length summary: 'keys 0-16: evicted ...; key 17: new'."""
    parts, start = [], 0
    for i in range(1, len(reasons) + 1):
        if i == len(reasons) or reasons[i] != reasons[start]:
            span = f"key {start}" if i - 1 == start else f"keys {start}-{i - 1}"
            parts.append(f"{span}: {reasons[start]}")
            start = i
    return "; ".join(parts)


def hexes(keys: list[bytes], shared: int) -> str:
    picks = sorted({0, 1, 2, max(0, shared - 1)} & set(range(len(keys))))
    return " ".join(keys[i].hex()[:10] for i in picks)


def report_follow_ups(tracer: Tracer, show: int) -> dict:
    """Detail for the first `show` follow-up questions; a tally of reasons for all of them,
    over the keys their image's first question registered (the ones a follow-up can share)."""
    tally: Counter = Counter()
    follow = [lk for sid, lk in tracer.lookups.items() if not sid.endswith("-0") and "w" not in sid]
    equal_prefixes = []
    for n, lookup in enumerate(follow):
        first = tracer.lookups.get(lookup.seq_id.split("-")[0] + "-0")
        shared = 0
        if first is not None:
            while shared < min(len(first.keys), len(lookup.keys)) and first.keys[shared] == lookup.keys[shared]:
                shared += 1
        equal_prefixes.append(shared)
        reasons = [tracer.reason(lookup, i) for i in range(len(lookup.keys))]
        tally.update(reason.split(" at step")[0].split(" (evicted")[0] for reason in reasons[:shared])
        if n < show:
            say(
                f"  {lookup.seq_id} (step {lookup.step}): {len(lookup.keys)} keys, {shared} equal to its image's "
                f"first question's; pool had {sum(lookup.in_pool)} of them ({lookup.pool_blocks} blocks cached, "
                f"{lookup.free_pages} pages free), host {sum(lookup.in_host)}; GPU hits {lookup.gpu_hits}, "
                f"restored {lookup.lower_hits}, prefix {lookup.prefix_len}/{lookup.prompt_len} tokens "
                f"(image ends at {lookup.image_end}); same image running: {lookup.siblings_running or 'none'}"
            )
            say(f"      {runs(reasons)}")
            if first is not None:
                say(f"      keys 0-2 and {shared - 1}: this {hexes(lookup.keys, shared)}; first question "
                    f"{hexes(first.keys, shared)}")  # fmt: skip
    if follow:
        say(f"  follow-ups: {len(follow)}; keys equal to the first question's: min {min(equal_prefixes)}, "
            f"max {max(equal_prefixes)}")  # fmt: skip
        say(f"  their shareable keys at admission: {dict(tally.most_common())}")
    return {"follow_ups": len(follow), "shareable_key_reasons": dict(tally)}


# -- engines -----------------------------------------------------------------------------------


def memory(device: str) -> str:
    if not device.startswith("cuda"):
        return "n/a (CPU)"
    free, total = torch.cuda.mem_get_info()
    return f"{(total - free) / 2**30:.1f} GiB used of {total / 2**30:.1f} (allocated {torch.cuda.memory_allocated() / 2**30:.1f})"


def sync(device: str) -> None:
    if device.startswith("cuda"):
        torch.cuda.synchronize()


def build_engine(model_dir: Path, args, cache: bool, options: dict) -> FastEngine:
    """The fast engine as the benchmark builds it, on this run's device and dtype."""
    config = EngineConfig(str(model_dir), device=args.device, dtype=args.dtype, max_batch_size=BENCH.batch_size,
                          cache=cache, options=options)  # fmt: skip
    return FastEngine(config)


def run_engine(name, model_dir, args, requests, warm, cache: bool, **options) -> dict:
    """One configuration the benchmark's way (`run_config`), traced."""
    say(f"\n== {name}: cache={cache} options={options}")
    say(f"  device memory before: {memory(args.device)}")
    if args.no_compile:
        options = {**options, "compile_text": False, "compile_vision": False}
    started = time.perf_counter()
    engine = build_engine(model_dir, args, cache, options)
    built = time.perf_counter() - started
    layout = engine.runner.layout
    longest = max(len(engine.inputs.prompt(r.chat, len(r.images)).ids) + r.params.max_new_tokens for r in requests)
    reserve = layout.pages_for(longest)
    say(f"  built in {built:.0f} s; pool {engine.blocks.num_pages - 1} pages of {layout.block_size} tokens x "
        f"{len(layout.groups)} groups; a request reserves {reserve} pages; memory now {memory(args.device)}")  # fmt: skip
    tracer = Tracer(engine)
    engine.generate(warm)
    sync(args.device)
    started = time.perf_counter()
    out = engine.generate(requests)
    sync(args.device)
    seconds = time.perf_counter() - started
    stats = engine.stats()
    errors = [c for c in out if not c.ok]
    say(f"  {len(requests)} requests in {seconds:.1f} s ({len(requests) / seconds:.1f}/s), {len(errors)} failed"
        + (f", e.g. {errors[0].error}" if errors else ""))  # fmt: skip
    keep = ("kv_pages", "kv_pages_free", "kv_pages_cached", "kv_pages_used", "mean_decode_batch", "max_decode_batch",
            "prompt_tokens", "cached_prompt_tokens", "images_encoded", "kv_blocks_demoted", "kv_blocks_dropped")  # fmt: skip
    say(
        "  "
        + ", ".join(f"{k} {stats[k]:.0f}" if isinstance(stats.get(k), float) else f"{k} {stats.get(k)}" for k in keep)
    )
    if "vision_cache" in stats:
        vc = stats["vision_cache"]
        say(f"  vision cache: hits {vc['hits']} misses {vc['misses']}")
    for tier, counters in stats["cache"].items():
        say(f"  tier {tier:5s}: hits {counters['hits']:6d} misses {counters['misses']:6d} "
            f"evictions {counters['evictions']:6d} bytes in {counters['bytes_in'] / 2**30:.2f} GiB")  # fmt: skip
    trace = {}
    if engine.blocks.cache is not None:
        need = working_set(tracer, layout)
        say(f"  for every follow-up to hit, the pool must keep each image's shared blocks until its next question: "
            f"about {need} pages besides the running requests' reservations (pool: {engine.blocks.num_pages - 1})")  # fmt: skip
        trace = report_follow_ups(tracer, args.show)
    kv_ref = weakref.ref(engine.runner.cache.tensor)
    release(engine)  # as the benchmark does, while this frame still holds the engine
    alive_in_frame = kv_ref() is not None
    del engine, tracer
    gc.collect()
    if args.device.startswith("cuda"):
        torch.cuda.empty_cache()
    say(f"  after release: KV pool alive while the caller holds the engine: {alive_in_frame}; "
        f"after the caller drops it: {kv_ref() is not None}; memory {memory(args.device)}")  # fmt: skip
    return {"name": name, "seconds": seconds, "built_s": built, "tokens": {c.id: list(c.token_ids) for c in out},
            "stats": {k: stats.get(k) for k in keep} | {"cache": stats["cache"]}, "trace": trace,
            "kv_alive_after_release": alive_in_frame}  # fmt: skip


def working_set(tracer: Tracer, layout) -> int:
    """Pages of the blocks first questions share with later ones (what the pool must keep)."""
    first = [lk for sid, lk in tracer.lookups.items() if sid.endswith("-0") and "w" not in sid]
    shared = [lk.image_end // layout.block_size for lk in first]
    return sum(shared) * len(layout.groups)


def compare_tokens(off: dict, other: dict) -> None:
    same = [rid for rid, ids in other["tokens"].items() if off["tokens"].get(rid) == ids]
    differ = [rid for rid in other["tokens"] if rid not in set(same)]
    say(f"  {other['name']}: {len(same)}/{len(other['tokens'])} requests with the same tokens as caching off")
    for rid in differ[:5]:
        a, b = off["tokens"][rid], other["tokens"][rid]
        at = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        say(f"    {rid}: first differs at token {at}: off {a[at : at + 4]} vs {b[at : at + 4]}")


# -- the real 4B shape's pools -----------------------------------------------------------------


def sizing_4b(args, workdir: Path) -> list[dict]:
    """Build the benchmark's first two engines on the real Gemma-3-4B shape (no requests): how
    many pages each gets, and whether the first one's memory came back."""
    from wicore.bench.roofline import measure_ceilings

    say("\n== sizing on the Gemma-3-4B shape (the benchmark's first two engines)")
    if args.device.startswith("cuda"):
        measure_ceilings(args.device)  # as the benchmark does first
    model_dir = make_gemma3_4b(workdir / "gemma3-4b")
    results = []
    for name, cache, options in (
        ("off", False, {}),
        ("gpu", True, {"host_cache_bytes": 0, "prefix_split_images": True}),
    ):
        say(f"  {name}: memory before {memory(args.device)}")
        started = time.perf_counter()
        engine = build_engine(model_dir, args, cache, options)
        pages, text = engine.blocks.num_pages - 1, engine.runner.text_config
        page_bytes = engine.runner.layout.page_bytes(text.num_key_value_heads, text.head_dim, engine.runner.dtype)
        say(f"  {name}: {pages} pages ({pages * page_bytes / 2**30:.1f} GiB) in {time.perf_counter() - started:.0f} s;"
            f" memory {memory(args.device)}")  # fmt: skip
        kv_ref = weakref.ref(engine.runner.cache.tensor)
        release(engine)
        del engine
        gc.collect()
        say(f"  {name}: released; KV pool still alive: {kv_ref() is not None}; memory {memory(args.device)}")
        results.append({"name": name, "pages": pages})
    return results


# -- main --------------------------------------------------------------------------------------


def parse() -> argparse.Namespace:
    cuda = torch.cuda.is_available()
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--device", default="cuda" if cuda else "cpu")
    p.add_argument("--dtype", default="bfloat16")
    p.add_argument("--shape", choices=("mid", "tiny"), help="model (default mid on CUDA, tiny on CPU)")
    p.add_argument("--images", type=int, help="images x 4 questions (default 256 on CUDA as the benchmark, 6 on CPU)")
    p.add_argument("--gpu-pages", type=int, help="pool of the 'GPU tiers only' run (default: sized from memory "
                   "on CUDA as the benchmark; on CPU enough for every request at once)")  # fmt: skip
    p.add_argument("--small-pages", type=int, help="pool of the small-pool runs (default: the benchmark's "
                   "16,384 4B pages scaled to as many requests per image)")  # fmt: skip
    p.add_argument("--no-compile", action="store_true", help="eager text and vision (compiled by default on CUDA)")
    p.add_argument("--paged-prefill-tokens", type=int, help="the engines' paged_prefill_tokens (default: theirs)")
    p.add_argument("--show", type=int, default=6, help="follow-up questions shown in detail per engine")
    p.add_argument("--sizing-4b", action="store_true", help="only build the benchmark's first two engines on the "
                   "real 4B shape and print their pools (no requests; a few minutes with compiling)")  # fmt: skip
    p.add_argument("--workdir", type=Path, default=Path("/tmp/wicore-gpu-tier-diag"))
    args = p.parse_args()
    if args.images is None:
        args.images = 256 if args.device.startswith("cuda") else 6
    if args.shape is None:
        args.shape = "mid" if args.device.startswith("cuda") else "tiny"
    return args


def request_pages(model_dir: Path) -> int:
    """Pages one VQA request reserves (about 290 prompt tokens + 32 new), without an engine."""
    from transformers import AutoConfig

    from wicore.engines.kvcache.kv_layout import KVLayout

    text = AutoConfig.from_pretrained(model_dir).text_config
    return KVLayout.build(text, 16, 8192).pages_for(256 + 40 + BENCH.new_tokens)


def main() -> None:
    args = parse()
    logging.getLogger("wicore.engines.fast.kv_budget").addHandler(SayHandler())
    logging.getLogger("wicore.engines.fast.kv_budget").setLevel(logging.INFO)
    if args.device == "cpu":
        torch.set_num_threads(min(torch.get_num_threads(), 2))
    name = torch.cuda.get_device_name(0) if args.device.startswith("cuda") else "CPU"
    say(f"gpu_tier_diag: {name}, torch {torch.__version__}, {args.dtype}, shape {args.shape}, {args.images} images")
    args.workdir.mkdir(parents=True, exist_ok=True)
    if args.sizing_4b:
        if not args.device.startswith("cuda"):
            raise SystemExit("--sizing-4b needs CUDA (on CPU the 4B pool is sized by a formula, 113 GB)")
        say.write_json({"device": name, "args": vars(args), "sizing_4b": sizing_4b(args, args.workdir)})
        return
    model_dir = make_model(args.workdir, args.shape)
    paths = make_images(args.workdir / "images", args.images + 8, processes=min(8, os.cpu_count() or 1))
    warm = vqa_requests(paths[-8:], 1, 4)
    for r in warm:
        r.id = "w" + r.id  # the warm-up's ids stay apart from the measured ones
    requests = vqa_requests(paths[: args.images], BENCH.questions, BENCH.new_tokens)
    split = {"prefix_split_images": True}
    if args.paged_prefill_tokens is not None:  # every engine, "off" included
        split["paged_prefill_tokens"] = args.paged_prefill_tokens
    per_request, four_b_request = request_pages(model_dir), 147
    gpu_pages = args.gpu_pages
    if gpu_pages is None and not args.device.startswith("cuda"):
        gpu_pages = (len(requests) + len(warm)) * per_request  # nothing evicted, as in the CPU flows that hit
    scaled = BENCH.small_gpu_pages * args.images * per_request // (256 * four_b_request)
    small = args.small_pages or max(2 * per_request, scaled)
    host = max(2**30, BENCH.host_cache_bytes * args.images // 256)
    disk = args.workdir / "kv-disk"
    shutil.rmtree(disk, ignore_errors=True)
    gpu_options = {"host_cache_bytes": 0, **split} | ({"num_kv_blocks": gpu_pages} if gpu_pages else {})
    off_options = {"num_kv_blocks": gpu_pages} if gpu_pages and not args.device.startswith("cuda") else {}
    if args.paged_prefill_tokens is not None:
        off_options["paged_prefill_tokens"] = args.paged_prefill_tokens
    results = [
        run_engine("off", model_dir, args, requests, warm, cache=False, **off_options),
        run_engine("gpu", model_dir, args, requests, warm, cache=True, **gpu_options),
        run_engine("gpu+cpu+disk (small GPU pool)", model_dir, args, requests, warm, cache=True,
                   num_kv_blocks=small, host_cache_bytes=host, disk_cache_dir=str(disk),
                   disk_cache_bytes=BENCH.disk_cache_bytes, **split),
        run_engine("gpu, small pool, no host tier", model_dir, args, requests, warm, cache=True,
                   num_kv_blocks=small, host_cache_bytes=0, **split),
    ]  # fmt: skip
    say(f"\n== tokens ({args.dtype}), cached runs against caching off")
    for other in results[1:]:
        compare_tokens(results[0], other)
    for r in results:
        r.pop("tokens")
    say.write_json({"device": name, "args": vars(args), "runs": results})


if __name__ == "__main__":
    sys.exit(main())
