"""The `fast` engine: Gemma-3 served with a paged KV cache, continuous batching, CUDA graphs.

Owners, one per concern:
- `engine.FastEngine`: the Engine interface; a step = land -> plan -> run -> postprocess.
- `engine_builder`: the parts built from the config, in the order the device needs.
- `sequence.Sequence`: one request's state; `SeqStatus` and its transitions.
- `step_planner.StepPlanner`: waiting / admitted sequences; FIFO admission by free rows and
  pages; a step's `step_plan.StepPlan` (admissions, vision batch, blocks to copy down, prefill
  and decode batches).
- `step_runner.StepRunner`: takes in what landed on the device and launches a plan.
- `postprocess.Postprocess`: a step's results: sequences prefilled, tokens read back, ends, counters.
- `model_runner.ModelRunner`: the device: weights, cache, tables, streams, prefill, decode;
  `prefill_batch` builds a prefill's inputs (the uncached suffix of each prompt);
  `attention_backends` holds a forward pass's attention metadata.
- `graph_runner.GraphRunner`: CUDA graphs per size bucket (decode batches, short paged prefills).
- `image_stage.ImageStage`: request images -> embeddings (pixel threads, vision cache, tower).
- `device_handles`: handles on asynchronous device work (vision batches, sampled tokens).
- `sampler.Sampler`: greedy / seeded Gumbel-max sampling with top-k / top-p on the device.
- `kv_budget`: how many KV pages fit; `engine_stats`: the engine's counters.
- the KV cache's sequence-facing half: `prefix_admission` (admission with the prefix cache),
  `sequence_tiers.SequenceTiers` (disk reads ahead, restores of admitted sequences), `kv_setup`
  (the cache's parts from the resolved options).
- `prompt_inputs`: chat -> token ids and pixels, identical to the HF processor.
- `model/`: our own Gemma-3 modules and their loading.

The KV cache's storage (pages, prefix cache, tiers) lives in `wicore.engines.kvcache` and imports
nothing from here; the options in `wicore.engines.options`.
"""


def __getattr__(name: str):
    # Lazy: a module of this package (`sequence`, `step_planner`) is imported without the engine's own.
    if name == "FastEngine":
        from wicore.engines.fast.engine import FastEngine

        return FastEngine
    raise AttributeError(name)


__all__ = ["FastEngine"]
