"""The local sampler's prefix cache and continuous batching on a tiny random model: the same tokens and
logprobs with the cache on and off, the trainer's recomputation matching the sampler's logprobs, the
cache emptied by every weight change, LRU eviction under the memory cap, concurrent requests sharing a
prefix, and seeded requests reproducible whatever joins them mid-decode."""

from __future__ import annotations

import asyncio
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from retool.backends.engine.prefix_cache import KV, PrefixCache
from retool.backends.interface.types import AdamParams, Datum, Sample, SamplingParams
from retool.backends.local.client import LocalTrainingClient

# Cache on vs off: the prefix's KV comes from a different forward (other shapes, other batch), so
# float sums run in a different order: equal to rounding (~1e-6 on this model), not bitwise.
ON_OFF_TOLERANCE = 1e-4


@pytest.fixture(scope="module", autouse=True)
def _one_thread() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def _client(tiny_model_dir: Path, cache_mb: float, lora: dict | None = None) -> LocalTrainingClient:
    return LocalTrainingClient(
        tiny_model_dir, lora=lora, device="cpu", seed=0, sample_batch_size=16, prefix_cache_mb=cache_mb
    )


@pytest.fixture(scope="module")
def cached(tiny_model_dir: Path) -> Iterator[LocalTrainingClient]:
    c = _client(tiny_model_dir, 64)
    yield c
    c.close()


@pytest.fixture(scope="module")
def uncached(tiny_model_dir: Path) -> Iterator[LocalTrainingClient]:
    c = _client(tiny_model_dir, 0)
    yield c
    c.close()


def _encode(client: LocalTrainingClient, text: str) -> list[int]:
    return list(client.tokenizer.encode(text, add_special_tokens=False))


SYSTEM = "You solve problems. Call the code_interpreter tool when it helps, then answer in a box. " * 2


def _multi_turn(client: LocalTrainingClient, questions: list[str], turns: int = 3) -> list[list[Sample]]:
    """Groups of 2 per question, ``turns`` turns each, an observation appended between turns: the
    demo's RL shape. Returns every turn's samples (trajectory-major)."""
    params = [SamplingParams(max_tokens=12, temperature=1.0, seed=100 + q) for q in range(len(questions))]

    async def trajectory(prompt: list[int], q: int, k: int) -> list[Sample]:
        sampler = await client.sampling_client_async()
        out: list[Sample] = []
        for turn in range(turns):
            p = SamplingParams(max_tokens=12, temperature=1.0, seed=1000 * q + 10 * k + turn)
            (s,) = await sampler.sample_async(prompt, 1, p)
            out.append(s)
            prompt = prompt + s.tokens + _encode(client, f" <interpreter>{turn * 7}</interpreter> ")
        return out

    async def run() -> list[list[Sample]]:
        sampler = await client.sampling_client_async()
        prompts = [_encode(client, SYSTEM + q) for q in questions]
        firsts = await asyncio.gather(*[sampler.sample_async(p, 2, params[i]) for i, p in enumerate(prompts)])
        rest = []
        for q, (prompt, group) in enumerate(zip(prompts, firsts, strict=True)):
            for k, s in enumerate(group):
                nxt = prompt + s.tokens + _encode(client, " <interpreter>ok</interpreter> ")
                rest.append(trajectory(nxt, q, k))
        later = await asyncio.gather(*rest)
        groups = [s for group in firsts for s in group]
        return [[first, *tail] for first, tail in zip(groups, later, strict=True)]

    return asyncio.run(run())


def _recomputed(client: LocalTrainingClient, prompt: list[int], tokens: list[int]) -> list[float]:
    seq = prompt + tokens
    ids = torch.tensor([seq[:-1]])
    with torch.no_grad():
        lp = client.target_logprobs(ids, torch.ones_like(ids), torch.tensor([seq[1:]]))[0]
    return lp[len(prompt) - 1 :].tolist()


