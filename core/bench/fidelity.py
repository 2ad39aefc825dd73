"""`wicore bench fidelity`: do the prefix cache's fast paths give the tokens of caching off?

A VQA flow with repeated images through the fast engine, greedy, in one dtype (bf16 on the GPU),
question-major as in `wicore bench cache` (every image's round 0, then every image's round 1,
...), under three configs: caching off; the GPU tiers (`prefix_split_images`); a small GPU pool
with the pinned CPU tier (follow-ups come back from the host tier). Two flows:

- `democap`, the trained demo captioner on images drawn by its generator: the caption prompt,
  a follow-up, the caption prompt again (served from the cache but for its last token), another
  follow-up. Its caption rounds are scored against the truth each image was drawn from.
- `gemma3-4b`, random weights of the 4B's shape, the cache benchmark's four questions and 32
  forced tokens: logits nearly flat, the hardest case for agreement (no truth to score).

Per config: exact-match accuracy of the caption rounds, sequences whose tokens equal caching
off's (per round), and for each that differs the first differing position with, from a float32
reference forward of Hugging Face's model on the prompt and the tokens both agree on, the logit
margin there (top-1 minus top-2), the two tokens' logits and which one float32 prefers.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from wicore.bench.cache_bench import QUESTIONS, image_request, release
from wicore.bench.caption_bench import device_name
from wicore.engines.base import Completion, EngineConfig, EngineRequest
from wicore.ops.image_decode import decode_image
from wicore.schemas import DEFAULT_PROMPT, GenerationParams

KEEP_STATS = ("prompt_tokens", "cached_prompt_tokens", "images_encoded", "kv_blocks_demoted", "cache")


@dataclass(frozen=True)
class Flow:
    prompts: tuple[str, ...]  # one per round
    new_tokens: int
    ignore_eos: bool
    caption_rounds: tuple[int, ...]  # rounds whose answer is scored against the image's caption
    images: int  # default count
    small_pool_pages: int  # the small GPU pool (democap: ~150 sequences in flight; the 4B: the cache benchmark's)
    host_cache_bytes: int  # the CPU tier beside it


FLOWS = {
    "democap": Flow((DEFAULT_PROMPT, QUESTIONS[1], DEFAULT_PROMPT, QUESTIONS[3]), 16, False, (0, 2), 1000, 2048, 2**30),
    "gemma3-4b": Flow(QUESTIONS, 32, True, (), 256, 16_384, 16 * 2**30),
}


@dataclass
class FidelityBench:
    workdir: Path
    model: str = "democap"  # a key of FLOWS
    images: int | None = None  # default: the flow's
    seed: int = 1000  # of the images (the demo captioner trained on seeds 0-2)
    device: str = "cuda"
    dtype: str = "bfloat16"
    batch_size: int = 384
    small_pool_pages: int | None = None  # default: the flow's
    host_cache_bytes: int | None = None  # default: the flow's
    engine_options: dict = field(default_factory=dict)  # applied to every config
    max_margins: int = 256  # differing sequences per config whose float32 margin is computed

    def __post_init__(self) -> None:
        self.images = self.images or self.flow.images
        self.small_pool_pages = self.small_pool_pages or self.flow.small_pool_pages
        self.host_cache_bytes = self.host_cache_bytes or self.flow.host_cache_bytes

    @property
    def flow(self) -> Flow:
        return FLOWS[self.model]


@dataclass
class Sample:
    request: EngineRequest
    round: int
    truth: str


def run_fidelity_bench(bench: FidelityBench) -> dict:
    model_dir = _model_dir(bench)
    samples = make_samples(bench)
    outputs = {name: run_config(model_dir, bench, cache, options, samples) for name, cache, options in configs(bench)}
    reference = ReferenceLogits(model_dir, bench.device)
    off = outputs["off"][0]
    report = [config_report(name, out, stats, off, samples, bench, reference) for name, (out, stats) in outputs.items()]
    return {
        "gpu": device_name(bench.device),
        "command": "wicore bench fidelity",
        "model": bench.model,
        "dtype": bench.dtype,
        "images": bench.images,
        "prompts": list(bench.flow.prompts),
        "engine_options": bench.engine_options,
        "configs": report,
    }


def configs(bench: FidelityBench) -> list[tuple[str, bool, dict]]:
    """(name, cache, engine options) of the configs, caching off first (the one compared with)."""
    shared = {**bench.engine_options}
    tiers = {**shared, "prefix_split_images": True}
    small = {"num_kv_blocks": bench.small_pool_pages, "host_cache_bytes": bench.host_cache_bytes}
    return [
        ("off", False, shared),
        ("gpu tiers", True, {**tiers, "host_cache_bytes": 0}),
        ("small gpu pool + cpu tier", True, {**tiers, **small}),
    ]


def make_samples(bench: FidelityBench) -> list[Sample]:
    """Question-major: round r of every image, then round r + 1 of every image."""
    from wicore.models.democap import data

    specs = data.sample_specs(bench.images, bench.seed)
    encoded = [data.image_bytes(spec) for spec in specs]
    images = [decode_image(raw) for raw in encoded]  # one decoded image for all its rounds
    flow = bench.flow
    params = GenerationParams(max_new_tokens=flow.new_tokens, ignore_eos=flow.ignore_eos)
    return [
        Sample(image_request(f"{i}-{r}", encoded[i], prompt, params, images[i]), r, specs[i].caption)
        for r, prompt in enumerate(flow.prompts)
        for i in range(len(specs))
    ]


def config_report(name, out, stats, off, samples, bench, reference) -> dict:
    """Accuracy, agreement with caching off and the differing sequences of one config."""
    flow = bench.flow
    same = {r: 0 for r in range(len(flow.prompts))}
    differing = []
    for sample in samples:
        rid = sample.request.id
        if out[rid].token_ids == off[rid].token_ids:
            same[sample.round] += 1
        else:
            differing.append(_difference(sample, off[rid], out[rid]))
    for diff in differing[: bench.max_margins]:
        diff.update(reference.margin(diff["sample"].request, diff["position"], diff["tokens"]))
    for diff in differing:
        del diff["sample"]
    return {
        "name": name,
        "sequences": len(samples),
        "same_tokens": sum(same.values()),
        "same_tokens_by_round": same,
        "exact_match_by_round": {r: _accuracy(out, samples, r) for r in flow.caption_rounds},
        "differing": differing,
        "stats": {k: stats[k] for k in KEEP_STATS if k in stats},
    }


def _difference(sample: Sample, off: Completion, other: Completion) -> dict:
    """Where two outputs first differ (EOS stays in the ids, so one is never a prefix of the other)."""
    pairs = enumerate(zip(off.token_ids, other.token_ids))
    position = next((i for i, (a, b) in pairs if a != b), None)
    if position is None:
        raise RuntimeError(f"{sample.request.id}: {off.token_ids} and {other.token_ids} differ only in length")
    return {
        "sample": sample,
        "id": sample.request.id,
        "round": sample.round,
        "position": position,
        "tokens": off.token_ids[: position + 1] + other.token_ids[position : position + 1],
        "off_text": off.text,
        "text": other.text,
    }


def _accuracy(out: dict[str, Completion], samples: list[Sample], round_: int) -> float:
    scored = [s for s in samples if s.round == round_]
    return sum(out[s.request.id].text == s.truth for s in scored) / max(1, len(scored))


class ReferenceLogits:
    """Hugging Face's model in float32 on the prompt + the tokens two runs agree on (loaded on
    first use: a config whose tokens all agree needs none)."""

    def __init__(self, model_dir: Path, device: str):
        self.model_dir, self.device = model_dir, device
        self.model = self.processor = None

    def margin(self, request: EngineRequest, position: int, tokens: list[int]) -> dict:
        """`tokens`: the common prefix, then caching off's token and the other config's at
        `position`. Float32 logits there: top-1 minus top-2, and the two tokens'."""
        import torch

        logits = self._logits(request, tokens[:position])
        top = torch.topk(logits, 2)
        off_token, other_token = tokens[position], tokens[position + 1]
        return {
            "margin_fp32": float(top.values[0] - top.values[1]),
            "logit_off_fp32": float(logits[off_token]),
            "logit_fp32": float(logits[other_token]),
            "fp32_prefers": "off" if logits[off_token] >= logits[other_token] else "cached",
            "off_token": off_token,
            "token": other_token,
        }

    def _logits(self, request: EngineRequest, generated: list[int]):
        import torch

        self._load()
        text = self.processor.apply_chat_template(request.chat, add_generation_prompt=True)
        inputs = self.processor(text=[text], images=[request.images], return_tensors="pt", add_special_tokens=False)
        inputs = _extend(inputs, generated)
        with torch.inference_mode():
            return self.model(**inputs.to(self.device)).logits[0, -1].float().cpu()

    def _load(self) -> None:
        if self.model is None:
            from wicore.engines.checkpoint import load_hf_model, load_processor

            self.processor = load_processor(self.model_dir)
            self.model = load_hf_model(self.model_dir, self.device, "float32")


