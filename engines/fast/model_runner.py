"""The owner of the device: weights, KV cache, block tables, streams, graphs; runs the vision
tower, packed prefills and decode steps, and samples.

Device-resident state, indexed by a sequence's table row (rows 0..max_rows-1, plus a null row
for padding): `tables` [groups, rows + 1, width] int32 (uploaded once, at admission) and
`last_token` [rows + 1] int64, the token each sequence feeds next. Sampling writes
`last_token` on the device, so a decode step needs only rows and positions from the host and
never waits for the previous step's tokens to reach Python; those are read back one step late.

Streams (CUDA): vision (uint8 image upload from pinned memory + pixel lookup table + tower +
projector) runs on a side stream and records an event; the prefill that consumes its embeddings
waits on that event on the main (high-priority) stream, where prefill, decode, sampling and
readbacks run. Decode steps replay CUDA graphs per batch bucket, and full vision batches on the
side stream one graph of the (compiled) tower, captured at load: launched from Python, the FP8
tower (its kernels, custom ops and their allocations) holds the launching thread about as long
as the device takes to run it. Short prefill
suffixes (a follow-up question over a cached image, the tail of an image the cached prefix
splits, a short prompt) attend over their pages alone and replay CUDA graphs per token-count
bucket: launched eagerly, they cost more host time than device time. So does a dense prefill of
a few thousand tokens (in FP8 its launches take longer on the host than its kernels on the
device): one of at most `DENSE_GRAPH_TOKENS` replays a graph of its exact shape once that shape
repeats, as it does in bulk work (one prompt, one image size).
"""

from __future__ import annotations

from contextlib import nullcontext

import numpy as np
import torch

from wicore.engines import guided
from wicore.engines.fast.attention_backends import PagedAttention, PrefillAttention, layer_specs
from wicore.engines.fast.device_handles import PhaseClock, Readback
from wicore.engines.fast.graph_runner import GraphRunner, ShapeGraphs
from wicore.engines.fast.model.weights import Gemma3Parts
from wicore.engines.fast.penalties import TokenHistory
from wicore.engines.fast.prefill_batch import (
    ENDS,
    IDS,
    POSITIONS,
    ROWS,
    SLOTS,
    TILE_COUNT,
    TILE_FIRST,
    paged_columns,
    paged_fills,
    pages_only,
    prefill_inputs,
    suffix_image_embeds,
)
from wicore.engines.fast.sampler import Sampler, SamplingBatch
from wicore.engines.fast.sequence import Sequence
from wicore.engines.kvcache.kv_layout import KVCache, KVLayout
from wicore.engines.options import CUBLAS_AUTOTUNE
from wicore.ops.attention import PackedBatch, gemma3_prefill_masks, group_batch
from wicore.ops.attention.prefix_prefill import gemma3_prefix_masks, group_prefix
from wicore.ops.image_preprocess import apply_lut
from wicore.ops.transfer import upload

# Dense prefills of at most this many tokens may replay a graph: beyond it the device's work
# outlasts the launch's host time anyway, and each graph's activations stay allocated.
DENSE_GRAPH_TOKENS = 4096


