"""Which `wicore worker` processes a run starts: one per GPU (`--gpus all|0,1,...`, each pinned
to its device) or N alike (`--workers N`, on CPU). Each has its own name, its own engine and its
own caches (a disk tier is a folder one process owns, so each worker gets a folder of its own).
Nothing here imports torch: the GPUs are counted by a short subprocess."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from dataclasses import dataclass, replace
from pathlib import Path

from wicore.config import Settings
from wicore.defaults import gpu_decode_processes
from wicore.errors import ConfigError

COUNT_TIMEOUT_S = 120.0  # a first `import torch` on a cold disk is slow


@dataclass(frozen=True)
class WorkerSpec:
    """One worker process: its name, its slot on this host (gpu0, 0, ...), the flags it takes on
    top of the run's settings, and the environment it takes on top of the run's."""

    name: str
    slot: str
    args: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()


def parse_gpus(text: str, device_count: int) -> list[int]:
    """'all' -> every visible device; '0,2' -> [0, 2]. Anything else, a GPU named twice or one
    that is not here is a ConfigError saying what to give instead."""
    where = f"--gpus {text}"
    indices = None if text.strip().lower() == "all" else [_gpu_index(t.strip(), where) for t in text.split(",")]
    twice = sorted({i for i in indices or [] if indices.count(i) > 1})
    if twice:
        raise ConfigError(f"{where}: GPU {twice[0]} is named twice; name each GPU once")
    if device_count < 1:
        raise ConfigError(f"{where}: no CUDA device here; on CPU use --workers N")
    missing = [i for i in indices or [] if i >= device_count]
    if missing:
        raise ConfigError(f"{where}: no GPU {missing[0]} here ({device_count} visible: 0 to {device_count - 1})")
    return list(range(device_count)) if indices is None else indices


def _gpu_index(token: str, where: str) -> int:
    if not token.isdigit() or not token.isascii():
        raise ConfigError(f"{where}: {token!r} is not a GPU index; give all, or indices such as 0,1")
    return int(token)


def cuda_device_count() -> int:
    """The CUDA devices a child of this process sees (CUDA_VISIBLE_DEVICES applied), as torch
    counts them in a subprocess: this process neither imports torch nor touches CUDA. 0 where
    torch is missing or finds no device."""
    code = "import torch; print(torch.cuda.device_count() if torch.cuda.is_available() else 0)"
    try:
        done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=COUNT_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        return 0
    lines = done.stdout.split()
    return int(lines[-1]) if done.returncode == 0 and lines and lines[-1].isdigit() else 0


def visible_device(index: int, parent: str | None) -> str:
    """The CUDA_VISIBLE_DEVICES that shows a child this process's device `index` alone (as its
    cuda:0): the index, or the parent's own entry for it where the parent's list narrowed the
    devices (entries may be indices or UUIDs)."""
    entries = [entry.strip() for entry in (parent or "").split(",") if entry.strip()]
    return entries[index] if index < len(entries) else str(index)


def gpu_specs(
    base: str, gpus: list[int], parent_visible: str | None, decode_processes: int | None = None
) -> list[WorkerSpec]:
    """One worker per GPU, named BASE-gpuI, that sees GPU I alone, as its cuda:0; with
    `decode_processes`, that many image decode processes each."""
    decode = () if decode_processes is None else ("--decode-processes", str(decode_processes))
    return [gpu_spec(base, i, visible_device(i, parent_visible), decode) for i in gpus]


def gpu_spec(base: str, index: int, visible: str, extra: tuple[str, ...] = ()) -> WorkerSpec:
    env = (("CUDA_VISIBLE_DEVICES", visible),)
    return WorkerSpec(f"{base}-gpu{index}", f"gpu{index}", ("--device", "cuda", *extra), env)


def cpu_specs(base: str, count: int) -> list[WorkerSpec]:
    return [WorkerSpec(f"{base}-{i}", str(i)) for i in range(count)]


def plan_workers(base: str, settings: Settings, *, gpus: str | None, workers: int | None) -> list[WorkerSpec]:
    """The processes `--gpus` or `--workers` asks for (one of them), each with its own caches."""
    if gpus is not None and workers is not None:
        raise ConfigError("--gpus and --workers exclude each other: --gpus for one worker per GPU, --workers N on CPU")
    if gpus is None:
        return over_shards(own_caches(cpu_specs(base, workers or 1), settings), len(settings.redis_urls))
    if settings.device not in ("auto", "cuda"):
        raise ConfigError(f"--gpus pins each worker to its GPU; leave out --device {settings.device}")
    chosen = parse_gpus(gpus, cuda_device_count())
    # the workers share the host's cores: each decodes images in its share unless told
    share = gpu_decode_processes(os.cpu_count() or 2, len(chosen)) if settings.decode_processes is None else None
    specs = own_caches(gpu_specs(base, chosen, os.environ.get("CUDA_VISIBLE_DEVICES"), share), settings)
    return over_shards(specs, len(settings.redis_urls))


def over_shards(specs: list[WorkerSpec], shards: int) -> list[WorkerSpec]:
    """Each worker serves one shard of a sharded Redis, in turn (worker i: shard i mod shards),
    named by its index in the list (`--redis-shard`), so no URL shows in `ps`."""
    if shards < 2:
        return specs
    if len(specs) < shards:
        raise ConfigError(
            f"{len(specs)} worker processes for {shards} Redis shards: each shard needs one; "
            f"start at least {shards} (--workers {shards}, or --gpus with as many GPUs)"
        )
    return [replace(spec, args=(*spec.args, "--redis-shard", str(i % shards))) for i, spec in enumerate(specs)]


def own_caches(specs: list[WorkerSpec], settings: Settings) -> list[WorkerSpec]:
    """A disk tier folder per worker (`<disk_cache_dir>/<slot>`): stable across restarts, so a
    worker finds its own blocks again, and never shared (one process owns a folder)."""
    folder = settings.engine.disk_cache_dir
    if folder is None:
        return specs
    return [replace(spec, args=(*spec.args, "--engine-option", _disk_option(folder, spec))) for spec in specs]


def _disk_option(folder: str, spec: WorkerSpec) -> str:
    return f"disk_cache_dir={json.dumps(str(Path(folder) / spec.slot))}"