def test_cache_on_and_off_give_the_same_tokens_and_logprobs(
    cached: LocalTrainingClient, uncached: LocalTrainingClient
) -> None:
    questions = ["What is 3+4?", "How many primes are below 30?", "Compute 12*13."]
    before = cached.stats.prefill_tokens, cached.prefix_cache.stats.hit_tokens
    on, off = _multi_turn(cached, questions), _multi_turn(uncached, questions)
    assert [[s.tokens for s in t] for t in on] == [[s.tokens for s in t] for t in off]
    worst = max(
        abs(a - b)
        for t_on, t_off in zip(on, off, strict=True)
        for s_on, s_off in zip(t_on, t_off, strict=True)
        for a, b in zip(s_on.logprobs, s_off.logprobs, strict=True)
    )
    assert worst < ON_OFF_TOLERANCE
    # The cache served later turns: far fewer tokens prefilled than the uncached client did.
    assert cached.prefix_cache.stats.hit_tokens - before[1] > 0
    assert cached.stats.prefill_tokens - before[0] < 0.5 * uncached.stats.prefill_tokens


def test_sampler_logprobs_match_the_trainer_on_cached_turns(cached: LocalTrainingClient) -> None:
    """fp32: the logprobs of tokens sampled on cached prefixes equal the trainer's recomputation of
    the whole sequence (the on-policy PPO ratio stays 1)."""
    prompt = _encode(cached, SYSTEM + "What is 2**10?")
    diffs: list[float] = []
    for turn in range(3):
        hits = cached.prefix_cache.stats.hit_tokens
        (s,) = cached.sample(prompt, 1, SamplingParams(max_tokens=10, temperature=1.0, seed=turn))
        if turn:
            assert cached.prefix_cache.stats.hit_tokens > hits  # this turn reused the previous one's KV
        diffs += [abs(a - b) for a, b in zip(s.logprobs, _recomputed(cached, prompt, s.tokens), strict=True)]
        prompt = prompt + s.tokens + _encode(cached, " observation ")
    assert sum(diffs) / len(diffs) < 1e-3
    assert max(diffs) < 1e-3


def _datum(prompt: list[int], sample: Sample, advantage: float) -> Datum:
    seq = prompt + sample.tokens
    n_prompt, n = len(prompt) - 1, len(sample.tokens)
    return Datum(
        input_tokens=seq[:-1],
        target_tokens=seq[1:],
        logprobs=[0.0] * n_prompt + list(sample.logprobs),
        advantages=[0.0] * n_prompt + [advantage] * n,
        weights=[0.0] * n_prompt + [1.0] * n,
    )


def _next_turn_matches_trainer(client: LocalTrainingClient, prompt: list[int], seed: int) -> float:
    """Sample a turn on ``prompt`` (whose KV the cache may hold); max |sampler - trainer| logprob."""
    (s,) = client.sample(prompt, 1, SamplingParams(max_tokens=8, temperature=1.0, seed=seed))
    return max(abs(a - b) for a, b in zip(s.logprobs, _recomputed(client, prompt, s.tokens), strict=True))


@pytest.mark.parametrize("lora", [None, {"rank": 4, "alpha": 8, "target_modules": ["q_proj", "v_proj"]}])
def test_every_weight_change_empties_the_cache(
    tiny_model_dir: Path, tmp_path: Path, lora: dict | None
) -> None:
    """KV computed with old weights never serves a request after an optimizer step, a state load or a
    switch of the sampling module (the merged LoRA view): the next turn's logprobs then still equal the
    trainer's recomputation under the new weights. Without invalidation they are off by far more."""
    c = _client(tiny_model_dir, 64, lora)
    c.checkpoint_dir = tmp_path
    try:
        prompt = _encode(c, SYSTEM + "What is 6*7?")
        (first,) = c.sample(prompt, 1, SamplingParams(max_tokens=10, temperature=1.0, seed=1))
        saved = c.save_state("before")
        longer = prompt + first.tokens + _encode(c, " <interpreter>42</interpreter> ")
        # A strong update: the same prefix now has very different KV.
        c.forward_backward([_datum(prompt, first, advantage=20.0)], "importance_sampling")
        c.optim_step(AdamParams(lr=0.05))
        assert len(c.prefix_cache) == 0  # freed at once, not held through training
        assert _next_turn_matches_trainer(c, longer, seed=2) < 1e-4
        hits = c.prefix_cache.stats.hit_tokens
        c.load_state(saved)  # back to the first weights: entries made since are stale again
        assert _next_turn_matches_trainer(c, longer, seed=3) < 1e-4
        assert c.prefix_cache.stats.hit_tokens == hits  # nothing stale was served
        if lora is not None:
            c.merge_lora_for_sampling = False  # another sampling module: its KV differs by rounding
            assert _next_turn_matches_trainer(c, longer, seed=4) < 1e-4
            c.merge_lora_for_sampling = True
    finally:
        c.close()