def _extend(inputs, generated: list[int]):
    """The processor's [1, L] tensors followed by the generated tokens (text: type 0, attended)."""
    import torch

    if not generated:
        return inputs
    length = inputs["input_ids"].shape[1]
    tail = torch.tensor([generated], dtype=torch.long)
    for key, value in list(inputs.items()):
        if value.dim() == 2 and value.shape[1] == length:
            fill = tail if key == "input_ids" else torch.full_like(tail, 1 if key == "attention_mask" else 0)
            inputs[key] = torch.cat([value, fill.to(value.dtype)], dim=1)
    return inputs


def run_config(model_dir: Path, bench: FidelityBench, cache: bool, options: dict, samples: list[Sample]):
    """({id: Completion}, engine stats) of one config's engine on every sample, in order."""
    from wicore.engines.fast import FastEngine
    from wicore.engines.options import FastOptions

    config = EngineConfig(
        str(model_dir), device=bench.device, dtype=bench.dtype, max_batch_size=bench.batch_size, cache=cache,
        options=FastOptions.parse(options),
    )  # fmt: skip
    engine = FastEngine(config)
    try:
        out = engine.generate([s.request for s in samples])
        stats = engine.stats()
    finally:
        release(engine)
    failures = [c.error for c in out if not c.ok]
    if failures:
        raise RuntimeError(f"{len(failures)} requests failed, e.g. {failures[0]}")
    return {c.id: c for c in out}, stats


