"""The local sampler's decoding engine: continuous batching over a KV cache, prefix caching, per-row RNG.

Why not ``model.generate``: we need (a) the model's *raw* logprob of every chosen token (temperature,
top-k and top-p only shape the choice), (b) one ``torch.Generator`` per sequence so that a seeded request
gives the same tokens whatever else shares its batch, (c) stop strings checked on the decoded tail of the
completion, with the stop tokens kept in the output, and (d) per-row temperature / top-p / top-k.

Each step draws exactly one uniform number per sequence from its generator and picks a token by
inverse-CDF over the filtered distribution, so the random stream never depends on the batch shape.

Continuous batching (``ContinuousGenerator``): requests go into an inbox; one job on the owner's worker
thread decodes every sequence in flight one token per step, admits waiting requests at step boundaries
(up to ``batch_limit`` sequences) and returns a finished sequence at once, so no sequence waits for its
batch's longest; finished rows leave the KV cache, and waiting ones join it, a few at a time
(``COMPACT_DEAD_SHARE``, ``ADMIT_FREE_SHARE``). The KV cache is one left-padded tensor per layer,
``[rows, heads, columns, dim]``; rows of different lengths are aligned on the right and the attention mask hides the holes, position ids
are explicit per row. When a training call is queued on the same worker, the job stops admitting, lets
the sequences in flight finish and queues itself behind the training call.

Prefill: a new sequence prefills only what no cache holds. Sources, longest first: the prefix cache
(``retool.backends.engine.prefix_cache``; the previous turn of the same trajectory, a group sibling finished
earlier, a system prompt seen before), then the common prefix of the sequences admitted together (run
once, and stored). Identical prompts admitted together (a group) are prefilled once and their KV
repeated. When a sequence finishes, the KV of its prompt and completion goes into the prefix cache.

Adapters (``GenRequest.adapter``): an engine over one base model shared by several LoRA adapters
(``retool.backends.samplers.multi_lora``) decodes the rows of every adapter in one batch. Each row names its
adapter (``None``: the plain base); before every forward the engine hands ``select_adapters`` the adapter
of each row, in batch order. Rows of different adapters are never deduplicated or prefix-shared, and the
prefix cache keeps their KV apart (its ``space``).

Numerics: a token's logits depend on how its KV was computed (one long prefill, prefix + suffix, batch
composition) only through float rounding, so cache on and off give the same tokens (barring a uniform
draw within ~1e-6 of a CDF boundary) and logprobs equal to ~1e-5; not bitwise, because matmuls of
different shapes sum in different orders.

Long because the continuous-batching loop, its per-row state (``_Row``, ``_Batch``, ``_Prefill``) and the
KV-cache layout it decodes over (``_GrowingLayer``) are written for one another: each says little read
apart from the loop.
"""

from __future__ import annotations

import collections
import concurrent.futures
import inspect
import logging
import threading
import time
from collections.abc import Callable, Hashable, Sequence
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any, Protocol

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from retool.backends.engine.decode_step import DecodeStep, lean_decoder
from retool.backends.engine.prefix_cache import KV, PrefixCache
from retool.backends.interface.types import Sample, SamplingParams, StopReason

logger = logging.getLogger(__name__)

# Below this many shared tokens, prefilling the prefix once does not pay for the extra forward pass.
MIN_SHARED_PREFIX = 16
# Padded area of one prefill forward relative to its real tokens before it is split by suffix length.
PREFILL_PADDING_SLACK = 1.25
MAX_PREFILL_TOKENS = 16384  # padded tokens of one prefill forward (bounds its activation memory)
# Columns a decode batch's KV buffers hold beyond its current length: one copy of the cache per this many
# decode steps instead of one per step (memory: ~15% over a 400-token context).
KV_SPARE_COLUMNS = 64
# A finished row's result goes out at once, but its KV row leaves the batch later, with others: taking rows
# out of the batch (or adding some) copies the whole cache, and the next decode step copies it again into a
# buffer with spare columns. In an evaluation rows finish and come back after a tool call every few steps,
# and those copies took nearly half its time (bench/engine_churn.py). A dead row is decoded on, its output
# never read, until this share of the batch is dead; waiting rows join a batch that has live rows once this
# share of its slots is free.
COMPACT_DEAD_SHARE = 1 / 8
ADMIT_FREE_SHARE = 1 / 8