class ModelRunner:
    def __init__(
        self,
        parts: Gemma3Parts,
        layout: KVLayout,
        max_rows: int,
        sampler: Sampler,
        device,
        dtype,
        overlap: bool = True,
        pixel_lut: np.ndarray | None = None,
        paged_suffix: int = 0,
        kv_dtype: torch.dtype | None = None,
    ):
        """pixel_lut: [3, 256] float32, `InputProcessor.pixel_spec.lut`; images need it.
        paged_suffix: prefills of at most this many new tokens attend over their pages alone.
        kv_dtype: the KV cache's element type (default `dtype`; `ops.attention.KV_FP8`)."""
        self.parts, self.layout, self.sampler = parts, layout, sampler
        self.guided = guided.GuidedHost(device)  # constrained rows' token masks (engines/guided.py)
        self.device, self.dtype = torch.device(device), dtype
        self.kv_dtype = dtype if kv_dtype is None else kv_dtype
        # Cast once: looking up the cast table gives the same bits as casting looked-up float32.
        self.pixel_lut = None if pixel_lut is None else torch.from_numpy(pixel_lut).to(self.device, dtype)
        self.cuda = self.device.type == "cuda"
        self.text_config = parts.text_config
        self.null_row = max_rows
        self.tables = torch.zeros(
            (len(layout.groups), max_rows + 1, layout.table_width), dtype=torch.int32, device=device
        )
        self.last_token = torch.zeros(max_rows + 1, dtype=torch.int64, device=device)
        width = layout.table_width * layout.block_size
        self.history = TokenHistory(max_rows, width, self.text_config.vocab_size, self.device)  # penalized rows
        # Prefill/decode get a high-priority stream so their small kernels slot in between the
        # vision tower's long GEMMs on the (normal-priority) side stream.
        self.main_stream = torch.cuda.Stream(self.device, priority=-1) if self.cuda else None
        # overlap=False runs vision on the main stream too: no concurrency, no interference.
        self.side_stream = torch.cuda.Stream(self.device) if self.cuda and overlap else self.main_stream
        self.clock = PhaseClock(self.cuda)
        self.encode_full = None  # optional compiled tower for full vision batches
        self.decode_graphs: GraphRunner | None = None
        self.prefill_graphs: GraphRunner | None = None
        self.dense_graphs: ShapeGraphs | None = None
        self.vision_graphs: ShapeGraphs | None = None  # the full vision batch (`capture_vision`)
        # Paged prefill: tokens per attention tile, so a tile's query heads fill 16 rows.
        self.paged_suffix = paged_suffix
        self.paged_prefilled = 0  # sequences prefilled over their pages alone
        self.tile_tokens = max(1, 16 // (self.text_config.num_attention_heads // self.text_config.num_key_value_heads))
        self.cache: KVCache | None = None
        self.specs = []

    # -- setup ------------------------------------------------------------------------------

    def allocate_cache(self, num_pages: int) -> None:
        self.cache = None  # free a previous (profiling) cache first
        c = self.text_config
        self.cache = KVCache(self.layout, num_pages, c.num_key_value_heads, c.head_dim, self.kv_dtype, self.device)
        self.specs = layer_specs(c, self.cache)

    def compile_vision(self, batch: int, mode: str = "default") -> None:
        """Inductor for full vision batches (fuses the tower's norms, GELUs and residual adds;
        faster than eager, for seconds of compiling at start-up). `mode`: torch.compile's
        ("max-autotune-no-cudagraphs" also benchmarks Triton templates for every GEMM: minutes
        more at start-up), or CUBLAS_AUTOTUNE (FastOptions.vision_compile_mode says what)."""
        import torch._inductor.config as inductor

        if hasattr(inductor, "emulate_precision_casts"):
            inductor.emulate_precision_casts = True
        if mode == CUBLAS_AUTOTUNE:
            options = {"max_autotune": True, "coordinate_descent_tuning": True, "max_autotune_gemm_backends": "ATEN"}
            compiled = torch.compile(self.parts.encoder, dynamic=False, options=options)
        else:
            compiled = torch.compile(self.parts.encoder, dynamic=False, mode=mode)
        self.encode_full = (batch, compiled)

    @torch.inference_mode()
    def capture_vision(self, batch: int) -> bool:
        """One CUDA graph of the tower (compiled, after `compile_vision`) for `batch` resized
        images, the pixel lookup table included, after one call that compiles and tunes it.
        Before the KV budget: the graph's memory pool stays taken. False: the capture failed."""
        size = self.parts.config.vision_config.image_size
        images = {"images": torch.zeros((batch, size, size, 3), dtype=torch.uint8, device=self.device)}
        forward = lambda inputs: self.encode(self.pixel_values(inputs["images"]))  # noqa: E731
        forward(images)
        torch.cuda.synchronize(self.device)
        self.vision_graphs = ShapeGraphs(forward, limit=1, own_stream=True)  # it replays beside the decoder's graphs
        return self.vision_graphs.capture(images)

    def compile_text(self) -> None:
        self.parts.decoder.fns.compile()

    def release(self) -> None:
        """Drop the KV cache, the graphs (and their memory pool) and the weights."""
        self.cache = None
        self.decode_graphs = self.prefill_graphs = self.dense_graphs = self.vision_graphs = None
        self.encode_full = None
        self.tables = None
        self.parts = None

    def capture_graphs(self, decode_sizes: list[int], prefill_sizes: list[int], dense_shapes: int = 0) -> None:
        """Decode graphs per batch bucket and paged-prefill graphs per token bucket, in one
        memory pool (the prefill's largest first: it needs the most); up to `dense_shapes` dense
        prefill graphs later, as their shapes repeat, in a pool of their own (a step replays a
        dense graph, then a paged one, and reads both outputs)."""
        pool = None
        if prefill_sizes and self.paged_suffix:
            fills = paged_fills(self.null_row, len(self.layout.groups))
            embeds = (self.text_config.hidden_size, self.dtype)
            self.prefill_graphs = GraphRunner(
                self.paged_prefill_hidden, prefill_sizes, fills, self.device, None, embeds
            )
            pool = self.prefill_graphs.pool
        self.decode_graphs = GraphRunner(
            lambda columns, _: self.decode_logits(columns[0], columns[1]),
            decode_sizes,
            [self.null_row, 0],
            self.device,
            pool,
        )
        if dense_shapes:
            self.dense_graphs = ShapeGraphs(self._dense_graph_forward, dense_shapes)

    def on_main_stream(self):
        """Context for everything a step runs outside the vision tower."""
        return torch.cuda.stream(self.main_stream) if self.main_stream is not None else nullcontext()

    def set_table(self, row: int, table: np.ndarray) -> None:
        self.tables[:, row].copy_(upload(table, self.device))

    # -- vision (side stream) ---------------------------------------------------------------

    def vision_stream(self, urgent: bool = False):
        """Where a vision batch runs: the side stream; an urgent one (a leading lane's images,
        `StepPlanner`) on the main stream, so it does not queue behind the side stream's batches."""
        return self.main_stream if urgent else self.side_stream

    def encode_images(
        self, images: list[np.ndarray], urgent: bool = False
    ) -> tuple[torch.Tensor, torch.cuda.Event | None]:
        """N resized images uint8 [S, S, 3] -> embeddings [N, tokens, hidden] on the vision
        stream (`vision_stream`), and the event recorded after them (None on CPU). The upload,
        the lookup table and the tower all run on that stream, in order."""
        staged = self._stage(images)
        stream = self.vision_stream(urgent)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            mark = self.clock.start(stream)
            resized = staged.to(self.device, non_blocking=True)
            # An urgent batch on the main stream may run beside the side stream's replay: eager.
            replayed = None if urgent or self.vision_graphs is None else self.vision_graphs.run({"images": resized})
            # a replay's output is the graph's own, which the next replay (queued behind it) overwrites
            embeds = replayed.clone() if replayed is not None else self.encode(self.pixel_values(resized))
            self.clock.stop("vision", mark, stream)
            event = None
            if stream is not None:
                event = torch.cuda.Event()
                event.record(stream)
        return embeds, event

    def take(self, embeds: torch.Tensor, rows: list[int], urgent: bool = False) -> torch.Tensor:
        """The given output rows [len(rows), tokens, hidden], selected on the stream that made
        them (a view when they are consecutive)."""
        if rows == list(range(rows[0], rows[0] + len(rows))):
            return embeds[rows[0] : rows[0] + len(rows)]
        stream = self.vision_stream(urgent)
        with torch.cuda.stream(stream) if stream is not None else nullcontext():
            return embeds[_tensor(rows, embeds.device)]  # through pinned memory: no wait for the tower

    def _stage(self, images: list[np.ndarray]) -> torch.Tensor:
        """One host copy into (pinned) memory uint8 [N, S, S, 3]; the host allocator keeps the
        buffer alive until the asynchronous upload has read it."""
        staging = torch.empty((len(images), *images[0].shape), dtype=torch.uint8, pin_memory=self.cuda)
        for row, image in zip(staging, images, strict=True):
            row.copy_(torch.from_numpy(image))
        return staging

    def pixel_values(self, resized: torch.Tensor) -> torch.Tensor:
        """uint8 [N, S, S, 3] on the device -> [N, 3, S, S] in the model's dtype: the HF
        processor's float32 pixel values, cast."""
        return apply_lut(resized, self.pixel_lut)

    @torch.inference_mode()
    def encode(self, pixels: torch.Tensor) -> torch.Tensor:
        """[N, 3, S, S] -> [N, tokens, hidden]: full batches through the compiled tower, short
        ones eager (padding them would spend compute on nothing when inputs arrive slowly)."""
        if self.encode_full is not None and pixels.shape[0] == self.encode_full[0]:
            return self.encode_full[1](pixels)
        return self.parts.encoder(pixels)

    # -- prefill ----------------------------------------------------------------------------

    @torch.inference_mode()
    def prefill(self, seqs: list[Sequence]) -> Readback:
        """One launch for the prompts that attend over their pages alone (short suffixes), one
        for the others (the dense prefill); one readback for both."""
        mark = self.clock.start()
        paged, dense = [], []
        for seq in seqs:
            (paged if pages_only(seq, self.layout, self.paged_suffix) else dense).append(seq)
        logits = []
        if dense:
            logits.append(self._dense_prefill(dense))
        if paged:
            logits.append(self._paged_prefill(paged))
        readback = self._sample(dense + paged, torch.cat(logits) if len(logits) > 1 else logits[0], [0] * len(seqs))
        self.clock.stop("prefill", mark)
        return readback

    def _dense_prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        inputs = prefill_inputs(
            seqs, self.layout, self.parts.tokens_per_image, self.text_config.vocab_size, self.device
        )
        embeds = self._image_embeds(seqs)
        if embeds is not None:
            inputs["image_embeds"] = embeds
        if self.dense_graphs is not None and "prefix" not in inputs and len(inputs["ids"]) <= DENSE_GRAPH_TOKENS:
            logits = self.dense_graphs.run(self._dense_graph_inputs(inputs))
            if logits is not None:
                return logits
        return self.prefill_logits(**inputs)

    @staticmethod
    def _dense_graph_inputs(inputs: dict) -> dict[str, torch.Tensor]:
        """`prefill_logits`' inputs as a graph takes them: tensors only, the layout's own spread out."""
        layout = inputs["layout"]
        tensors = {name: value for name, value in inputs.items() if name != "layout"}
        return tensors | {"gather": layout.gather, "scatter": layout.scatter, "valid": layout.valid}

    def _dense_graph_forward(self, t: dict[str, torch.Tensor]) -> torch.Tensor:
        """`prefill_logits` over `_dense_graph_inputs`' tensors; the padded layout's
        longest prompt is its width (the masks need no other length)."""
        layout = PackedBatch([t["gather"].shape[1]], t["gather"], t["scatter"], t["valid"])
        keys = ("ids", "positions", "slots", "image_rows", "image_groups", "last")
        return self.prefill_logits(*(t[k] for k in keys), layout, image_embeds=t.get("image_embeds"))

    def _paged_prefill(self, seqs: list[Sequence]) -> torch.Tensor:
        """Logits [B, vocab] of short suffixes: a graph replay when a bucket fits them."""
        self.paged_prefilled += len(seqs)
        c = self.text_config
        columns, last, image_rows = paged_columns(
            seqs, self.layout, self.tile_tokens, c.vocab_size, self.parts.tokens_per_image
        )
        graphs = self.prefill_graphs
        if graphs is not None and not graphs.fits(columns.shape[1]):
            graphs = None  # more tokens than the largest bucket: the same forward, eager
        columns = upload(graphs.pad(columns) if graphs is not None else columns, self.device)
        x = self.parts.decoder.embed(columns[IDS])
        embeds = self._image_embeds(seqs)
        if embeds is not None:
            x = x.index_copy(0, upload(image_rows, self.device), embeds.to(x.dtype))
        hidden = graphs.replay(columns, x) if graphs is not None else self.paged_prefill_hidden(columns, x)
        return self.parts.decoder.logits(hidden[upload(last, self.device)])

    def _image_embeds(self, seqs: list[Sequence]) -> torch.Tensor | None:
        """The suffixes' image embeddings [image tokens, hidden] (`suffix_image_embeds` order),
        made on the vision stream: this stream waits for them and the sequences let go."""
        for event in {id(s.vision.event): s.vision.event for s in seqs if s.vision.event is not None}.values():
            torch.cuda.current_stream().wait_event(event)  # normally complete already
        embeds = suffix_image_embeds(seqs)  # images whose tokens are cached need none
        if self.cuda:
            for s in seqs:  # made on the side stream, read here on the main one
                if s.images_in_suffix:
                    s.vision.embeds.record_stream(torch.cuda.current_stream())
        for seq in seqs:
            seq.vision.embeds, seq.vision.event = None, None
        return torch.cat(embeds) if embeds else None

    def paged_prefill_hidden(self, columns: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """columns [SLOTS + groups, N] int64 on the device (`prefill_batch.paged_columns`), x
        [N, hidden] input embeddings -> final-normed hidden states [N, hidden]. Graph-capturable."""
        positions = columns[POSITIONS]
        tiles = (columns[TILE_FIRST], columns[TILE_COUNT], self.tile_tokens)
        attention = PagedAttention(
            self.cache, self.specs, self.tables, columns[ROWS], positions, columns[SLOTS:], tiles, columns[ENDS]
        )
        return self.parts.decoder(x, positions, attention)

    def prefill_logits(
        self, ids, positions, slots, image_rows, image_groups, last, layout, image_embeds=None, prefix=None
    ):
        """Packed prompts (their uncached suffixes) -> logits [B, vocab] at each prompt's last
        token. ids, positions, image_rows, last: int64 [N] / [I] / [B]; slots [groups, N];
        image_groups [B, L] (absolute positions); prefix: `PrefixInputs` when some prompts
        start with cached positions."""
        decoder = self.parts.decoder
        x = decoder.embed(ids)
        if image_embeds is not None:
            x = x.index_copy(0, image_rows, image_embeds.to(x.dtype))
        c = self.text_config
        heads = (c.num_attention_heads, c.num_key_value_heads, x.dtype)
        if prefix is None:
            masks = gemma3_prefill_masks(layout, image_groups, c.sliding_window)
            grouped = group_batch(layout, layout.gather, masks, *heads)
        else:
            masks = gemma3_prefix_masks(prefix.batch, image_groups, c.sliding_window)
            grouped = group_prefix(prefix.batch, masks, *heads)
        attention = PrefillAttention(self.cache, self.specs, grouped, slots, None if prefix is None else prefix.slots)
        hidden = decoder(x, positions, attention)
        return decoder.logits(hidden[last])

    # -- decode -----------------------------------------------------------------------------

    @torch.inference_mode()
    def decode(self, seqs: list[Sequence]) -> tuple[Readback, bool]:
        """One token for each sequence; returns the readback and whether a graph ran."""
        mark = self.clock.start()
        rows = [s.kv.row for s in seqs]
        positions = [s.next_position for s in seqs]
        graphed = self.decode_graphs is not None and self.decode_graphs.fits(len(seqs))
        if graphed:
            columns = self.decode_graphs.pad(np.array([rows, positions], dtype=np.int64))
            logits = self.decode_graphs.replay(upload(columns, self.device))[: len(seqs)]
        else:
            logits = self.decode_logits(_tensor(rows, self.device), _tensor(positions, self.device))
        readback = self._sample(seqs, logits, [s.tokens.launched for s in seqs])
        self.clock.stop("decode", mark)
        return readback, graphed

    def decode_logits(self, rows: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """rows, positions: [B] int64 on the device -> logits [B, vocab]. Graph-capturable."""
        decoder = self.parts.decoder
        x = decoder.embed(self.last_token[rows])
        attention = PagedAttention(self.cache, self.specs, self.tables, rows, positions)
        return decoder.logits(decoder(x, positions, attention))

    # -- sampling ---------------------------------------------------------------------------

    def _sample(self, seqs: list[Sequence], logits: torch.Tensor, indices: list[int]) -> Readback:
        """The grammars' masks are filled here, after the forward's launch: on CUDA the host
        reads the last step's tokens and fills them while the device runs the forward."""
        grammars = [s.grammar for s in seqs]
        logits = self.guided.mask(logits, grammars)
        params = [s.request.params for s in seqs]
        penalties = self.history.penalties(seqs, indices)
        asking = [i for i, s in enumerate(seqs) if s.top_logprobs is not None]
        most = max((seqs[i].top_logprobs or 0 for i in asking), default=None)
        batch = SamplingBatch.build(params, [s.seed for s in seqs], indices, self.device, penalties, most, asking)
        tokens, scores = self.sampler.sample(logits, batch)
        self.last_token.index_copy_(0, _tensor([s.kv.row for s in seqs], self.device), tokens)
        if penalties is not None:
            self.history.record(penalties, tokens)
        for seq in seqs:
            seq.tokens.launched += 1
        readback = Readback.start(seqs, tokens, scores)
        guided.track(grammars, readback.tokens)
        return readback


def _tensor(values: list[int], device) -> torch.Tensor:
    return upload(values, device, torch.int64)