def _kv(length: int, fill: float = 0.0) -> KV:
    return [(torch.full((2, length, 4), fill), torch.full((2, length, 4), fill)) for _ in range(3)]


def test_prefix_cache_lookup_extension_and_lru_eviction() -> None:
    per_token = 3 * 2 * 2 * 4 * 4  # layers x (k, v) x heads x dim x float32 bytes
    cache = PrefixCache(max_bytes=100 * per_token, block=4)
    a = list(range(40))
    assert cache.store(a, _kv(40, 1.0))
    n, kv = cache.lookup([*a, 99, 98], limit=41)
    assert n == 40 and kv is not None and kv[0][0].shape == (2, 40, 4)
    n, _ = cache.lookup([*a[:13], 7, 7, 7, 7, 7], limit=17)
    assert n == 13  # a block-aligned match extended token by token
    assert cache.lookup([5, 4, 3, 2, 1] * 4, limit=19) == (0, None)
    # Storing an extension of ``a`` replaces it (the new entry serves every request ``a`` could).
    assert cache.store([*a, 1, 2, 3], _kv(43, 2.0))
    assert len(cache) == 1 and cache.bytes == 43 * per_token
    b, c = [1000 + t for t in range(40)], [2000 + t for t in range(40)]
    assert cache.store(b, _kv(40))
    cache.lookup(a, limit=39)  # touch a: b is now the least recently used
    assert cache.store(c, _kv(40))  # 43 + 40 + 40 > 100 tokens: evict the LRU entry (b)
    assert cache.bytes <= cache.max_bytes and cache.stats.evicted == 1
    assert cache.lookup(b, limit=39)[0] == 0
    assert cache.lookup(a, limit=39)[0] == 39 and cache.lookup(c, limit=39)[0] == 39
    assert not cache.store(list(range(200)), _kv(200))  # larger than the whole cap: not kept
    cache.validate("weights v1")  # a new tag empties it
    assert len(cache) == 0 and cache.bytes == 0


def test_engine_respects_the_memory_cap(tiny_model_dir: Path) -> None:
    c = _client(tiny_model_dir, 0.05)  # 52 KB: a few short sequences of the tiny model
    try:
        questions = [f"Question number {i}: what is {i}+{i}?" for i in range(6)]
        _multi_turn(c, questions, turns=2)
        assert 0 < c.prefix_cache.bytes <= c.prefix_cache.max_bytes
        assert c.prefix_cache.stats.evicted > 0
    finally:
        c.close()


def test_concurrent_requests_sharing_a_prefix(
    cached: LocalTrainingClient, uncached: LocalTrainingClient
) -> None:
    """Many concurrent requests: some extend a sequence the cache holds, all share a system prompt,
    some are identical; each gets what it gets alone with no cache."""
    base = _encode(cached, SYSTEM + "Sum the digits of 2**20.")
    (seed_sample,) = cached.sample(base, 1, SamplingParams(max_tokens=6, seed=5))
    extended = base + seed_sample.tokens + _encode(cached, " more ")
    prompts = [base, extended, extended, _encode(cached, SYSTEM + "Another question?"), base[:-3]]
    params = [SamplingParams(max_tokens=9, temperature=1.0, seed=50 + i) for i in range(len(prompts))]

    async def together(client: LocalTrainingClient) -> list[list[Sample]]:
        sampler = await client.sampling_client_async()
        return await asyncio.gather(
            *[sampler.sample_async(p, 2, q) for p, q in zip(prompts, params, strict=True)]
        )

    hits = cached.prefix_cache.stats.hits
    got = asyncio.run(together(cached))
    assert cached.prefix_cache.stats.hits > hits
    want = [uncached.sample(p, 2, q) for p, q in zip(prompts, params, strict=True)]
    assert [[s.tokens for s in g] for g in got] == [[s.tokens for s in g] for g in want]
    for g, w in zip(got, want, strict=True):
        for s, t in zip(g, w, strict=True):
            assert max(abs(a - b) for a, b in zip(s.logprobs, t.logprobs, strict=True)) < ON_OFF_TOLERANCE


