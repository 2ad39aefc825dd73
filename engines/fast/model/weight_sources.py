"""Where the fast engine's weights come from, one tensor at a time, written into buffers the
loader allocated: a checkpoint's safetensors shards (read through `safe_open` slices, in row
blocks, so no whole-tensor copy is made beside the destination) or seeded random weights for
config-only directories (`seeded_weights`, drawn on the destination's device).

Both answer `names()` (our parameter names, `weight_names.our_name`), `shape(name)` and
`copy_into(name, dst)`.
"""

from __future__ import annotations

from contextlib import ExitStack
from pathlib import Path
from typing import Protocol

import torch

from wicore.engines.checkpoint import config_seed, has_weights
from wicore.engines.seeded_weights import fill_seeded
from wicore.engines.weight_names import our_name
from wicore.errors import ConfigError

BLOCK_BYTES = 64 * 2**20  # read per slice of a checkpoint tensor


class WeightSource(Protocol):
    def names(self) -> set[str]: ...

    def copy_into(self, name: str, dst: torch.Tensor) -> None:
        """Write weight `name` into `dst` (its shape; any dtype and device)."""
        ...

    def close(self) -> None: ...


class CheckpointTensors:
    """The tensors of every `*.safetensors` shard in `path`, by our names (the tied lm_head
    left out). Shards stay open (memory-mapped) until `close`."""

    def __init__(self, path: Path):
        from safetensors import safe_open

        self._files = ExitStack()
        self._where: dict[str, tuple[object, str]] = {}
        for file in sorted(path.glob("*.safetensors")):
            reader = self._files.enter_context(safe_open(file, framework="pt", device="cpu"))
            for key in reader.keys():  # noqa: SIM118 (safe_open is not a dict)
                ours = our_name(key)
                if ours is not None:
                    self._where[ours] = (reader, key)

    def names(self) -> set[str]:
        return set(self._where)

    def copy_into(self, name: str, dst: torch.Tensor) -> None:
        reader, key = self._where[name]
        tensor = reader.get_slice(key)  # type: ignore[attr-defined]
        if list(tensor.get_shape()) != list(dst.shape):
            raise ConfigError(
                f"checkpoint weight {key!r} has shape {tensor.get_shape()}, the config asks {list(dst.shape)}"
            )
        if dst.dim() == 0:
            dst.copy_(reader.get_tensor(key))  # type: ignore[attr-defined]
            return
        row_bytes = max(1, dst[0].numel() * dst.element_size())
        step = max(1, BLOCK_BYTES // row_bytes)
        for start in range(0, dst.shape[0], step):
            dst[start : start + step].copy_(tensor[start : start + step])

    def close(self) -> None:
        self._files.close()


class SeededTensors:
    """Seeded random weights for the names the model expects (`seeded_weights`)."""

    def __init__(self, expected: set[str], seed: int, config):
        self._expected, self._seed, self._config = expected, seed, config

    def names(self) -> set[str]:
        return set(self._expected)

    def copy_into(self, name: str, dst: torch.Tensor) -> None:
        fill_seeded(dst, name, self._seed, self._config)

    def close(self) -> None:
        pass


def open_source(path: Path, config, expected: set[str], seed: int) -> WeightSource:
    """The checkpoint's safetensors, or seeded weights for a config-only directory."""
    if has_weights(path):
        return CheckpointTensors(path)
    return SeededTensors(expected, config_seed(path, seed), config)