def _model_dir(bench: FidelityBench) -> Path:
    if bench.model == "democap":
        from wicore.models import DEMOCAP_DIR

        return DEMOCAP_DIR
    from wicore.models.gemma3 import make_gemma3_4b

    return make_gemma3_4b(bench.workdir / "gemma3-4b")


def write_fidelity_report(report: dict, folder: Path, tag: str = "") -> Path:
    """fidelity-<model>-<gpu>[-<tag>].json"""
    from wicore.bench.report import gpu_slug

    folder.mkdir(parents=True, exist_ok=True)
    name = f"fidelity-{report['model']}-{gpu_slug(report['gpu'])}{f'-{tag}' if tag else ''}.json"
    path = folder / name
    path.write_text(json.dumps(report, indent=2) + "\n")
    return path


def summary(report: dict) -> list[str]:
    """One line per config: accuracy, agreement, the differing sequences' margins."""
    lines = []
    for config in report["configs"]:
        margins = sorted(d["margin_fp32"] for d in config["differing"] if "margin_fp32" in d)
        accuracy = ", ".join(f"round {r}: {a:.3f}" for r, a in config["exact_match_by_round"].items())
        line = f"{config['name']}: same tokens as off {config['same_tokens']}/{config['sequences']}"
        line += f"; exact match {accuracy}" if accuracy else ""
        if margins:
            line += f"; fp32 margins where they differ: median {margins[len(margins) // 2]:.3g}, max {margins[-1]:.3g}"
        lines.append(line)
    return lines