@dataclass
class GenRequest:
    """One sequence to generate: the prompt, its params and the seed of its private generator."""

    prompt: list[int]
    params: SamplingParams
    seed: int
    adapter: Hashable = None  # the LoRA adapter this row samples through (see the module docstring)


class SamplingStats(Protocol):
    """Where the engine reports its work (``retool.backends.local.client.BackendStats``)."""

    def add_prefill(self, computed: int, seconds: float) -> None: ...

    def add_sequence(self, prompt_tokens: int, sampled_tokens: int) -> None: ...

    def add_sample_seconds(self, seconds: float) -> None: ...


class TokenDecoder(Protocol):
    """The tokenizer surface the engine uses: decoding a sequence's tail to match stop strings."""

    def decode(self, token_ids: list[int], skip_special_tokens: bool = False) -> str: ...


BOXED_MARKER = "\\boxed{"


def closes_boxed(text: str) -> bool:
    """Whether ``text`` holds a ``\\boxed{`` whose braces close (``SamplingParams.stop_at_boxed``)."""
    start = text.find(BOXED_MARKER)
    while start >= 0:
        depth = 1
        for char in text[start + len(BOXED_MARKER) :]:
            depth += {"{": 1, "}": -1}.get(char, 0)
            if depth == 0:
                return True
        start = text.find(BOXED_MARKER, start + 1)
    return False


def _stop_sets(params: SamplingParams, eos_ids: set[int]) -> tuple[set[int], list[str]]:
    ids = set(eos_ids)
    strings: list[str] = []
    for item in params.stop:
        if isinstance(item, str):
            if item:
                strings.append(item)
        else:
            ids.add(int(item))
    return ids, strings


def cache_kwarg(model: torch.nn.Module) -> str:
    """transformers >= 5.2x names the cache argument ``cache``; older versions ``past_key_values``."""
    params = inspect.signature(model.forward).parameters
    if "cache" in params:
        return "cache"
    base = getattr(model, "get_base_model", None)
    if base is not None and "cache" in inspect.signature(base().forward).parameters:
        return "cache"
    return "past_key_values"


def output_cache(out: object) -> DynamicCache:
    for key in ("cache", "past_key_values"):
        value = out.get(key) if hasattr(out, "get") else getattr(out, key, None)
        if value is not None:
            return value
    raise RuntimeError("model returned no KV cache")


def shared_prefix_length(prompts: Sequence[Sequence[int]]) -> int:
    """Length of the common prefix of ``prompts``, leaving every prompt at least one token of its own
    (the suffix pass must produce each row's next-token logits)."""
    if len(prompts) < 2:
        return 0
    first = prompts[0]
    limit = min(len(p) for p in prompts) - 1
    n = 0
    while n < limit and all(p[n] == first[n] for p in prompts):
        n += 1
    return n