def test_requests_join_mid_decode_and_leave_when_done(uncached: LocalTrainingClient) -> None:
    """A request sent while a long one decodes joins it (continuous batching), finishes first, and
    gets the same tokens as when it runs alone (its own seeded generator)."""
    long_prompt = _encode(uncached, "Write a long story about numbers.")
    short_prompt = _encode(uncached, "Solve 2+2.")
    short = SamplingParams(max_tokens=5, temperature=1.0, seed=9)
    alone = uncached.sample(short_prompt, 2, short)
    eos = uncached.eos_ids
    uncached.eos_ids = set()  # the long request runs to its budget
    finished: list[str] = []

    async def run() -> list[Sample]:
        sampler = await uncached.sampling_client_async()

        async def tagged(name: str, coro) -> list[Sample]:  # type: ignore[no-untyped-def]
            out = await coro
            finished.append(name)
            return out

        long_task = asyncio.ensure_future(
            tagged("long", sampler.sample_async(long_prompt, 1, SamplingParams(max_tokens=400, seed=1)))
        )
        # The long sequence is decoding once it is in the batch; no fixed wait after that: on a fast CPU
        # this model decodes 120 tokens in well under 0.1 s, and a sleep let it finish first.
        while uncached.engine.peak_rows < 1:
            await asyncio.sleep(0.001)
        got = await tagged("short", sampler.sample_async(short_prompt, 2, short))
        await long_task
        return got

    try:
        uncached.engine.peak_rows = 0
        got = asyncio.run(run())
    finally:
        uncached.eos_ids = eos
    assert finished == ["short", "long"]
    assert uncached.engine.peak_rows == 3  # the short group joined the long sequence's batch
    assert [s.tokens for s in got] == [s.tokens for s in alone]