def choose_tokens(
    logits: torch.Tensor,
    temperature: torch.Tensor,
    top_p: torch.Tensor,
    top_k: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    """Pick one token per row by inverse CDF of ``uniforms`` over the tempered, top-k/top-p-filtered
    distribution; rows with temperature 0 are greedy. All inputs are per-row tensors on one device."""
    vocab = logits.shape[-1]
    greedy = temperature <= 0
    temp = torch.where(greedy, torch.ones_like(temperature), temperature)
    scaled = logits / temp[:, None]
    filtered = bool(((top_p < 1.0) | ((top_k > 0) & (top_k < vocab))).any())
    if filtered:
        sorted_logits, order = torch.sort(scaled, dim=-1, descending=True)
        probs = torch.softmax(sorted_logits, dim=-1)
        ranks = torch.arange(vocab, device=logits.device)[None, :]
        k = torch.where(top_k > 0, top_k, torch.full_like(top_k, vocab))
        keep = ranks < k[:, None]
        cum_before = torch.cumsum(probs, dim=-1) - probs
        keep &= cum_before < top_p[:, None]
        keep[:, 0] = True  # the most likely token always survives
        probs = torch.where(keep, probs, torch.zeros_like(probs))
    else:
        order = None
        probs = torch.softmax(scaled, dim=-1)
    cdf = torch.cumsum(probs, dim=-1)
    target = uniforms[:, None].to(cdf.dtype) * cdf[:, -1:]
    # right=True: the first slot whose cdf exceeds the target, which always has positive probability.
    idx = torch.searchsorted(cdf, target, right=True).clamp_(max=vocab - 1).squeeze(-1)
    picked = idx if order is None else order.gather(-1, idx[:, None]).squeeze(-1)
    argmax = logits.argmax(dim=-1)
    return torch.where(greedy, argmax, picked)


class _Unit:
    """One submitted list of requests; its result is complete when every row has finished."""

    def __init__(self, size: int, future: concurrent.futures.Future[list[Sample]]) -> None:
        self.future = future
        self.results: list[Sample | None] = [None] * size
        self.left = size

    def finish(self, index: int, sample: Sample) -> None:
        self.results[index] = sample
        self.left -= 1
        if self.left == 0 and not self.future.done():
            self.future.set_result([s for s in self.results if s is not None])

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


@dataclass
class _Row:
    """One sequence: its request, its private generator and what it has produced so far."""

    unit: _Unit
    index: int
    prompt: list[int]
    params: SamplingParams
    generator: torch.Generator
    budget: int
    stop_ids: set[int]
    stop_strings: list[str]
    window: int  # tokens decoded to look for a stop string
    adapter: Hashable = None
    submitted: float = field(default_factory=time.perf_counter)  # when it entered the inbox
    boxed_from: int = -1  # stop_at_boxed: the token from which the decoded text holds the marker
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)

    @classmethod
    def start(cls, unit: _Unit, index: int, req: GenRequest, eos_ids: set[int], max_context: int) -> _Row:
        stop_ids, stop_strings = _stop_sets(req.params, eos_ids)
        return cls(
            unit=unit,
            index=index,
            prompt=req.prompt,
            params=req.params,
            generator=torch.Generator().manual_seed(req.seed % (2**63)),
            budget=max(0, min(req.params.max_tokens, max_context - len(req.prompt))),
            stop_ids=stop_ids,
            stop_strings=stop_strings,
            window=max((len(s) for s in stop_strings), default=0) + 4,
            adapter=req.adapter,
        )

    def record(self, token: int, logprob: float, tokenizer: TokenDecoder) -> StopReason | None:
        """Append a sampled token; the reason the sequence ends with it, if it does."""
        self.tokens.append(token)
        self.logprobs.append(logprob)
        if token in self.stop_ids:
            return "stop"
        if self.stop_strings:
            tail = tokenizer.decode(self.tokens[-self.window :], skip_special_tokens=False)
            if any(s in tail for s in self.stop_strings):
                return "stop"
        if self.params.stop_at_boxed and self._boxed_closed(tokenizer):
            return "stop"
        return "length" if len(self.tokens) >= self.budget else None

    def _boxed_closed(self, tokenizer: TokenDecoder) -> bool:
        """Whether the completion holds a closed ``\\boxed{...}``: the marker looked for in the decoded
        tail, then the text from where it was found decoded and its braces counted (a few tokens a step)."""
        if self.boxed_from < 0:
            start = max(0, len(self.tokens) - len(BOXED_MARKER) - 4)
            if BOXED_MARKER not in tokenizer.decode(self.tokens[start:], skip_special_tokens=False):
                return False
            self.boxed_from = start
        return closes_boxed(tokenizer.decode(self.tokens[self.boxed_from :], skip_special_tokens=False))

    def cached_tokens(self) -> list[int]:
        """The tokens whose KV the cache holds for this row (the last sampled one was never fed back)."""
        return self.prompt + self.tokens[:-1]


class _GrowingLayer(DynamicLayer):
    """A full KV layer that appends a decode step's keys and values into spare columns of a buffer it
    owns, where ``DynamicLayer`` concatenates: copying the whole cache once per token per layer cost a
    third of a decode step on CPU (SmolLM2-135M, 16 rows x 300 columns: 89 of 218 ms).

    ``keys`` / ``values`` stay views ``[:, :, :length]`` of the buffers. Whoever replaces them (the
    batch's ``select`` / ``extend`` / ``trim``) simply hands the layer new tensors: the next ``update``
    sees that they are no longer its buffer's view and copies them into a fresh buffer, once. Columns are
    only ever written past the current length, so a view taken earlier never changes under its holder.
    """

    def __init__(self) -> None:
        super().__init__()
        self._key_buffer: torch.Tensor | None = None
        self._value_buffer: torch.Tensor | None = None

    @classmethod
    def adopt(cls, layer: DynamicLayer) -> _GrowingLayer:
        grown = cls()
        grown.keys, grown.values, grown.is_initialized = layer.keys, layer.values, layer.is_initialized
        if layer.is_initialized:
            grown.device = layer.device
        return grown

    def _owns_views(self) -> bool:
        buf, keys = self._key_buffer, self.keys
        return (
            buf is not None
            and keys is not None
            and keys.data_ptr() == buf.data_ptr()
            and keys.shape[:2] == buf.shape[:2]
            and keys.stride() == buf.stride()
        )

    def _rebuffer(self, new: torch.Tensor, length: int, needed: int) -> None:
        """Fresh buffers for ``needed`` columns plus spare ones, holding the current ``length`` columns."""
        rows, heads, _, dim = new.shape
        shape = (rows, heads, needed + KV_SPARE_COLUMNS, dim)
        keys, values = new.new_empty(shape), new.new_empty(shape)
        if length and self.keys is not None and self.values is not None:
            keys[:, :, :length] = self.keys
            values[:, :, :length] = self.values
        self._key_buffer, self._value_buffer = keys, values
        self.keys, self.values = keys[:, :, :length], values[:, :, :length]

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        # Nothing cached yet: ``lazy_initialization`` leaves empty 1-d tensors.
        length = 0 if self.keys is None or self.keys.dim() < 4 else self.keys.shape[-2]
        end = length + key_states.shape[-2]
        if not self._owns_views() or self._key_buffer is None or end > self._key_buffer.shape[-2]:
            self._rebuffer(key_states, length, end)
        assert self._key_buffer is not None and self._value_buffer is not None
        self._key_buffer[:, :, length:end] = key_states
        self._value_buffer[:, :, length:end] = value_states
        self.keys, self.values = self._key_buffer[:, :, :end], self._value_buffer[:, :, :end]
        return self.keys, self.values


def cache_layers(cache: DynamicCache) -> list[Any]:
    """The cache's layers, all full KV layers (typed ``Any``: their ``keys`` / ``values`` are declared
    optional until the first forward fills them, which every cache here has had)."""
    layers = list(cache.layers)
    if any(type(layer) not in (DynamicLayer, _GrowingLayer) for layer in layers):  # sliding windows drop
        kinds = sorted({type(layer).__name__ for layer in layers})
        raise NotImplementedError(f"the local sampler needs full KV caches; this model's are {kinds}")
    return layers


def _growing(cache: DynamicCache) -> DynamicCache:
    """``cache`` with every layer appending in place (``_GrowingLayer``), ready for decode steps."""
    for i, layer in enumerate(cache_layers(cache)):
        if type(layer) is not _GrowingLayer:
            cache.layers[i] = _GrowingLayer.adopt(layer)
    return cache


def _pad_left(t: torch.Tensor, width: int) -> torch.Tensor:
    extra = width - t.shape[-2]
    return t if extra == 0 else torch.nn.functional.pad(t, (0, 0, extra, 0))