def test_finished_rows_leave_the_kv_batch_a_few_at_a_time_with_the_same_tokens(
    tiny_model_dir: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A finished row's sample is returned at once, but its KV row stays in the batch (decoded on, never
    read) until an eighth of the batch has finished: fewer copies of the cache, the same tokens and
    logprobs (to rounding: other batch shapes) as rows taken out one by one."""
    from retool.backends.engine import generation

    rows = 64
    client = LocalTrainingClient(
        tiny_model_dir, device="cpu", seed=0, sample_batch_size=rows, prefix_cache_mb=0
    )
    prompts = [_encode(client, f"Question {i}: add {i} and {i * i}.") for i in range(rows)]
    selects = 0
    select = generation._Batch.select

    def counted(self: generation._Batch, keep: list[int]) -> generation._Batch:
        nonlocal selects
        selects += 1
        return select(self, keep)

    monkeypatch.setattr(generation._Batch, "select", counted)

    def run() -> tuple[list[Sample], int]:
        nonlocal selects
        selects = 0

        async def go() -> list[Sample]:
            sampler = await client.sampling_client_async()
            outs = await asyncio.gather(
                *[
                    sampler.sample_async(p, 1, SamplingParams(max_tokens=4 + i, temperature=1.0, seed=i))
                    for i, p in enumerate(prompts)
                ]
            )
            return [s for (s,) in outs]

        return asyncio.run(go()), selects

    client.eos_ids = set()  # each row runs to its own budget: one finishes every step
    try:
        lazy, lazy_selects = run()
        monkeypatch.setattr(generation, "COMPACT_DEAD_SHARE", 0.0)  # every finished row out at once
        eager, eager_selects = run()
    finally:
        client.close()
    assert [len(s.tokens) for s in lazy] == [4 + i for i in range(rows)]
    assert [s.tokens for s in lazy] == [s.tokens for s in eager]
    worst = max(
        abs(a - b)
        for x, y in zip(lazy, eager, strict=True)
        for a, b in zip(x.logprobs, y.logprobs, strict=True)
    )
    assert worst < ON_OFF_TOLERANCE
    assert eager_selects >= rows and lazy_selects < eager_selects / 2


def test_a_full_batch_takes_waiting_rows_once_an_eighth_of_it_is_free(
    uncached: LocalTrainingClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    from retool.backends.engine import generation

    engine = uncached.engine
    batch = generation._Batch(
        [object()] * 16,  # type: ignore[list-item]
        generation.DynamicCache(),
        torch.ones((16, 1), dtype=torch.long),
        torch.zeros((16, 1), dtype=torch.long),
        torch.zeros((16, 8)),
    )
    taken: list[int] = []
    monkeypatch.setattr(engine, "_take", lambda room: taken.append(room) or [])
    batch.dead = {0}  # 15 live of 16: one slot free, fewer than an eighth
    assert engine._admit(None, batch) is batch and taken == []  # type: ignore[arg-type]
    batch.dead = {0, 1}  # two free: an eighth
    assert engine._admit(None, batch) is batch and taken == [2]  # type: ignore[arg-type]


def test_prefill_groups_bound_padding() -> None:
    from retool.backends.engine.generation import PREFILL_PADDING_SLACK, _padding_groups

    lengths = [5, 400, 6, 390, 7, 1]
    groups = _padding_groups(lengths)
    assert sorted(i for g in groups for i in g) == list(range(len(lengths)))
    for g in groups:
        area = len(g) * max(lengths[i] for i in g)
        assert len(g) == 1 or area <= PREFILL_PADDING_SLACK * sum(lengths[i] for i in g)


@pytest.mark.parametrize("lean", [True, False], ids=["lean-decode", "model-forward"])
def test_a_failed_forward_fails_its_requests_and_the_engine_serves_on(
    uncached: LocalTrainingClient, monkeypatch: pytest.MonkeyPatch, lean: bool
) -> None:
    monkeypatch.setattr(uncached.engine, "lean_decode", lean)
    prompt = _encode(uncached, "What is 5*5?")
    params = SamplingParams(max_tokens=6, seed=3)
    want = uncached.sample(prompt, 2, params)
    head = uncached.sampling_model().lm_head  # every forward ends there, whichever path decodes
    real_forward = head.forward
    calls = {"n": 0}

    def flaky(*args, **kwargs):  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 3:  # a decoding step of the next request
            raise RuntimeError("simulated device error")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(head, "forward", flaky)
    with pytest.raises(RuntimeError, match="simulated device error"):
        uncached.sample(prompt, 2, params)
    assert calls["n"] == 3
    assert [s.tokens for s in uncached.sample(prompt, 2, params)] == [s.tokens for s in want]


def test_a_job_that_cannot_start_fails_its_requests_instead_of_hanging(
    uncached: LocalTrainingClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    prompt = _encode(uncached, "What is 6*6?")
    real = uncached.engine._model_fn
    calls = {"n": 0}

    def broken_once():  # type: ignore[no-untyped-def]
        calls["n"] += 1
        if calls["n"] == 1:
            raise RuntimeError("cannot build the sampling view (simulated)")
        return real()

    monkeypatch.setattr(uncached.engine, "_model_fn", broken_once)
    with pytest.raises(RuntimeError, match="simulated"):
        uncached.sample(prompt, 2, SamplingParams(max_tokens=4, seed=1))
    assert len(uncached.sample(prompt, 2, SamplingParams(max_tokens=4, seed=1))) == 2


def test_a_waiting_training_call_goes_before_new_requests(uncached: LocalTrainingClient) -> None:
    """While a training call waits for the worker thread, the sampler admits nothing new: the sequence in
    flight finishes, the call runs, then the later request (sampled from the weights after the call). A
    call cancelled before it started does not leave the sampler waiting for it."""
    prompt = _encode(uncached, "Count to one hundred.")
    datum = Datum(prompt[:-1], prompt[1:], weights=[1.0] * (len(prompt) - 1))
    order: list[str] = []
    eos = uncached.eos_ids
    uncached.eos_ids = set()

    async def tagged(name: str, coro) -> None:  # type: ignore[no-untyped-def]
        await coro
        order.append(name)

    async def run() -> None:
        sampler = await uncached.sampling_client_async()
        uncached.engine.peak_rows = 0
        long_run = asyncio.ensure_future(
            tagged("long", sampler.sample_async(prompt, 1, SamplingParams(max_tokens=150, seed=1)))
        )
        while uncached.engine.peak_rows < 1:  # until it decodes (a fixed sleep lost the race on a busy CPU)
            await asyncio.sleep(0.005)
        cancelled = asyncio.ensure_future(uncached.forward_async([datum], "cross_entropy"))
        await asyncio.sleep(0)
        cancelled.cancel()
        train = asyncio.ensure_future(tagged("train", uncached.forward_async([datum], "cross_entropy")))
        await asyncio.sleep(0.01)
        later = tagged("later", sampler.sample_async(prompt, 1, SamplingParams(max_tokens=3, seed=2)))
        await asyncio.wait_for(asyncio.gather(long_run, train, later), timeout=120)

    try:
        asyncio.run(run())
    finally:
        uncached.eos_ids = eos
    assert order == ["long", "train", "later"]
    assert uncached._waiting_jobs == 0