class _Batch:
    """The sequences in flight and their decoding state, row-aligned: KV cache (a ``DynamicCache`` whose
    layers are ``[rows, heads, columns, dim]``), attention mask ``[rows, columns]``, the position of each
    row's last token and the logits of its next one."""

    def __init__(
        self,
        rows: list[_Row],
        cache: DynamicCache,
        mask: torch.Tensor,
        last_pos: torch.Tensor,
        logits: torch.Tensor,
    ) -> None:
        self.rows, self.cache, self.mask, self.last_pos, self.logits = rows, cache, mask, last_pos, logits
        self.dead: set[int] = set()  # rows finished (or cancelled) still holding their place

    def live(self) -> list[int]:
        return [i for i in range(len(self.rows)) if i not in self.dead]

    def compact(self) -> _Batch:
        """The batch without its dead rows."""
        return self.select(self.live()) if self.dead else self

    def select(self, keep: list[int]) -> _Batch:
        """The rows ``keep`` (repeats allowed: a group's copies of one prefilled prompt)."""
        index = torch.tensor(keep, dtype=torch.long, device=self.mask.device)
        for layer in cache_layers(self.cache):
            layer.keys, layer.values = layer.keys[index], layer.values[index]
        rows = [self.rows[i] for i in keep] if self.rows else []
        batch = _Batch(rows, self.cache, self.mask[index], self.last_pos[index], self.logits[index])
        batch.trim()
        return batch

    def extend(self, other: _Batch) -> _Batch:
        """Both batches' rows in one, the shorter KV padded on the left."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(cache_layers(self.cache), cache_layers(other.cache), strict=True):
            mine.keys = torch.cat([_pad_left(mine.keys, width), _pad_left(theirs.keys, width)])
            mine.values = torch.cat([_pad_left(mine.values, width), _pad_left(theirs.values, width)])
        pad = torch.nn.functional.pad
        mask = torch.cat([pad(m, (width - m.shape[1], 0)) for m in (self.mask, other.mask)])
        return _Batch(
            self.rows + other.rows,
            self.cache,
            mask,
            torch.cat([self.last_pos, other.last_pos]),
            torch.cat([self.logits, other.logits]),
        )

    def trim(self) -> None:
        """Drop the leading columns no row attends to (left after long rows leave)."""
        used = self.mask.any(0).nonzero()
        first = int(used[0]) if len(used) else 0
        if first > 0:
            for layer in cache_layers(self.cache):
                layer.keys, layer.values = layer.keys[:, :, first:], layer.values[:, :, first:]
            self.mask = self.mask[:, first:]

    def row_kv(self, row: int) -> KV:
        """Row ``row``'s keys and values over its real columns, ``[heads, length, dim]`` per layer."""
        cols = self.mask[row].nonzero().squeeze(-1)
        return [
            (layer.keys[row].index_select(1, cols), layer.values[row].index_select(1, cols))
            for layer in cache_layers(self.cache)
        ]


def _padding_groups(lengths: list[int]) -> list[list[int]]:
    """Indices into ``lengths`` grouped (shortest first) so each group's padded area stays within
    ``PREFILL_PADDING_SLACK`` of its real tokens and under ``MAX_PREFILL_TOKENS``."""
    groups: list[list[int]] = []
    current: list[int] = []
    real = 0
    for i in sorted(range(len(lengths)), key=lambda i: lengths[i]):
        area = (len(current) + 1) * lengths[i]  # sorted: the new one is the longest
        if current and (area > PREFILL_PADDING_SLACK * (real + lengths[i]) or area > MAX_PREFILL_TOKENS):
            groups.append(current)
            current, real = [], 0
        current.append(i)
        real += lengths[i]
    if current:
        groups.append(current)
    return groups


@dataclass
class _Prefill:
    """One prompt to prefill: its tokens and the longest cached prefix found for it."""

    tokens: list[int]
    cached: int = 0
    kv: KV | None = None
    adapter: Hashable = None


class ContinuousGenerator:
    """Continuous-batching generation with a prefix cache on one executor (see the module docstring).

    ``model_fn`` returns the module to run, brought up to date (called once per job, on the executor);
    ``tag_fn`` the identity of its weights (a change empties the prefix cache); ``should_yield`` is true
    while another job (a training call) waits for the executor; ``select_adapters``, when given, is told
    each row's adapter before every forward (see the module docstring).
    """

    def __init__(
        self,
        *,
        model_fn: Callable[[], torch.nn.Module],
        tag_fn: Callable[[], Hashable],
        tokenizer: TokenDecoder,
        pad_id: int,
        eos_ids: set[int],
        max_context: int,
        device: torch.device,
        batch_limit: int,
        cache: PrefixCache,
        executor: Executor,
        stats: SamplingStats,
        should_yield: Callable[[], bool] = lambda: False,
        select_adapters: Callable[[list[Hashable]], None] | None = None,
    ) -> None:
        self._model_fn, self._tag_fn, self._should_yield = model_fn, tag_fn, should_yield
        self._select = select_adapters
        self.tokenizer, self.pad_id, self.eos_ids = tokenizer, pad_id, eos_ids
        self.max_context, self.device, self.batch_limit = max_context, device, batch_limit
        self.cache, self.stats, self._executor = cache, stats, executor
        self.share_prefix = True  # run the common prefix of sequences admitted together once
        self.lean_decode = True  # decode steps through ``engine.decode_step`` where it applies
        self._lean: DecodeStep | None = None
        self.peak_rows = 0  # most sequences decoded together (observability)
        self.queue_seconds = 0.0  # time rows waited in the inbox before a step boundary admitted them
        self.admitted_rows = 0
        self._inbox: collections.deque[_Row] = collections.deque()
        self._lock = threading.Lock()
        self._running = False
        self._cache_key: str | None = None

    def submit(self, requests: Sequence[GenRequest]) -> concurrent.futures.Future[list[Sample]]:
        """Queue ``requests``; the future holds one ``Sample`` per request, in order."""
        future: concurrent.futures.Future[list[Sample]] = concurrent.futures.Future()
        if not requests:
            future.set_result([])
            return future
        unit = _Unit(len(requests), future)
        rows = [_Row.start(unit, i, r, self.eos_ids, self.max_context) for i, r in enumerate(requests)]
        with self._lock:
            self._inbox.extend(rows)
            if not self._running:
                try:
                    self._executor.submit(self._job)
                except RuntimeError as exc:  # the executor was shut down
                    self._inbox.clear()
                    unit.fail(exc)
                    return future
                self._running = True
        return future

    def _job(self) -> None:
        """Executor body: serve the inbox until it is empty (or a training call waits)."""
        t0 = time.perf_counter()
        model: torch.nn.Module | None = None
        was_training = False
        batch: _Batch | None = None
        try:
            model = self._model_fn()
            was_training = model.training
            model.eval()
            self.cache.validate((self._tag_fn(), id(model)))
            if self._cache_key is None:
                self._cache_key = cache_kwarg(model)
            # Adapters switch inside the model's modules per row: those batches keep the model's forward.
            self._lean = lean_decoder(model) if self._select is None and self.lean_decode else None
            with torch.no_grad():
                while True:
                    batch = self._admit(model, batch)
                    if batch is None:
                        if self._end_job():
                            break
                        continue
                    batch = self._step(model, batch)
        except Exception as exc:  # a fault of the engine itself: fail every waiter rather than hang it
            logger.exception("local sampler: generation job failed")
            with self._lock:
                waiting = list(self._inbox) + (batch.rows if batch else [])
                self._inbox.clear()
                self._running = False
            for row in waiting:
                row.unit.fail(exc)
        finally:
            if model is not None:
                model.train(was_training)
            self.stats.add_sample_seconds(time.perf_counter() - t0)

    def _end_job(self) -> bool:
        """Whether the job may end: nothing waits, or a training call does (the job queues behind it)."""
        with self._lock:
            if not self._inbox:
                self._running = False
                return True
            if self._should_yield():
                self._executor.submit(self._job)
                return True
        return False

    def _take(self, room: int) -> list[_Row]:
        if room <= 0 or self._should_yield():
            return []
        taken: list[_Row] = []
        with self._lock:
            while self._inbox and len(taken) < room:
                row = self._inbox.popleft()
                if row.unit.future.done():  # cancelled or failed meanwhile
                    continue
                if row.budget == 0:
                    row.unit.finish(row.index, Sample([], [], "length"))
                    continue
                taken.append(row)
        now = time.perf_counter()
        self.queue_seconds += sum(now - row.submitted for row in taken)
        self.admitted_rows += len(taken)
        return taken

    def _admit(self, model: torch.nn.Module, batch: _Batch | None) -> _Batch | None:
        """Prefill waiting rows and add them to ``batch`` (a failure ends those rows and the batch's); a
        batch with live rows takes them only once ``ADMIT_FREE_SHARE`` of its slots are free."""
        live = len(batch.live()) if batch else 0
        room = self.batch_limit - live
        if live and room < max(1, int(self.batch_limit * ADMIT_FREE_SHARE)):
            return batch
        rows = self._take(room)
        if not rows:
            return batch
        try:
            new = self._prefill_rows(model, rows)
        except Exception as exc:
            logger.exception("local sampler: prefill failed")
            for row in rows + (batch.rows if batch else []):
                row.unit.fail(exc)
            return None
        merged = new if batch is None else batch.compact().extend(new)
        self.peak_rows = max(self.peak_rows, len(merged.rows))
        return merged

    def _prefill_rows(self, model: torch.nn.Module, rows: list[_Row]) -> _Batch:
        """One batch of ``rows`` with their prompts prefilled; identical prompts are run once."""
        unique: dict[tuple[Hashable, tuple[int, ...]], int] = {}
        order = [unique.setdefault((r.adapter, tuple(r.prompt)), len(unique)) for r in rows]
        items = [_Prefill(list(p), adapter=a) for a, p in unique]
        by_adapter: dict[Hashable, list[_Prefill]] = {}
        for it in items:
            by_adapter.setdefault(it.adapter, []).append(it)
        for same in by_adapter.values():
            self._find_prefixes(model, same)
        parts: list[tuple[list[int], _Batch]] = []
        for group in _padding_groups([len(it.tokens) - it.cached for it in items]):
            parts.append((group, self._forward_prefill(model, [items[i] for i in group])))
        position = {u: (p, k) for p, (group, _) in enumerate(parts) for k, u in enumerate(group)}
        whole = parts[0][1]
        offsets = [0]
        for _, part in parts[1:]:
            offsets.append(len(whole.logits))
            whole = whole.extend(part)
        keep = [offsets[position[u][0]] + position[u][1] for u in order]
        batch = whole.select(keep)
        batch.rows = rows
        return batch

    def _find_prefixes(self, model: torch.nn.Module, items: list[_Prefill]) -> None:
        """Fill each item's cached prefix: from the prefix cache, or the items' common prefix run now
        (``items`` all of one adapter)."""
        space = items[0].adapter
        for it in items:
            if self.cache.enabled:
                it.cached, it.kv = self.cache.lookup(it.tokens, len(it.tokens) - 1, space)
        shared = shared_prefix_length([it.tokens for it in items]) if self.share_prefix else 0
        if shared < MIN_SHARED_PREFIX or all(it.cached >= shared for it in items):
            return
        head = _Prefill(items[0].tokens[:shared], adapter=space)
        if self.cache.enabled:
            head.cached, head.kv = self.cache.lookup(head.tokens, shared - 1, space)
        else:  # the longest prefix an item already holds is still worth reusing
            best = max(items, key=lambda it: it.cached)
            if best.cached:
                head.cached, head.kv = best.cached, best.kv
        kv = self._forward_prefill(model, [head]).row_kv(0)
        self.cache.store(head.tokens, kv, space)
        for it in items:
            if it.cached < shared:
                it.cached, it.kv = shared, kv

    def _forward_prefill(self, model: torch.nn.Module, items: list[_Prefill]) -> _Batch:
        """Run each item's uncached suffix after its cached KV, right-aligned (``[pad][prefix]`` in the
        cache, ``[pad][suffix]`` in the input); a batch of the items (without rows) and their logits."""
        t0 = time.perf_counter()
        width = max(it.cached for it in items)
        longest = max(len(it.tokens) - it.cached for it in items)
        ids = torch.full((len(items), longest), self.pad_id, dtype=torch.long)
        mask = torch.zeros((len(items), width + longest), dtype=torch.long)
        pos = torch.zeros((len(items), longest), dtype=torch.long)
        for u, it in enumerate(items):
            own = it.tokens[it.cached :]
            ids[u, longest - len(own) :] = torch.tensor(own, dtype=torch.long)
            mask[u, width - it.cached : width] = 1
            mask[u, width + longest - len(own) :] = 1
            pos[u, longest - len(own) :] = torch.arange(it.cached, len(it.tokens))
        kwargs: dict[str, DynamicCache] = {}
        if width:
            kwargs[self._cache_key or "past_key_values"] = self._padded_cache(items, width)
        mask, pos = mask.to(self.device), pos.to(self.device)
        if self._select is not None:
            self._select([it.adapter for it in items])
        out = model(
            input_ids=ids.to(self.device),
            attention_mask=mask,
            position_ids=pos,
            use_cache=True,
            logits_to_keep=1,
            **kwargs,
        )
        computed = sum(len(it.tokens) - it.cached for it in items)
        self.stats.add_prefill(computed, time.perf_counter() - t0)
        cache = output_cache(out)
        cache_layers(cache)  # refuse a cache layout the batch cannot merge, before any row depends on it
        return _Batch([], cache, mask, pos[:, -1:], out.logits[:, -1, :].float())

    def _padded_cache(self, items: list[_Prefill], width: int) -> DynamicCache:
        """A ``DynamicCache`` holding each item's cached KV right-aligned in ``width`` columns."""
        ref = next(it.kv for it in items if it.kv is not None)
        layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        for layer, (k0, _) in enumerate(ref):
            shape = (len(items), k0.shape[0], width, k0.shape[2])
            keys, values = k0.new_zeros(shape), k0.new_zeros(shape)
            for u, it in enumerate(items):
                if it.kv is not None and it.cached:
                    keys[u, :, width - it.cached :] = it.kv[layer][0]
                    values[u, :, width - it.cached :] = it.kv[layer][1]
            layers.append((keys, values))
        return DynamicCache(ddp_cache_data=layers)

    def _step(self, model: torch.nn.Module, batch: _Batch) -> _Batch | None:
        """Sample one token for every row, let finished rows leave, decode the rest one position."""
        rows, dead = batch.rows, batch.dead
        params = [r.params for r in rows]
        lp_all = torch.log_softmax(batch.logits, dim=-1)
        # One draw per live sequence per step from its own generator: the stream ignores batch composition
        # (a dead row draws nothing; its token is never read).
        uniforms = torch.stack(
            [
                torch.zeros(()) if i in dead else torch.rand((), generator=r.generator)
                for i, r in enumerate(rows)
            ]
        ).to(self.device)
        chosen = choose_tokens(
            batch.logits,
            torch.tensor([p.temperature for p in params], dtype=torch.float32, device=self.device),
            torch.tensor([p.top_p for p in params], dtype=torch.float32, device=self.device),
            torch.tensor([p.top_k for p in params], dtype=torch.long, device=self.device),
            uniforms,
        )
        lps = lp_all.gather(-1, chosen[:, None]).squeeze(-1).tolist()
        for i, (row, token) in enumerate(zip(rows, chosen.tolist(), strict=True)):
            if i in dead:
                continue
            reason = row.record(token, lps[i], self.tokenizer)
            if reason is not None:
                self._finish(batch, i, reason)
                dead.add(i)
            elif row.unit.future.done():  # cancelled, or failed meanwhile
                dead.add(i)
        if len(dead) == len(rows):
            return None
        if len(dead) >= max(1, int(len(rows) * COMPACT_DEAD_SHARE)):
            live = batch.live()
            batch = batch.select(live)
            chosen = chosen[torch.tensor(live, device=self.device)]
        try:
            return self._decode(model, batch, chosen)
        except Exception as exc:
            logger.exception("local sampler: decoding step failed")
            for row in batch.rows:
                row.unit.fail(exc)
            return None

    def _finish(self, batch: _Batch, i: int, reason: StopReason) -> None:
        row = batch.rows[i]
        if self.cache.enabled:
            self.cache.store(row.cached_tokens(), batch.row_kv(i), row.adapter)
        self.stats.add_sequence(len(row.prompt), len(row.tokens))
        row.unit.finish(row.index, Sample(row.tokens, row.logprobs, reason))

    def _decode(self, model: torch.nn.Module, batch: _Batch, chosen: torch.Tensor) -> _Batch:
        ones = torch.ones((batch.mask.shape[0], 1), dtype=batch.mask.dtype, device=self.device)
        batch.mask = torch.cat([batch.mask, ones], dim=1)
        advance = torch.ones_like(batch.last_pos)
        if batch.dead:  # a dead row stays at its last position: past it may lie beyond the model's context
            advance[sorted(batch.dead)] = 0
        batch.last_pos = batch.last_pos + advance
        if self._lean is not None:  # the model's own modules without transformers' per-call machinery
            cache = _growing(batch.cache)
            logits = self._lean(chosen[:, None], batch.mask, batch.last_pos, cache_layers(cache))
            batch.logits = logits[:, -1, :].float()
            return batch
        if self._select is not None:
            self._select([r.adapter for r in batch.rows])
        out = model(
            input_ids=chosen[:, None],
            attention_mask=batch.mask,
            position_ids=batch.last_pos,
            use_cache=True,
            **{self._cache_key or "past_key_values": _growing(batch.cache)},
        )
        batch.cache = output_cache(out)
        batch.logits = out.logits[:, -1, :].float()
        return batch
